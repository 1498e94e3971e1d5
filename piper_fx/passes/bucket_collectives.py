"""Pass: merge collectives into buckets of at most `bucket_mb`, one flat buffer each.

Requires: `dag.tasks` (each task's graph holds its collectives as functional
collectives with `val` metadata).
Guarantees: in every task graph, runs of collectives of the same kind, process
group and dtype are merged greedily, in issue order, into buckets of at most
`bucket_mb` megabytes (Inductor's `fx_passes/bucketing` does the merge: one
flat buffer, one collective, then views per tensor). Only collectives adjacent
in issue order merge, and every rank of a group runs the same task graph, so
every rank issues the same buckets in the same order. Our policy on top: a
ZeRO-3 parameter all-gather bucket never spans two layers (`piper_unit`), so a
layer's parameters are gathered together and no more than a layer is held for
a bucket; the other collectives (once-per-step gathers, gradient reductions)
bucket by size alone, and, as DDP's reducer does, in a backward task the first
bucket of a run of reductions (all-reduces, reduce-scatters) is at most 1 MiB
(`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`), so the first gradients
issued, the last layer's, start reducing while the backward has most of its
work left. (An epilogue's reductions have no compute left to hide behind:
they bucket by size alone.) An all-gather bucket gathers from a flat copy of the
rank's shards, not from the rank's slot of the gathered buffer as Inductor's
own merge does: the graph then names no rank, so every rank of the group has
the same task code, compiled once for all of them (`codegen.shared`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx

from ..compat import bucketing, stable_topological_sort, tracing
from ..ir import BACKWARD_KINDS, TrainingDAG
from ..ops import ALL_GATHER, LEGACY_WAIT, UNIT, WAIT
from ..options import Strategy


def _bucket_all_gathers(gm: fx.GraphModule, cap_mb: float) -> None:
    def key(node: fx.Node):
        return (bucketing._ag_group_key(node), node.meta.get(UNIT))

    buckets = bucketing.greedy_bucket_collective_by_mb(
        gm, lambda _: cap_mb, bucketing.is_all_gather_into_tensor, key)
    for bucket in buckets:  # one group and gathered dtype each (`_ag_group_key`)
        _, group_size, group_name = bucket[0].args
        dtype = bucket[0].meta["val"].dtype

        def trace_args(inputs: list[fx.Node], group_size=group_size, group_name=group_name, dtype=dtype) -> tuple:
            return [node.meta["val"] for node in inputs], group_name, group_size, dtype
        bucketing.process_collective_bucket(gm.graph, bucket, _gather_from_flat_copy, trace_args)


def _nbytes(collective: fx.Node) -> int:
    """What a collective counts against a bucket's cap, as Inductor's merge counts it: the
    larger of its input and its result."""
    values = (collective.meta["val"], collective.all_input_nodes[0].meta["val"])
    return max(v.numel() * v.element_size() for v in values)


def _first_buckets(gm: fx.GraphModule, is_kind, group_key, first_mb: float) -> set[fx.Node]:
    """DDP's first bucket of each run of reductions that Inductor's merge would bucket
    together (adjacent in wait order, one group key): its leading collectives up to
    `first_mb` MiB, at least one."""
    first: set[fx.Node] = set()
    key, size, full = None, 0, False
    for node in gm.graph.nodes:
        if node.target is not WAIT or not is_kind(node.args[0]):
            continue
        collective, nbytes = node.args[0], _nbytes(node.args[0])
        if group_key(collective) != key:
            key, size, full = group_key(collective), 0, False
        full = full or (size > 0 and size + nbytes > first_mb * 2**20)
        if not full:
            first.add(collective)
            size += nbytes
    return first


def _bucket_reductions(gm: fx.GraphModule, bucket_mb: float, small_first: bool) -> None:
    """Merge the gradient reductions (reduce-scatters, all-reduces) greedily, in issue
    order, into buckets of at most `bucket_mb`, but, with `small_first`, the first of each
    run, which takes at most 1 MiB (`_first_buckets`): Inductor's grouping and merge, with
    DDP's policy."""
    first_mb = min(bucket_mb, dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20) if small_first else bucket_mb
    kinds = ((bucketing.is_reduce_scatter_tensor, bucketing._rs_group_key, bucketing.bucket_reduce_scatter_by_mb,
              lambda buckets: bucketing.merge_reduce_scatter(gm, buckets, "default")),
             (bucketing.is_all_reduce_tensor, bucketing._ar_group_key, bucketing.bucket_all_reduce_by_mb,
              lambda buckets: [bucketing.merge_all_reduce_bucket(gm.graph, b, "default") for b in buckets]))
    for is_kind, group_key, group, merge in kinds:
        first = _first_buckets(gm, is_kind, group_key, first_mb)
        buckets = group(gm, lambda _: first_mb, lambda wait: wait.args[0] in first) \
            + group(gm, lambda _: bucket_mb, lambda wait: is_kind(wait.args[0]) and wait.args[0] not in first)
        if buckets:
            merge(buckets)


def _gather_from_flat_copy(inputs: list, group_name: str, group_size: int, dtype: torch.dtype) -> list:
    """A bucket's all-gather, traced into the graph: the shards, cast to the gathered dtype
    (the bucket takes a cast's input, and casts it itself), copied into one flat input,
    gathered by the functional collective, and viewed per tensor. (Gathering the same
    flat input with the `_out` form, into a buffer of the graph's, trained wrong under
    Inductor on gloo, losses off by 1e-3.)"""
    sizes = [t.numel() for t in inputs]
    flat = torch.cat([t.reshape(-1).to(dtype) for t in inputs])
    gathered = WAIT(ALL_GATHER(flat, group_size, group_name)).reshape(group_size, -1)
    return [part.reshape((t.shape[0] * group_size, *t.shape[1:]))
            for part, t in zip(torch.split_with_sizes(gathered, sizes, dim=1), inputs)]


def _wait_with_functional_collectives(gm: fx.GraphModule) -> None:
    """Inductor's reduce-scatter merge waits with the legacy `c10d_functional.wait_tensor`,
    which does not wait for work issued by `_c10d_functional` ops on gloo: the bucket
    would be read before it is reduced. Use the op that matches the collective."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is LEGACY_WAIT:
            node.target = WAIT


def bucket_collectives(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    if strategy.dp == 1:
        return dag
    # Outside Dynamo's tracing context: the merge traces in the fake mode of the
    # graph's own values (our capture's), which it finds only when no context names another.
    with tracing(None):
        for task in dag.tasks:
            gm = task.graph
            _bucket_all_gathers(gm, strategy.bucket_mb)
            _bucket_reductions(gm, strategy.bucket_mb, small_first=task.kind in BACKWARD_KINDS)
            _wait_with_functional_collectives(gm)
            stable_topological_sort(gm.graph)  # keeps each collective where it was, where valid
            gm.graph.lint()
            gm.recompile()
    return dag
