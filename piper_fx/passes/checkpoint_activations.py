"""Pass: recompute activations in the backward instead of keeping them (activation checkpointing).

Requires: the joint graph after `functionalize_random` (a random op is Philox
of fixed offsets, so a recomputed one draws the same values) and before the
collective passes (the only communication in the graph is the ZeRO and
expert markers).
Guarantees: every backward read of a recomputable forward value reads a copy
of it instead, made just before the first backward op that reads it, from
copies of its own recomputable inputs, down to values that are kept. So only
kept values cross from the forward to the backward, and a layer's recomputed
activations live only while its backward runs (the backward's `detach`es of
forward values, which AOTAutograd puts at its start, are first moved to just
before their first reader, else they would recompute every layer at once). A copy keeps the metadata of
the op it copies (`seq_nr`, `nn_module_stack`, annotations): being read by the
backward alone, it is a backward op (`ir.forward_nodes`), and `split_stages`
puts it in the backward task of its op's stage (the B task of that
microbatch, or its I or W task once `split_backward` splits B). Each copy
names the value it recomputes (`ops.RECOMPUTES`): where pipeline stages split
a region, `split_stages` keeps the values crossing the cut instead.
Recomputable forward ops, each in a region read only inside it (a region's
outputs, the next region's inputs, are kept):
  - with `activation_checkpointing` "full", every op inside a unit (the layers
    ZeRO-3 gathers one at a time, `sharding.units`): a unit's inputs, and what
    lies outside units, are kept;
  - with "selective", the same but matmul and attention outputs are kept
    (`ops.is_heavy`), as PyTorch's selective checkpointing keeps by default;
  - whatever the mode, the ops the model's own `torch.utils.checkpoint` tagged
    to recompute (AOTAutograd's `recompute` meta), so its regions keep only
    their inputs, as in eager PyTorch.
Whatever the mode, also what costs no memory to recompute
(`_free_to_recompute`): a value the backward reads that light ops (not matmuls
or attention) make from the parameters and the values the backward reads
anyway, such as a GELU's output from its input (which its backward reads) or a
layer norm's output from its input. Keeping it would hold its bytes from the
forward to the backward; recomputing it costs a pointwise pass in the backward,
and keeps nothing more. (AOTAutograd's min-cut partitioner, which Inductor
uses, keeps such a value where the backward needs it materialized, as the
input of a weight gradient's matmul.) A sharded parameter's gathered value that
the backward can read without another collective counts as a parameter does
(`_free_with_gathered`), so a layer norm's output is recomputed from its bias at
every ZeRO level: at ZeRO-1/2 every parameter is gathered once per step and kept
for the backward (`unshard_parameters`); at ZeRO-3 the backward gathers each
unit again, and a parameter of a unit whose other parameters it gathers joins
that gather.
Never recomputed: placeholders, markers (a read of a sharded parameter: the
collective passes gather it again for the backward), ops inside an EP
region (recomputing them would dispatch the tokens to the experts again), and
ops that read a buffer the forward updates (a batch norm's, with its running
statistics): `update_buffers` updates it in place in the forward, so a
backward would read the new value (the backward reads their values kept).
"""
from __future__ import annotations

import operator
from typing import Collection

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..ir import HELD_ROLES, TrainingDAG, forward_nodes
from ..ops import EXPERT_MARKERS, RECOMPUTES, UNSHARD, ZERO_MARKERS, is_heavy
from ..options import Strategy
from ..sharding.units import find_units, unit_of
from .shard_experts import in_expert_region
from .unshard_parameters import parameter_only_chain

_RECOMPUTE = (CheckpointPolicy.PREFER_RECOMPUTE, CheckpointPolicy.MUST_RECOMPUTE)


def _region(node: fx.Node, strategy: Strategy) -> tuple | None:
    """The region `node` would be recomputed in: the model's checkpoint region that tagged it,
    else (with the option on) its unit; None if it is in neither."""
    if node.meta.get("recompute") in _RECOMPUTE:
        return ("torch.utils.checkpoint", node.meta.get("ac_graph_id"))
    if strategy.activation_checkpointing != "none":
        unit = unit_of(node, strategy.units)
        return None if unit is None else ("unit", unit)
    return None


def _recomputable(node: fx.Node, strategy: Strategy, forward: set[fx.Node]) -> bool:
    """Whether `node` is recomputed: in a region, read only inside it (a region's outputs are the
    next one's inputs, which are kept), and not a kept kind of op."""
    if node.op != "call_function" or node.target in ZERO_MARKERS + EXPERT_MARKERS or in_expert_region(node):
        return False
    region = _region(node, strategy)
    if region is None or any(_region(user, strategy) != region for user in node.users if user in forward):
        return False
    tagged = region[0] == "torch.utils.checkpoint"
    return tagged or strategy.activation_checkpointing == "full" or not is_heavy(node)


def _light(node: fx.Node) -> bool:
    """A pure op whose recomputation is as cheap as reading its output: not a matmul or
    attention, not a marker, not inside an EP region."""
    return node.op == "call_function" and not is_heavy(node) and not node.is_impure() \
        and node.target not in ZERO_MARKERS and not _expert(node)


def _expert(node: fx.Node) -> bool:
    return in_expert_region(node) or node.target in EXPERT_MARKERS


def _read_by_backward(graph: fx.Graph, forward: set[fx.Node]) -> set[fx.Node]:
    return {value for node in graph.nodes if node.op == "call_function" and node not in forward
            for value in node.all_input_nodes if value in forward}


