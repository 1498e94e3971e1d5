"""Pass: merge collectives into buckets of at most `bucket_mb`, one flat buffer each.

Requires: `dag.tasks` (each task's graph holds its collectives as functional
collectives with `val` metadata).
Guarantees: in every task graph, runs of collectives of the same kind, process
group and dtype are merged greedily, in issue order, into buckets of at most
`bucket_mb` megabytes (Inductor's `fx_passes/bucketing` groups them, and its
merge functions make each bucket: one flat buffer, one collective, then views
per tensor). Each bucket layout (function, and its inputs' shapes, strides and
dtypes) is traced once in the process (the traces of the layouts most recently
used are kept, without their values), and each bucket gets the trace's nodes
with values computed from its own inputs: a deep model's layers have the same
buckets, and so do a recompile and the next model of the same shapes. Only
collectives adjacent in issue order merge, and every rank of a group runs the
same task graph, so every rank issues the same buckets in the same order. Our
policy on top: a ZeRO-3 parameter all-gather bucket never spans two layers
(`piper_unit`), so a layer's parameters are gathered together and no more than
a layer is held for a bucket; the other collectives (once-per-step gathers, gradient reductions)
bucket by size alone, and, as DDP's reducer does, in a backward task the first
bucket of a run of all-reduces is at most 1 MiB
(`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`), so the first gradients
issued, the last layer's, start reducing while the backward has most of its
work left. (An epilogue's reductions have no compute left to hide behind:
they bucket by size alone; so do ZeRO-2/3's reduce-scatters, `_bucket_reductions`.)
A bucket is made of our ops (`collectives.buckets`), which the compiled code
calls as they are: an all-gather bucket (a gather grouped with no other is a
bucket of one) is one `piper::gather_bucket`, which copies the rank's shards
into its own slot of the gathered buffer and gathers in place, as FSDP2 does
(the graph names no rank: every rank of the group has the same task code,
compiled once for all of them, `codegen.shared`), and its tensors are copied
out of the gathered buffer by one `piper::unpack_bucket`, as FSDP2's
`split_with_sizes_copy`; a reduction's flat buffer is one `piper::flat_bucket`.
Inductor would make a kernel of each of those copies (lowering the `torch.cat`
its merge functions trace, and each gathered tensor's copy out of the buffer),
each one more C++ build in a cold compile.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx

from ..collectives.buckets import FLAT_BUCKET, GATHER_BUCKET, UNPACK_BUCKET
from ..collectives.emit import KeptTraces, layout, repair_values, run_on_values
from ..compat import (bucketing, detect_fake_mode, sort_bucket_region, stable_topological_sort, takes_cast,
                      trace_bucket, tracing)
from ..ir import BACKWARD_KINDS, TrainingDAG
from ..ops import ALL_REDUCE, REDUCE_SCATTER, UNIT, WAIT, is_wait
from ..options import Strategy


def _bucket_all_gathers(gm: fx.GraphModule, cap_mb: float, traces: KeptTraces) -> None:
    def key(node: fx.Node):
        return (bucketing._ag_group_key(node), node.meta.get(UNIT))

    buckets = bucketing.greedy_bucket_collective_by_mb(
        gm, lambda _: cap_mb, bucketing.is_all_gather_into_tensor, key)
    # A gather that Inductor groups with no other (a unit of one parameter, a gather over
    # `bucket_mb` alone) is a bucket of one: every all-gather gathers in place.
    grouped = {node for bucket in buckets for node in bucket}
    buckets += [[node] for node in gm.graph.nodes
                if bucketing.is_all_gather_into_tensor(node) and node not in grouped
                and len(node.users) == 1 and is_wait(next(iter(node.users)))]
    for bucket in buckets:  # one group and gathered dtype each (`_ag_group_key`)
        _, group_size, group_name = bucket[0].args
        dtype = bucket[0].meta["val"].dtype

        def trace_args(inputs: list[fx.Node], group_size=group_size, group_name=group_name, dtype=dtype) -> tuple:
            return [node.meta["val"] for node in inputs], group_name, group_size, dtype
        _merge(gm.graph, bucket, _gather_bucket, trace_args, traces)


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


def _bucket_reductions(gm: fx.GraphModule, bucket_mb: float, small_first: bool, traces: KeptTraces) -> None:
    """Merge the gradient reductions (reduce-scatters, all-reduces) greedily, in issue
    order, into buckets of at most `bucket_mb`, but, with `small_first`, the first of each
    run of all-reduces, which takes at most 1 MiB (`_first_buckets`): Inductor's grouping
    and merge functions, with DDP's policy for all-reduces. Reduce-scatters (ZeRO-2/3)
    bucket by size alone: a small first one ended inside some layer's gradients, making
    that layer's backward code unlike the others' (one more region to compile,
    `codegen.regions`); without it, on the example GPT, step times did not move (12 blocks
    of width 64, 4 of width 128) and the 12 blocks' backward compiles one region less."""
    first_mb = min(bucket_mb, dist._DEFAULT_FIRST_BUCKET_BYTES / 2**20)
    kinds = ((bucketing.is_reduce_scatter_tensor, bucketing._rs_group_key, bucketing.bucket_reduce_scatter_by_mb,
              _reduce_scatter_from_flat_copy, _reduce_scatter_args, False),
             (bucketing.is_all_reduce_tensor, bucketing._ar_group_key, bucketing.bucket_all_reduce_by_mb,
              _all_reduce_from_flat_copy, _all_reduce_args, small_first))
    for is_kind, group_key, group, merge_fn, trace_args, first_small in kinds:
        first = _first_buckets(gm, is_kind, group_key, first_mb) if first_small else set()
        firsts = group(gm, lambda _: first_mb, lambda wait: wait.args[0] in first) if first else []
        buckets = firsts + group(gm, lambda _: bucket_mb,
                                 lambda wait: is_kind(wait.args[0]) and wait.args[0] not in first)
        for bucket in buckets:
            _merge(gm.graph, bucket, merge_fn, lambda inputs, first=bucket[0], args=trace_args: args(first, inputs),
                   traces)


