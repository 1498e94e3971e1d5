"""Pass: reorder each task's collectives so communication overlaps compute.

Requires: `dag.tasks` after `bucket_collectives` (functional collectives, each
start followed somewhere by the `wait_tensor` of its result).
Guarantees, when `strategy.overlap` (otherwise the graphs are left as they are):
  - Every wait, with what takes its result apart (a bucket's per-tensor views,
    or a gathered bucket's copy into its tensors, `piper::unpack_bucket`),
    sits right before the first op that reads the collective's result
    (gradient reductions whose result only leaves the task wait at its end), so
    the compute in between runs while the collective is in flight.
  - Parameter all-gathers are prefetched: the i-th gather of a task (with the
    parameter-only ops that fill its buffer) is issued right after the wait of
    gather i - `prefetch`, i.e. while the layer `prefetch` gathers earlier
    computes; the first `prefetch` ones are issued at the task's start. With
    ZeRO-3 buckets of one layer, `prefetch` layers are gathered ahead of the
    one computing, so at most `prefetch` + 1 layers are held at once.
  - Collectives keep their relative issue order on every rank of a group:
    every rank runs this same deterministic pass on the same task graph, so
    the SPMD order is the same everywhere (`tests/test_spmd_order.py`).
Nothing else moves, so the task computes exactly what it did.
"""
from __future__ import annotations

import torch.fx as fx

from ..collectives.buckets import UNPACK_BUCKET
from ..ir import TrainingDAG
from ..ops import WAIT, collective_kind, is_alias, wait_of
from ..options import Strategy


def _aliases(node: fx.Node) -> set[fx.Node]:
    """The ops that only alias `node`'s result (views of it, items of those), transitively."""
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        for user in stack.pop().users:
            if is_alias(user) and user not in found:
                found.add(user)
                stack.append(user)
    return found


def _taken_apart(wait: fx.Node) -> set[fx.Node]:
    """What only takes `wait`'s result apart: its views (a bucket's split into its tensors,
    which read no data), and a gathered bucket's copy into its tensors
    (`piper::unpack_bucket`, which reads the result alone) with the items of that."""
    found = _aliases(wait)
    for node in (wait, *found):
        for user in list(node.users):
            if user.target is UNPACK_BUCKET:
                found |= {user} | _aliases(user)
    return found


def _sink_waits(graph: fx.Graph) -> None:
    """Move each wait, with what takes its result apart (`_taken_apart`), to right before the
    first op that reads the result, or the output. Only later: every input of a moved node
    stays before it, and every user of one is a moved node (kept in order) or at or after
    that first reader."""
    output = graph.find_nodes(op="output")[0]
    for wait in list(graph.find_nodes(op="call_function", target=WAIT)):
        order = {n: i for i, n in enumerate(graph.nodes)}
        moved = _taken_apart(wait)
        readers = {user for node in (wait, *moved) for user in node.users} - moved
        first_reader = min(readers, key=order.__getitem__, default=output)
        for node in sorted((wait, *moved), key=order.__getitem__):
            first_reader.prepend(node)


def _ancestors_after(node: fx.Node, position: int, order: dict[fx.Node, int]) -> list[fx.Node]:
    """`node`'s inputs (transitively) that come after `position`, in graph order."""
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        for parent in stack.pop().all_input_nodes:
            if order[parent] > position and parent not in found:
                found.add(parent)
                stack.append(parent)
    return sorted(found, key=order.__getitem__)


def _prefetch_gathers(graph: fx.Graph, depth: int) -> None:
    starts = [n for n in graph.nodes if collective_kind(n) == "all_gather"]
    waits = [wait_of(s) for s in starts]
    anchor = next(n for n in graph.nodes if n.op != "placeholder").prev  # issue point of the first ones
    for i, start in enumerate(starts):
        if i >= depth:
            anchor = waits[i - depth]
        order = {n: k for k, n in enumerate(graph.nodes)}
        position = order.get(anchor, -1)  # -1: the graph's root, before every node
        if order[start] <= position:
            anchor = start
            continue
        for node in _ancestors_after(start, position, order) + [start]:
            anchor.append(node)
            anchor = node


def reorder_for_overlap(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    if not strategy.overlap:
        return dag
    for task in dag.tasks:
        graph = task.graph.graph
        _sink_waits(graph)
        _prefetch_gathers(graph, strategy.prefetch)
        graph.lint()
        task.graph.recompile()
    return dag
