"""Pass: state how parameter gradients are averaged over the data-parallel group.

Requires: the joint graph; gradients of ZeRO's row shards arrive through
`piper::reduce_grad` markers (the backward of `piper::unshard`), those of
replicated parameters (every one at ZeRO-0, 0-d ones at any level) as GRAD
outputs of PARAM placeholders.
Guarantees: no `piper::reduce_grad` node remains; every parameter gradient
output leaves through the placement changes its owner needs, stated as
`piper::redistribute` markers over the dp group (`collectives.redistribute`;
`lower_redistributions` makes them collectives):
  - ZeRO-0 (DDP), and replicated parameters at any level: `Partial(avg)` -> `Replicate()` (an all-reduce);
  - ZeRO-1: `Partial(avg)` -> `Replicate()`, then `Replicate()` -> `Shard(0)`
    (an all-reduce, then this rank's rows);
  - ZeRO-2/3: `Partial(avg)` -> `Shard(0)` (a reduce-scatter).
With several microbatches, ZeRO-0/1 reductions are marked to run once per
step on the gradient summed over microbatches (as DDP under `no_sync` then a
final step); with one, they run in the backward where each gradient is
complete (as DDP's bucketed all-reduce during backward), so they overlap the
rest of the backward. ZeRO-2/3 reduce-scatter each microbatch's gradient where
it is complete. The order is
the backward order, the same on every rank (the graph is the same), so ranks
agree on the order of collectives.
Under mixed precision a gradient is reduced in the policy's reduction dtype
(`reduce_dtype`, else `param_dtype`, as FSDP2): cast to it before its first
change and back to the parameter's dtype after the last.
A sharded parameter read by several modules (a tied weight: Dynamo emits a
marker per module access) is reduced once, on its reads' gradients summed where
the last is complete (under mixed precision in `param_dtype`, as FSDP2's
unsharded parameter accumulates its gradient), not once per read: half the
bytes for a tied embedding, whose first read's whole gradient (the head's) is
then held until the last (the embedding's) is complete, as FSDP2 holds it.
Not under a pipeline: stages are cut later (`split_stages`), and a sum of
reads in two stages would move a whole gradient between them.

Without gradient synchronization (`strategy.gradient_sync` False: the program of
a call inside `piper_fx.no_sync`) nothing is reduced: every parameter's
gradient leaves whole and unreduced, this replica's own (summed over
microbatches), for the step to hold until the window's last call reduces what
it held (`runtime.held_gradients`), as FSDP2 holds its unsharded gradients
under `set_requires_gradient_sync(False)`.

The program of a window's first call after it (`strategy.adds_held_gradients`,
where `reduces_held_gradients` allows it) reduces what the window held with its
own gradients, as DDP's reducer does with the `.grad` its window accumulated:
each parameter's held gradient is an input (`InputRole.HELD_GRAD`, whole, in the
reduction dtype), added to the call's gradient right before its reduction, so
the window's reduction overlaps that call's backward. At ZeRO-2/3, where each
microbatch's gradient is reduce-scattered by itself (the sum is reduced once at
ZeRO-0/1), each adds its share, 1/microbatches of it. Only without a pipeline
or experts.
"""
from __future__ import annotations

import contextlib

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from ..collectives.emit import cast, insert_call
from ..collectives.redistribute import AVG, state_redistribution
from ..ir import GraphInput, InputRole, OutputRole, TrainingDAG, add_placeholder
from ..ops import COMM_NOTE, PHASE, REDUCE_GRAD, STEP_END, cast_dtype
from ..options import Strategy
from ..verify import InvalidGraphError

ADD = torch.ops.aten.add.Tensor
MUL = torch.ops.aten.mul.Tensor


def reduces_held_gradients(strategy: Strategy) -> bool:
    """Whether the program of `strategy` can reduce a window's held gradients with its own
    (`adds_held_gradients`, module docstring)."""
    return strategy.dp > 1 and strategy.pp == 1 and strategy.ep == 1


def _held_input(dag: TrainingDAG, grad: fx.Node, parameter: GraphInput) -> fx.Node:
    """The `InputRole.HELD_GRAD` placeholder of what a window held for `parameter`, like its
    gradient `grad` as it is reduced (whole, in the reduction dtype, contiguous)."""
    graph = dag.joint.graph
    val = grad.meta["val"]
    with graph.inserting_after(graph.find_nodes(op="placeholder")[-1]):
        node = add_placeholder(graph, f"held_{parameter.name}")
    with val.fake_mode:
        node.meta["val"] = torch.empty(val.shape, dtype=val.dtype, device=val.device)
    dag.inputs.append(GraphInput(node.name, InputRole.HELD_GRAD, None, parameter.fqn, held_for=parameter.arg_index))
    return node


