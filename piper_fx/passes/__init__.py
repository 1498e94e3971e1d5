"""The strategy pass pipeline, in the order it runs.

Each pass is a function `(TrainingDAG, Strategy) -> TrainingDAG` in a file of
its own, whose docstring states what it requires and guarantees. The debug
dumps show the DAG after every one of them.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..ir import TrainingDAG
from ..options import Strategy
from ..verify import verification_enabled, verify_dag
from .bucket_collectives import bucket_collectives
from .build_rank_programs import build_rank_programs
from .choose_schedule import choose_schedule
from .fuse_overlapped_pairs import fuse_overlapped_pairs
from .propagate_placements import propagate_placements
from .reduce_gradients import reduce_gradients
from .reorder_for_overlap import reorder_for_overlap
from .shard_experts import shard_experts
from .split_backward import split_backward
from .split_stages import split_stages
from .unshard_parameters import unshard_parameters

Pass = Callable[[TrainingDAG, Strategy], TrainingDAG]

PIPELINE: tuple[Pass, ...] = (
    shard_experts,           # EP: local expert blocks; all-to-all dispatch / combine at EP region boundaries
    unshard_parameters,      # ZeRO: parameter all-gathers (per step, or per use and again in backward)
    reduce_gradients,        # DP/ZeRO: gradient all-reduce / reduce-scatter, averaged over dp
    propagate_placements,    # DTensor-style spec on every node (descriptive)
    choose_schedule,         # the validated pipeline schedule: stage placement and action order
    split_stages,            # joint graph -> per stage: F and B tasks, P/E for once-per-step ops
    split_backward,          # zero-bubble schedules: B -> I (input grads) and W (weight grads)
    bucket_collectives,      # per task: adjacent collectives -> buckets of at most bucket_mb
    reorder_for_overlap,     # per task: waits sunk to first use, ZeRO-3 gathers prefetched
    build_rank_programs,     # schedule + tasks -> each rank's program (with send/recv)
    fuse_overlapped_pairs,   # DualPipe's fused F&B pairs: halves interleaved at their collective waits
)


def run_passes(dag: TrainingDAG, strategy: Strategy, after_pass: Callable[[int, str, TrainingDAG], None],
               pipeline: Sequence[Pass] = PIPELINE) -> TrainingDAG:
    """Run `pipeline` in order; after each pass, verify the DAG (in debug and test
    runs: `verify.verification_enabled`) and hand it to `after_pass` (the dumps)."""
    verify = verification_enabled(strategy)
    for index, strategy_pass in enumerate(pipeline):
        try:
            dag = strategy_pass(dag, strategy)
        except Exception as e:
            e.add_note(f"in piper_fx pass {strategy_pass.__name__!r}")  # the type is kept: a PiperError stays one
            raise
        dag.refresh_output_names()
        if verify:
            verify_dag(dag, strategy_pass.__name__)
        after_pass(index, strategy_pass.__name__, dag)
    return dag
