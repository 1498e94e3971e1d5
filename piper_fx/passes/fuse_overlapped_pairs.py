"""Pass: interleave the two halves of every overlapped F&B pair's fused task at their collectives.

Requires: `dag.programs` from `build_rank_programs`, where an overlapped pair
(DualPipe's F&B) is one `Run` of a fused task (its first half, then its
second) whose `parts` name the two tasks, held by the program too, and those
tasks' graphs after `reorder_for_overlap` (each collective's wait just before
its first use).
Guarantees: with `strategy.overlap`, every fused task is replaced by one
computing the same values, whose halves interleave: op by op, the half that
reaches its next collective with the fewest matmuls runs, and no half waits
for a collective behind which no matmul has run while the other can go on. So
each half issues its communication early and, while one microbatch's
all-to-all (or gather, or reduction) is in flight, the other microbatch
computes: DualPipe's point, done by the graph's order rather than by two
streams. Without it, the fused tasks stay as they are: the first half runs
whole, then the second. A collective's issue order within each half is kept
and the fused graph is the same on every rank of a group (it is made from the
same tasks by this same deterministic pass), so collectives stay SPMD-ordered.
One fused task serves every pair of the same two tasks, whatever their
microbatches.
"""
from __future__ import annotations

import torch.fx as fx

from ..ir import Run, Task, TrainingDAG
from ..ops import WAIT, collective_kind, is_heavy
from ..options import Strategy
from .task_graphs import FusedOrder, fuse_tasks


def _interleaved(halves: list[list[fx.Node]]) -> FusedOrder:
    """(half, node) in run order. The half that reaches its first collective
    with the fewest matmuls starts, so communication begins early; a half then
    runs until its next op is the wait of a collective behind which no matmul
    has run yet, and the other half runs meanwhile. When both must wait, the
    collective issued first is waited for."""
    cursors = [0] * len(halves)
    issued: dict[fx.Node, tuple[int, int]] = {}  # collective -> (matmuls run before it, issue order)
    heavy_run = 0
    order: FusedOrder = []

    def pending_wait(half: int) -> fx.Node | None:
        node = halves[half][cursors[half]]
        return node.args[0] if node.target is WAIT and node.args[0] in issued else None

    def blocked(half: int) -> bool:
        collective = pending_wait(half)
        return collective is not None and issued[collective][0] == heavy_run

    def matmuls_before_next_collective(half: int) -> float:
        heavy = 0
        for k, node in enumerate(halves[half][cursors[half]:]):
            if collective_kind(node) is not None:
                return heavy
            if k and node.target is WAIT:
                break
            heavy += is_heavy(node)
        return float("inf")

    current = min(range(len(halves)), key=matmuls_before_next_collective)
    while True:
        live = [h for h in range(len(halves)) if cursors[h] < len(halves[h])]
        if not live:
            return order
        ready = [h for h in live if not blocked(h)]
        if current in ready:
            half = current
        elif ready:
            half = min(ready, key=matmuls_before_next_collective)
        else:  # every half must wait: the oldest collective first
            half = min(live, key=lambda h: issued[pending_wait(h)][1])
        node = halves[half][cursors[half]]
        cursors[half] += 1
        order.append((half, node))
        if collective_kind(node) is not None:
            issued[node] = (heavy_run, len(issued))
        heavy_run += is_heavy(node)
        current = half


def fuse_overlapped_pairs(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    if not strategy.overlap:
        return dag
    fused: dict[str, Task] = {}
    for program in dag.programs.values():
        for instruction in program.instructions:
            if not (isinstance(instruction, Run) and instruction.parts):
                continue
            if instruction.task not in fused:
                parts = [program.tasks[run.task] for run in instruction.parts]
                fused[instruction.task] = fuse_tasks(instruction.task, parts, order=_interleaved)
            program.tasks[instruction.task] = fused[instruction.task]
    return dag