def _state(dag: TrainingDAG, strategy: Strategy, grad: fx.Node, changes, group_name: str, *, before: fx.Node,
           like: fx.Node, meta: dict, parameter: GraphInput | None = None) -> fx.Node:
    """State the placement changes of the full gradient `grad` in turn (each a (src, dst) pair) over the
    dp group, in the mixed-precision policy's reduction dtype, after adding what a window held for
    `parameter` where the program does so (`strategy.adds_held_gradients`)."""
    full_shape, dtype = grad.meta["val"].shape, grad.meta["val"].dtype
    reduction_dtype = strategy.mixed_precision.reduction_dtype
    phase = {k: v for k, v in meta.items() if k == PHASE}
    if reduction_dtype is not None and reduction_dtype != dtype and dtype.is_floating_point:
        grad = cast(dag.joint.graph, grad, reduction_dtype, before=before, like=like, meta=phase)
    if strategy.adds_held_gradients:
        held = _held_input(dag, grad, parameter)
        if PHASE not in phase and strategy.microbatches > 1:  # reduced microbatch by microbatch: each its share
            held = insert_call(dag.joint.graph, MUL, (held, 1 / strategy.microbatches), before=before, like=like)
        grad = insert_call(dag.joint.graph, ADD, (grad, held), before=before, like=like, meta=phase)
    for src, dst in changes:
        grad = state_redistribution(dag.joint.graph, grad, src, dst, group_name=group_name, group_size=strategy.dp,
                                    group_rank=strategy.dp_index, global_shape=full_shape, before=before, like=like,
                                    meta=meta)
    if grad.meta["val"].dtype != dtype:
        grad = cast(dag.joint.graph, grad, dtype, before=before, like=like, meta=phase)
    return grad


def _sum_reads_before_reducing(dag: TrainingDAG, param_dtype: torch.dtype | None) -> None:
    """Fold `add(reduce_grad(g1), reduce_grad(g2))`, the sum autograd writes for a parameter
    whose reads each have a marker, into `reduce_grad(g1 + g2)`: one reduction instead of one
    per read, in autograd's order of the sum. Folded in graph order, so a parameter read n
    times ends with one marker. Under mixed precision each read's gradient is the cast back
    of one computed in `param_dtype`: those are summed, and the sum cast once, as FSDP2's
    unsharded parameter in `param_dtype` accumulates them."""
    graph = dag.joint.graph

    def marker(node: object) -> bool:
        return (isinstance(node, fx.Node) and node.op == "call_function" and node.target is REDUCE_GRAD
                and len(node.users) == 1)

    def in_param_dtype(grad: fx.Node) -> fx.Node | None:
        source = grad.args[0] if cast_dtype(grad) is not None else None
        return source if isinstance(source, fx.Node) and source.meta["val"].dtype == param_dtype else None

    for node in list(graph.nodes):
        if node.target is not ADD or len(node.args) != 2 or node.kwargs or not all(map(marker, node.args)):
            continue
        first, second = node.args
        if first is second or first.args[1:] != second.args[1:]:  # another shard's or group's
            continue
        grads = [first.args[0], second.args[0]]
        sources = [in_param_dtype(g) for g in grads]
        if None in sources:
            sources = grads
        total = insert_call(graph, ADD, tuple(sources), before=node,
                            meta={k: v for k, v in node.meta.items() if k != "val"})
        if sources is not grads:
            total = cast(graph, total, grads[0].meta["val"].dtype, before=node, like=node)
        folded = insert_call(graph, REDUCE_GRAD, (total, *first.args[1:]), before=node,
                             meta={k: v for k, v in first.meta.items() if k != "val"})
        node.replace_all_uses_with(folded)
        graph.erase_node(node)
        for dead in (first, second, *grads):
            if not dead.users:
                graph.erase_node(dead)


