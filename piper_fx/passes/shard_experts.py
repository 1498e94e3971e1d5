"""Pass: expert parallelism: each rank computes its own experts for the tokens of its ep group.

Requires: the captured joint graph. With `mesh.ep > 1`: expert parameters
(sharded by `prepare`) read through `piper::unshard_experts` markers, their
gradients leaving through `piper::reduce_expert_grad` markers, and the
expert computation tagged by `piper_fx.annotate("EP")` (forward and, through
AOTAutograd, backward). The region's contract, as in any MoE layer with
batched experts: dim 0 of every tensor entering or leaving it indexes the
experts, and expert e's rows depend only on expert e's rows and weights.
Guarantees: no expert marker remains, and the graph computes what the
single-device graph computes, with the experts shared out over the ep group:
  - Inside a region, a rank works in the "rank-major" layout of the same
    (E, ...) shape the model traced: row i holds, for source rank i // (E/ep),
    this rank's local expert i % (E/ep). So the region's ops run unchanged.
  - An expert weight is this rank's block of experts repeated once per source
    rank (no communication); its gradient is folded back to the block (summed
    over sources) and, when the block is replicated over dp/ep groups,
    averaged over them (`Partial(avg)` -> `Replicate()` over the replicas;
    once per step with several microbatches, as DDP; not without gradient
    synchronization, `strategy.gradient_sync` False, whose step averages the
    window's sum at its end, `runtime.held_gradients`).
  - Every other tensor crossing a region's boundary, in either direction and
    in forward and backward alike, is re-sharded over the ep group: its dim
    0's ep equal blocks go from `Shard(0)` to `Shard(1)` of the group's block
    matrix (`collectives.redistribute`: an all-to-all, made by
    `lower_redistributions`). That moves expert-major rows to rank-major
    (dispatch) and back (combine), and is its own backward. Since the exchange is a permutation of rows, placing one on
    every crossing edge keeps the graph exact whichever side an untagged op
    (e.g. AOTAutograd's gradient accumulation) falls on.
Token counts per expert may be anything: dispatch moves the model's fixed-size
expert buffers, so shapes stay static. With ep == 1, EP regions are ignored.
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from ..decompositions import decompositions_for
from ..collectives.emit import insert_traced
from ..collectives.lowering import fold_expert_grad, repeat_experts
from ..collectives.redistribute import AVG, state_redistribution
from ..errors import PiperConfigError, PiperError
from ..ir import HELD_ROLES, TrainingDAG
from ..ops import COMM_NOTE, PHASE, REDUCE_EXPERT_GRAD, STEP_END, UNSHARD_EXPERTS
from ..options import Strategy
from ..sharding.mesh import ep_group_name, expert_replica_group_name


def in_expert_region(node: fx.Node) -> bool:
    return node.op == "call_function" and "EP" in (node.meta.get("custom") or {})


def _inserted(graph: fx.Graph, insert) -> tuple[fx.Node, set[fx.Node]]:
    """Run `insert()` (which adds nodes to `graph`); return its result and the nodes it added."""
    before = set(graph.nodes)
    result = insert()
    return result, set(graph.nodes) - before


def _lower_markers(dag: TrainingDAG, strategy: Strategy) -> set[fx.Node]:
    """Expert weights -> repeated local blocks; expert gradients -> folded and averaged.
    Returns the nodes that make expert gradients (they read rank-major values)."""
    graph = dag.joint.graph
    decompositions = decompositions_for(strategy)
    replicas = expert_replica_group_name(strategy)
    grad_nodes: set[fx.Node] = set()
    for marker in list(graph.nodes):
        if marker.op != "call_function" or marker.target not in (UNSHARD_EXPERTS, REDUCE_EXPERT_GRAD):
            continue
        source = marker.args[0]
        if marker.target is UNSHARD_EXPERTS:
            new = insert_traced(graph, functools.partial(repeat_experts, group_size=strategy.ep), [source],
                                before=marker, like=marker, decompositions=decompositions)
        else:
            new, added = _inserted(graph, lambda: insert_traced(
                graph, functools.partial(fold_expert_grad, group_size=strategy.ep), [source], before=marker,
                like=marker, decompositions=decompositions))
            grad_nodes |= added
            if replicas is not None and strategy.gradient_sync:  # else held unreduced (`piper_fx.no_sync`)
                phase = {PHASE: STEP_END} if strategy.microbatches > 1 else {}
                new, added = _inserted(graph, lambda: state_redistribution(
                    graph, new, AVG, Replicate(), group_name=replicas, group_size=strategy.dp // strategy.ep,
                    group_rank=strategy.dp_index // strategy.ep, global_shape=new.meta["val"].shape,
                    before=marker, like=marker, meta={COMM_NOTE: "all_reduce expert grad over replicas", **phase}))
                grad_nodes |= added
        marker.replace_all_uses_with(new)
        graph.erase_node(marker)
    return grad_nodes


def _parameter_origins(dag: TrainingDAG) -> dict[fx.Node, set[str]]:
    """For every value computed from parameters and buffers alone, the names of those it reads."""
    roles = dag.input_by_name()
    origins: dict[fx.Node, set[str]] = {}
    for node in dag.joint.graph.nodes:
        if node.op == "placeholder":
            if roles[node.name].role in HELD_ROLES:
                origins[node] = {roles[node.name].fqn or node.name}
        elif node.op == "call_function" and node.all_input_nodes and all(i in origins for i in node.all_input_nodes):
            origins[node] = set().union(*(origins[i] for i in node.all_input_nodes))
    return origins


def shard_experts(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    if strategy.ep == 1:
        return dag
    graph = dag.joint.graph
    if not any(in_expert_region(n) for n in graph.nodes):
        raise PiperConfigError(
            "mesh.ep", strategy.ep,
            "a model whose expert computation runs inside piper_fx.annotate('EP'): the compiled graph has no "
            "EP region, so piper_fx cannot tell where to dispatch tokens to the experts (or use mesh.ep=1)")
    experts = {i.fqn: i for i in dag.inputs if i.sharded is not None and i.sharded.mesh_dim == "ep"}
    num_experts = {i.sharded.layout.rows for i in experts.values()}
    grad_nodes = _lower_markers(dag, strategy)
    origins = _parameter_origins(dag)
    exchange = functools.partial(_exchange, group_name=ep_group_name(strategy), num_experts=num_experts,
                                 strategy=strategy)

    def expert_side(node: fx.Node) -> bool:
        return node in grad_nodes or in_expert_region(node)

    exchanged: dict[fx.Node, fx.Node] = {}
    for consumer in list(graph.nodes):
        if consumer.op not in ("call_function", "output"):
            continue
        inside = expert_side(consumer)
        for value in consumer.all_input_nodes:
            if value in origins:  # a weight: never exchanged
                _check_weight_read(consumer, origins[value], set(experts), inside)
                continue
            if value in grad_nodes or expert_side(value) == inside:
                continue
            if value not in exchanged:
                exchanged[value] = exchange(graph, value, consumer, into_region=inside)
            consumer.replace_input_with(value, exchanged[value])
    graph.lint()
    dag.joint.recompile()
    dag.refresh_output_names()
    return dag


def _check_weight_read(consumer: fx.Node, origin: set[str], experts: set[str], inside: bool) -> None:
    if inside and origin - experts:
        raise PiperError(
            f"the EP region reads {sorted(origin - experts)}, which are not expert parameters (at {consumer.name}): "
            "mark their module with piper_fx.mark_experts, or read them outside piper_fx.annotate('EP')")
    if not inside and origin & experts:
        raise PiperError(
            f"expert parameters {sorted(origin & experts)} are read outside piper_fx.annotate('EP') (at "
            f"{consumer.name}): with mesh.ep > 1 a rank holds only its own experts, so all their computation "
            "must be inside the EP region")


def _exchange(graph: fx.Graph, value: fx.Node, consumer: fx.Node, *, into_region: bool, group_name: str,
              num_experts: set[int], strategy: Strategy) -> fx.Node:
    """The all-to-all of `value` across the region's boundary, inserted right after it: stated as
    the re-sharding of its blocks over the ep group (`Shard(0)` -> `Shard(1)`, `collectives.redistribute`)."""
    val = value.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() == 0 or val.shape[0] not in num_experts:
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else type(val).__name__
        raise PiperError(
            f"{value.name} of shape {shape} crosses the boundary of a piper_fx.annotate('EP') region (into "
            f"{consumer.name}); what enters or leaves the expert computation must have the experts "
            f"({sorted(num_experts)}) as dim 0, e.g. a (experts, capacity, width) buffer of dispatched tokens")
    direction = "dispatch" if into_region else "combine"
    before = value.next if value.op != "placeholder" else consumer
    return state_redistribution(graph, value, Shard(0), Shard(1), group_name=group_name, group_size=strategy.ep,
                                group_rank=strategy.ep_index, global_shape=(strategy.ep, *val.shape),
                                before=before, like=value if value.op != "placeholder" else consumer,
                                meta={COMM_NOTE: f"all_to_all {direction} {value.name}"})
