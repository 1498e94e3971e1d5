"""Pass: order the tasks of each rank into its `RankProgram`.

Requires: `dag.tasks`.
Guarantees: `dag.programs[strategy.rank]` lists the tasks this rank runs, in
an order where every value is produced before it is read; its inputs are the
joint graph's placeholders and its outputs the joint graph's outputs. With
data parallelism only, every rank runs the same tasks (its collectives thus
come in the same order everywhere).
"""
from __future__ import annotations

from ..ir import RankProgram, TrainingDAG
from ..options import Strategy


def build_rank_programs(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    produced = {i.name for i in dag.inputs}
    for task in dag.tasks:
        missing = [v for v in task.inputs if v not in produced]
        if missing:
            raise AssertionError(f"task {task.name} reads {missing} before any task produces them")
        produced.update(task.outputs)
    dag.programs[strategy.rank] = RankProgram(
        rank=strategy.rank, tasks=list(dag.tasks),
        inputs=[i.name for i in dag.inputs], outputs=[o.name for o in dag.outputs])
    return dag
