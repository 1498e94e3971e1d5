"""Pass: at most one all-gather in flight per gloo process group, in every task.

Requires: the rank programs (`build_rank_programs`, and `fuse_overlapped_pairs` if it
runs), whose tasks hold functional collectives, each followed by the wait of its result.
Guarantees: in every task of every program, an all-gather on a process group that runs it
with gloo (the group's backend for the gathered tensor's device) is issued after the wait
of the task's previous all-gather on that group: where that wait came later (sunk to its
first reader by `reorder_for_overlap`, a gather prefetched ahead of it, a fused pair's
halves interleaved), it moves up to right before the next gather. A wait reads only its
collective, issued earlier, so moving it up changes when the task blocks, never what it
computes. Every other collective, and every group of another backend (NCCL; the fake
group large worlds are planned on), is left as it was.

Why: torch's `ProcessGroupGloo` runs a group's collectives on two worker threads, and two
all-gathers of one group running at once corrupt the process's heap (torch 2.13, CPU:
"malloc(): unaligned tcache chunk detected", "free(): invalid pointer", segfaults, in
a third to a half of the runs of `benchmarks/gloo_gather_race.py`, which calls
functional collectives and nothing of piper_fx). Reduce-scatters (which gloo runs as
all-reduces) in flight together, all-to-alls in flight together, and one all-gather at a
time beside reduce-scatters did not crash there. Under gloo, then,
ZeRO-3 gathers at most one layer ahead whatever `prefetch` asks, and a ZeRO-1/2
prologue's parameter gathers run one at a time (each still overlapping the compute and
the other collectives issued before its wait).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from ..compat import resolve_process_group
from ..ir import Task, TrainingDAG
from ..ops import collective_group, collective_kind, wait_of
from ..options import Strategy


def _runs_on_gloo(group_name: str, device: torch.device) -> bool:
    """Whether the process group named `group_name` runs collectives on `device` with gloo."""
    if not dist.is_gloo_available():
        return False
    try:
        backend = resolve_process_group(group_name)._get_backend(device)
    except RuntimeError:  # no backend for that device: the collective could not run either
        return False
    return isinstance(backend, dist.ProcessGroupGloo)


def _one_gather_at_a_time(task: Task, on_gloo: dict[tuple[str, torch.device], bool]) -> bool:
    """Move each gloo group's all-gather waits up so one gather of a group is in flight at a
    time in `task`; returns whether anything moved. `on_gloo` caches `_runs_on_gloo`."""
    graph = task.graph.graph
    order = {node: index for index, node in enumerate(graph.nodes)}
    last: dict[str, fx.Node] = {}  # per gloo group, the task's latest all-gather so far
    moved = False
    for gather in [n for n in graph.nodes if collective_kind(n) == "all_gather"]:
        group = collective_group(gather)
        where = (group, gather.meta["val"].device)
        if where not in on_gloo:
            on_gloo[where] = _runs_on_gloo(*where)
        if not on_gloo[where]:
            continue
        previous, last[group] = last.get(group), gather
        wait = wait_of(previous) if previous is not None else None
        if wait is not None and order[wait] > order[gather]:
            gather.prepend(wait)  # only this wait moves, and only the next gather reads its place
            moved = True
    return moved


def limit_gathers_in_flight(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    tasks = {id(task): task for program in dag.programs.values() for task in program.tasks.values()}
    on_gloo: dict[tuple[str, torch.device], bool] = {}
    for task in tasks.values():
        if _one_gather_at_a_time(task, on_gloo):
            task.graph.graph.lint()
            task.graph.recompile()
    return dag
