"""Pass: build and validate the pipeline schedule the strategy names.

Requires: a strategy with `schedule`, `pp`, `microbatches`, `stages_per_rank`.
Guarantees: `dag.schedule` is a validated `schedules.Schedule` (every stage and
microbatch covered on the rank holding the stage, dependencies respected, no
deadlock), forward-only when the graph is not training. Later passes take the
stage placement (`stage_to_rank`) and action order from it, never from the
preset's name.
"""
from __future__ import annotations

from ..ir import TrainingDAG
from ..options import Strategy
from ..schedules import ActionKind, Schedule, build


def _forward_only(schedule: Schedule) -> Schedule:
    actions = [[a for a in row if a.kind is ActionKind.F] for row in schedule.actions]
    return Schedule(schedule.name + " (forward only)", schedule.num_ranks, schedule.num_microbatches,
                    schedule.stage_to_rank, actions)


def choose_schedule(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    if isinstance(strategy.schedule, Schedule):  # the user's own, validated with the options
        schedule = strategy.schedule
    else:
        schedule = build(strategy.schedule, strategy.pp, strategy.microbatches, strategy.stages_per_rank)
    dag.schedule = schedule if dag.training else _forward_only(schedule)
    return dag
