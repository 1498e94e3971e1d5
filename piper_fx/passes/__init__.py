"""The strategy pass pipeline, in the order it runs.

Each pass is a function `(TrainingDAG, Strategy) -> TrainingDAG` in a file of
its own, whose docstring states what it requires and guarantees. `PIPELINE`
lists them with the level of the program each takes and leaves (`ir.Level`:
the joint graph, the staged tasks, the rank programs): a pass rewrites within
a level or lowers the program to the next one (ARCHITECTURE.md). `run_passes`
holds every pass to its levels and, in debug and test runs, verifies what it
left (`verify.verify_dag`). The debug dumps show the DAG after every pass.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from ..ir import Level, TrainingDAG
from ..options import Strategy
from ..verify import InvalidGraphError, verification_enabled, verify_dag
from .bucket_collectives import bucket_collectives
from .build_rank_programs import build_rank_programs
from .checkpoint_activations import checkpoint_activations
from .choose_schedule import choose_schedule
from .functionalize_random import functionalize_random
from .limit_gathers_in_flight import limit_gathers_in_flight
from .lower_redistributions import lower_redistributions
from .fuse_overlapped_pairs import fuse_overlapped_pairs
from .propagate_placements import propagate_placements
from .reduce_gradients import reduce_gradients
from .reorder_for_overlap import reorder_for_overlap
from .shard_experts import shard_experts
from .split_backward import split_backward
from .split_stages import split_stages
from .unshard_parameters import unshard_parameters
from .update_buffers import update_buffers

PassFunction = Callable[[TrainingDAG, Strategy], TrainingDAG]


@dataclass(frozen=True)
class Pass:
    """A pass and the levels of the program it takes and leaves."""

    run: PassFunction
    takes: Level
    makes: Level

    @property
    def name(self) -> str:
        return self.run.__name__


JOINT, STAGED, PROGRAMS = Level.JOINT, Level.STAGED, Level.PROGRAMS

PIPELINE: tuple[Pass, ...] = (
    #    the pass                takes     leaves
    Pass(functionalize_random,   JOINT,    JOINT),     # random ops (dropout) -> Philox of (global element, op, step)
    Pass(checkpoint_activations, JOINT,    JOINT),     # recomputable activations copied into the backward
    Pass(shard_experts,          JOINT,    JOINT),     # EP: local expert blocks; re-sharding at EP region boundaries
    Pass(unshard_parameters,     JOINT,    JOINT),     # ZeRO: where shards are needed whole, once per step or per use
    Pass(reduce_gradients,       JOINT,    JOINT),     # DP/ZeRO: gradients Partial(avg) -> Replicate() or Shard(0)
    Pass(lower_redistributions,  JOINT,    JOINT),     # every placement change -> its collective (one table)
    Pass(propagate_placements,   JOINT,    JOINT),     # DTensor-style spec on every node (descriptive)
    Pass(choose_schedule,        JOINT,    JOINT),     # the validated schedule: stage placement and action order
    Pass(split_stages,           JOINT,    STAGED),    # per stage: F and B tasks, P/E for once-per-step ops
    Pass(update_buffers,         STAGED,   STAGED),    # buffers the forward mutates: copied into in its task
    Pass(split_backward,         STAGED,   STAGED),    # zero-bubble schedules: B -> I (input grads) and W (weight grads)
    Pass(bucket_collectives,     STAGED,   STAGED),    # per task: adjacent collectives -> buckets of at most bucket_mb
    Pass(reorder_for_overlap,    STAGED,   STAGED),    # per task: waits sunk to first use, ZeRO-3 gathers prefetched
    Pass(build_rank_programs,    STAGED,   PROGRAMS),  # schedule + tasks -> each rank's program (with send/recv)
    Pass(fuse_overlapped_pairs,  PROGRAMS, PROGRAMS),  # DualPipe's F&B pairs: halves interleaved at collective waits
    Pass(limit_gathers_in_flight, PROGRAMS, PROGRAMS),  # gloo groups: one all-gather in flight at a time
)


def position(function: PassFunction, pipeline: Sequence[Pass] = PIPELINE) -> int:
    """Where `function` runs in `pipeline`."""
    return [p.run for p in pipeline].index(function)


def dump_path(index: int, name: str) -> str:
    """The debug dump of the program after pass `index` (named `name`) of a pipeline, numbered
    after the Dynamo graph (00) and the joint graph (01)."""
    return f"passes/{index + 2:02d}_{name}.py"


def run_passes(dag: TrainingDAG, strategy: Strategy, after_pass: Callable[[int, str, TrainingDAG], None],
               pipeline: Sequence[Pass | PassFunction] = PIPELINE) -> TrainingDAG:
    """Run `pipeline` in order (a bare function is a pass within the level it is given).
    Each pass must take and leave the levels it declares, or this raises
    `InvalidGraphError`; after each, in debug and test runs
    (`verify.verification_enabled`), the DAG is verified at the level it is at; then
    it is handed to `after_pass` (the dumps)."""
    verify = verification_enabled(strategy)
    for index, entry in enumerate(pipeline):
        strategy_pass = entry if isinstance(entry, Pass) else Pass(entry, dag.level, dag.level)
        if dag.level is not strategy_pass.takes:
            raise InvalidGraphError(f"piper_fx pass {strategy_pass.name!r} takes a program at the "
                                    f"{strategy_pass.takes}, but is given one at the {dag.level}")
        try:
            dag = strategy_pass.run(dag, strategy)
        except Exception as e:
            e.add_note(f"in piper_fx pass {strategy_pass.name!r}")  # the type is kept: a PiperError stays one
            raise
        if dag.level is not strategy_pass.makes:
            raise InvalidGraphError(f"piper_fx pass {strategy_pass.name!r} should leave a program at the "
                                    f"{strategy_pass.makes}, but left one at the {dag.level}")
        dag.refresh_output_names()
        if verify:
            verify_dag(dag, strategy_pass.name)
        after_pass(index, strategy_pass.name, dag)
    return dag