def _reduce_scatter_args(first: fx.Node, inputs: list[fx.Node]) -> tuple:
    """The arguments of `_reduce_scatter_from_flat_copy` for a bucket led by `first`."""
    _, reduce_op, group_size, group_name = first.args
    return [n.meta["val"] for n in inputs], group_name, group_size, reduce_op, first.meta["val"].dtype


def _all_reduce_args(first: fx.Node, inputs: list[fx.Node]) -> tuple:
    """The arguments of `_all_reduce_from_flat_copy` for a bucket led by `first`."""
    _, reduce_op, group_name = first.args
    return [n.meta["val"] for n in inputs], group_name, reduce_op, first.meta["val"].dtype


# The process's bucket traces (make_fx, about 40 ms a bucket), by what a trace depends on: the
# function and its arguments (tensors by layout). The layers of a deep model have buckets of one
# layout, and a compile whose buckets have the layouts of an earlier one's (a recompile for another
# batch size keeps most; the next model of a test, all) traces none of them.
_TRACES = KeptTraces(kept=256)

_BUCKET_META = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "custom")


def _merge(graph: fx.Graph, bucket: list[fx.Node], fn: Callable, trace_args: Callable, traces: KeptTraces) -> None:
    """Replace the collectives `bucket` (each with its one wait) by `fn`'s trace (`traces`) on
    their inputs, right after the last of them: Inductor's `process_collective_bucket`, but
    the bucket's values computed from its inputs' (a trace serves every bucket of its
    layout), and the new nodes given the first collective's annotations (Inductor's also
    records every new node's provenance from every collective, quadratic in the bucket's
    size: 0.6 s per rank of a GPT of 12 blocks under ZeRO-3)."""
    inputs, waits, casts = [], [], []
    for collective in bucket:
        (wait,) = collective.users
        source = collective.args[0]
        if takes_cast(collective):  # the bucket casts itself
            casts.append(source)
            source = source.args[0]
        inputs.append(source)
        waits.append(wait)
    args = trace_args(inputs)
    traced = traces.get((fn, tuple(layout(a) for a in args)), lambda: trace_bucket(fn, args))
    placeholders = traced.graph.find_nodes(op="placeholder")
    env = dict(zip(placeholders, inputs))
    fake_mode = detect_fake_mode([n.meta["val"] for n in inputs])
    new_nodes: list[fx.Node] = []
    outputs: list[fx.Node] = []
    meta = {key: bucket[0].meta[key] for key in _BUCKET_META if key in bucket[0].meta}
    with graph.inserting_before(bucket[-1].next), fake_mode:
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = [env[n] for n in node.args[0]]
                continue
            copy = graph.node_copy(node, env.__getitem__)
            copy.meta = {**meta, "val": run_on_values(copy)}
            env[node] = copy
            new_nodes.append(copy)
    users = [user for wait in waits for user in wait.users]
    relaid = {output for wait, output in zip(waits, outputs)
              if "val" not in wait.meta or layout(output.meta["val"]) != layout(wait.meta["val"])}
    for wait, output in zip(waits, outputs):
        wait.replace_all_uses_with(output)
    repair_values(users, relaid)
    for collective, wait in zip(bucket, waits):
        graph.erase_node(wait)
        graph.erase_node(collective)
    for cast in reversed(casts):
        graph.erase_node(cast)
    sort_bucket_region(graph, new_nodes, inputs)