def _leave_unreduced(dag: TrainingDAG) -> None:
    """Each marker replaced by the whole gradient it reads, and the value (`meta["val"]`) of
    every op after one computed again: a sum of a tied weight's reads in two pipeline stages
    (not folded there, `_sum_reads_before_reducing`) adds whole gradients now, not shards."""
    graph = dag.joint.graph
    stale: set[fx.Node] = set()
    for marker in [n for n in graph.nodes if n.op == "call_function" and n.target is REDUCE_GRAD]:
        stale.update(marker.users)
        marker.replace_all_uses_with(marker.args[0])
        graph.erase_node(marker)
    for node in graph.nodes:
        if node not in stale or node.op != "call_function":
            continue
        vals = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta["val"])
        fake = _fake_mode_of(vals)
        with fake if fake is not None else contextlib.nullcontext():
            val = node.target(*vals[0], **vals[1])
        before, node.meta["val"] = node.meta.get("val"), val
        if not isinstance(before, torch.Tensor) or before.shape != val.shape or before.dtype != val.dtype:
            stale.update(node.users)


def _fake_mode_of(vals) -> object | None:
    found = []
    fx.node.map_aggregate(vals, lambda v: found.append(v.fake_mode) if hasattr(v, "fake_mode") else None)
    return found[0] if found else None


def _lower_markers(dag: TrainingDAG, strategy: Strategy) -> None:
    graph = dag.joint.graph
    inputs_by_arg = dag.inputs_by_argument()
    # Each row-sharded parameter's gradient leaves as its marker's result (its reads' markers folded).
    parameter_of = {node: inputs_by_arg[o.index] for o, node in zip(dag.outputs, dag.output_node().args[0])
                    if o.role is OutputRole.GRAD}
    for marker in [n for n in graph.nodes if n.op == "call_function" and n.target is REDUCE_GRAD]:
        grad, _, group_name = marker.args
        if strategy.zero == 1:
            # ZeRO-1 reduces the step's summed gradient once; ZeRO-2/3 reduce-scatter
            # every microbatch's, so no full gradient outlives its microbatch.
            changes, kind, phase = [(AVG, Replicate()), (Replicate(), Shard(0))], "all_reduce", _once_per_step(strategy)
        else:
            changes, kind, phase = [(AVG, Shard(0))], "reduce_scatter", {}
        parameter = parameter_of.get(marker)
        if strategy.adds_held_gradients and parameter is None:
            raise InvalidGraphError(f"piper_fx: the gradient reduction {marker.name} is no parameter's gradient, "
                                    "to add what a window held to")
        reduced = _state(dag, strategy, grad, changes, group_name, before=marker, like=marker,
                         meta={COMM_NOTE: f"{kind} grad", **phase}, parameter=parameter)
        marker.replace_all_uses_with(reduced)
        graph.erase_node(marker)
    dag.refresh_output_names()


def _once_per_step(strategy: Strategy) -> dict:
    """Metadata deferring a reduction to the step's end when gradients accumulate over microbatches."""
    return {PHASE: STEP_END} if strategy.microbatches > 1 else {}


def _all_reduce_full_gradients(dag: TrainingDAG, strategy: Strategy) -> None:
    inputs_by_arg = dag.inputs_by_argument()
    by_name = {n.name: n for n in dag.joint.graph.nodes}
    new_outputs = []
    for out in dag.outputs:
        node = by_name[out.name]
        source = inputs_by_arg.get(out.index) if out.role is OutputRole.GRAD else None
        if source is not None and source.role is InputRole.PARAM:
            node = _state(dag, strategy, node, [(AVG, Replicate())], dag.dp_group, before=node.next, like=node,
                          meta={COMM_NOTE: f"all_reduce grad {source.fqn}", **_once_per_step(strategy)},
                          parameter=source)
        new_outputs.append(node)
    dag.set_outputs(new_outputs)


def reduce_gradients(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    if not dag.training or strategy.dp == 1:
        return dag
    if strategy.adds_held_gradients and not (strategy.gradient_sync and reduces_held_gradients(strategy)):
        raise InvalidGraphError("piper_fx: a program adding a window's held gradients is planned only where "
                                "`reduces_held_gradients` allows it, with gradient synchronization on")
    if strategy.pp == 1:
        _sum_reads_before_reducing(dag, strategy.mixed_precision.param_dtype)
    if not strategy.gradient_sync:
        _leave_unreduced(dag)
    else:
        _lower_markers(dag, strategy)
        _all_reduce_full_gradients(dag, strategy)  # replicas: every parameter at ZeRO-0, 0-d ones at any level
    dag.joint.graph.lint()
    dag.joint.recompile()
    return dag