def _free_to_recompute(graph: fx.Graph, forward: set[fx.Node], held: set[str],
                       gathered: Collection[fx.Node] = ()) -> set[fx.Node]:
    """The forward values that the backward reads and light ops make from what is kept
    anyway (`held`: the parameters' and buffers' placeholders; `gathered`: markers whose
    gathered value the step keeps for its backward; and the values the backward reads that
    are kept, decided in graph order, so an input is decided before its readers), through
    values the backward does not read (a GELU's output from its input, viewed for a
    matmul), or reads and recomputes. Recomputing them keeps no more values from the
    forward to the backward, and each light op is recomputed at most once. Another
    marker's value (a sharded parameter gathered) is kept only where the backward reads it:
    at ZeRO-3, recomputing from one the backward does not read would gather it again (an
    embedding table, for its lookup). A value an EP region's backward reads is kept: a copy
    read there would be dispatched to the experts again."""
    read_by_backward = _read_by_backward(graph, forward)
    free: set[fx.Node] = set()

    def kept(value: fx.Node) -> bool:
        return (value.op == "placeholder" and value.name in held) or value in gathered \
            or (value in read_by_backward and value not in free)

    steps: set[fx.Node] = set()  # the light ops between kept values and the free ones, unread by the backward
    for node in graph.nodes:
        if node.op == "placeholder" or node not in forward:
            continue
        if _light(node) and all(kept(value) or value in steps or value in free for value in node.all_input_nodes) \
                and not any(user not in forward and _expert(user) for user in node.users):
            (free if node in read_by_backward else steps).add(node)
    return free | steps


def _bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _free_with_gathered(dag: TrainingDAG, forward: set[fx.Node], held: set[str], strategy: Strategy) -> set[fx.Node]:
    """`_free_to_recompute`, with the ZeRO markers kept whose gathered value the backward can
    read without another collective, where it is no larger than the forward values it lets the
    backward recompute instead of keep (a layer norm's bias against the norm's output):
      - at ZeRO-1/2 every one: each sharded parameter is gathered once per step and its full
        value kept for the backward (`unshard_parameters`). One in a gather bucket with a
        parameter the backward reads is held anyway; alone, it holds at most what it saves;
      - at ZeRO-3, where the backward gathers what it reads again, those of a unit (a gather
        group, `Units.group`) whose other parameters the backward reads, through the ops
        made of them alone (a weight's transpose): its bytes join that unit's gather, at
        most what they save.
    So an embedding table larger than its lookup's output is not kept: its lookup is. At
    ZeRO-0 there are no markers (its parameters are `held`). Each marker dropped for its bytes
    computes the free values again, without it."""
    graph = dag.joint.graph
    markers = {node for node in graph.nodes if node in forward and node.target is UNSHARD}
    if strategy.zero == 3 and markers:
        order = {node: index for index, node in enumerate(graph.nodes)}
        backward_read = {marker for marker in markers
                         if any(user not in forward for node in parameter_only_chain(marker, forward, order)
                                for user in node.users)}
        units = find_units(dag)
        gathered_again = {units.group(marker) for marker in backward_read}
        markers = {marker for marker in markers - backward_read if units.group(marker) in gathered_again}
    elif strategy.zero not in (1, 2):
        markers = set()
    read = _read_by_backward(graph, forward)
    while True:
        free = _free_to_recompute(graph, forward, held, markers)
        outweighing = set()
        for marker in markers - read:
            # The values the backward would recompute through this marker rather than keep.
            reached, stack = set(), [marker]
            while stack:
                for user in stack.pop().users:
                    if user in free and user not in reached:
                        reached.add(user)
                        stack.append(user)
            if _bytes(marker) > sum(_bytes(value) for value in reached & read):
                outweighing.add(marker)
        if not outweighing:
            return free
        markers -= outweighing


def _sink_detaches(graph: fx.Graph, forward: set[fx.Node]) -> None:
    """Move each backward `detach` of a forward value to just before its first reader.
    AOTAutograd puts them at the start of the backward; left there, they would be the
    first backward readers of what is recomputed, and every layer would be recomputed
    before the backward's first op, all held at once."""
    position = {node: index for index, node in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        if (node.op == "call_function" and node.target is torch.ops.aten.detach.default and node not in forward
                and node.users and all(value in forward for value in node.all_input_nodes)):
            min(node.users, key=position.__getitem__).prepend(node)


def checkpoint_activations(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    if not dag.training:
        return dag
    graph = dag.joint.graph
    forward = forward_nodes(dag)
    recomputable = {n for n in graph.nodes if n in forward and _recomputable(n, strategy, forward)}
    held = {i.name for i in dag.inputs if i.role in HELD_ROLES}
    recomputable |= _free_with_gathered(dag, forward, held, strategy)
    placeholders = dag.placeholders()
    updated = {placeholders[graph_input.name] for _, graph_input in dag.mutated_inputs()}
    recomputable -= {n for n in recomputable if any(value in updated for value in n.all_input_nodes)}
    # A part of a multi-output op (attention's output) is recomputed with the op or kept with it.
    recomputable -= {n for n in recomputable if n.target is operator.getitem and n.args[0] not in recomputable}
    if not recomputable:
        return dag
    _sink_detaches(graph, forward)
    copies: dict[fx.Node, fx.Node] = {}

    def recomputed(node: fx.Node, before: fx.Node) -> fx.Node:
        """`node`'s copy made before `before` (its inputs' copies first), or `node` itself if kept."""
        if node not in recomputable:
            return node
        if node not in copies:
            with graph.inserting_before(before):
                copies[node] = graph.node_copy(node, lambda value: recomputed(value, before))
                copies[node].meta[RECOMPUTES] = node
        return copies[node]

    for node in list(graph.nodes):  # the backward ops of the graph as captured, not the copies
        if node.op == "call_function" and node not in forward:
            for value in node.all_input_nodes:
                if value in recomputable:
                    node.replace_input_with(value, recomputed(value, node))
    graph.lint()
    dag.joint.recompile()
    return dag