def _gather_bucket(inputs: list, group_name: str, group_size: int, dtype: torch.dtype) -> list:
    """A bucket's all-gather, traced into the graph: the shards, cast to the gathered dtype
    (the bucket takes a cast's input, and casts it itself), gathered in place by one op
    (`piper::gather_bucket`), and copied out per tensor by one op (`piper::unpack_bucket`),
    each contiguous: a shard of one row taken out as a view of the bucket would be strided
    (its rows a rank's part apart), and the plan's values say contiguous (a task Inductor
    compiled for them refused the view). Copied out by Inductor's own kernels, the copies
    were a cold compile's kernels of their own, or fused into a layer's, for each layout of
    bucket: on a GPT of 12 blocks under ZeRO-3, 6 of the 25 kernels built. (Inductor's own
    merge gathers in place too, with the `_out` collective into a buffer of the graph's:
    that trained wrong under Inductor on gloo, losses off by 1e-3, and names the rank.)"""
    gathered = WAIT(GATHER_BUCKET(inputs, group_size, group_name, dtype))
    shapes = [(t.shape[0] * group_size, *t.shape[1:]) if t.dim() else (group_size,) for t in inputs]
    return list(UNPACK_BUCKET(gathered, group_size, [len(s) for s in shapes], [n for s in shapes for n in s]))


def _reduce_scatter_from_flat_copy(inputs: list, group_name: str, group_size: int, reduce_op: str,
                                   dtype: torch.dtype) -> list:
    """A bucket's reduce-scatter, traced into the graph: Inductor's merge
    (`bucketing.reduce_scatter_merge_fn_to_trace`) with the flat input made by one op, and
    waited for by the functional collectives' wait (Inductor's waits with the legacy
    `c10d_functional.wait_tensor`, which on gloo does not wait for `_c10d_functional` work:
    the bucket would be read before it is reduced)."""
    flat = FLAT_BUCKET(inputs, group_size, dtype)
    reduced = WAIT(REDUCE_SCATTER(flat, reduce_op, group_size, group_name))
    parts = reduced.split([t.numel() // group_size for t in inputs])
    return [part.reshape((t.shape[0] // group_size, *t.shape[1:])) for part, t in zip(parts, inputs)]


def _all_reduce_from_flat_copy(inputs: list, group_name: str, reduce_op: str, dtype: torch.dtype) -> list:
    """A bucket's all-reduce, traced into the graph: Inductor's merge
    (`bucketing.all_reduce_merge_fn_to_trace`) with the flat input made by one op, and the
    functional wait (as the reduce-scatter's)."""
    flat = FLAT_BUCKET(inputs, 1, dtype)
    reduced = WAIT(ALL_REDUCE(flat, reduce_op, group_name))
    return [part.reshape(t.shape) for part, t in zip(reduced.split([t.numel() for t in inputs]), inputs)]


def bucket_collectives(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    if strategy.dp == 1:
        return dag
    # Outside Dynamo's tracing context: the merge traces in the fake mode of the
    # graph's own values (our capture's), which it finds only when no context names another.
    traces = _TRACES
    with tracing(None):
        for task in dag.tasks:
            gm = task.graph
            _bucket_all_gathers(gm, strategy.bucket_mb, traces)
            _bucket_reductions(gm, strategy.bucket_mb, small_first=task.kind in BACKWARD_KINDS, traces=traces)
            stable_topological_sort(gm.graph)  # keeps each collective where it was, where valid
            gm.graph.lint()
            gm.recompile()
    return dag
