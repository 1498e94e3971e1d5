"""Pass: state where ZeRO's sharded parameters are needed whole, per the ZeRO level.

Requires: the captured joint graph; markers read only PARAM_SHARD placeholders.
Guarantees: no `piper::unshard` node remains; each read of a sharded parameter
goes through a `Shard(0)` -> `Replicate()` change over the dp group
(`collectives.redistribute`; `lower_redistributions` makes it an all-gather),
placed as follows.
  - ZeRO-1/2: one all-gather per sharded parameter at the top of the step
    (marked to run once per step, before any microbatch); its full value
    serves every forward use and is kept for the backward ("gathered once
    per step").
  - ZeRO-3: one all-gather per use site in forward (Dynamo emits a marker per
    module access, so a tied weight is gathered by each module that uses it),
    freed after its last forward use; every backward use gets its own
    all-gather (and its own copy of the parameter-only ops between the gather
    and the use, e.g. the transpose of a weight), placed just before the first
    backward use. So no full parameter is saved from forward to backward.
    Every gather, forward and backward, carries `piper_unit`: the unit of the
    read it serves (`sharding.units`: a layer such as `model.layers.3`), or for
    a read outside units the module reading it (`lm_head`). `bucket_collectives`
    never merges gathers of two units, so a bucket holds at most one unit.
Under mixed precision (`capture` traces each read of a parameter as its cast
to `param_dtype`), a marker read only through that cast is gathered in
`param_dtype`, as FSDP2 does: the shard is cast, the gather moves
`param_dtype` rows, and the cast of the full value goes.
"""
from __future__ import annotations

import heapq

import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from ..collectives.emit import cast
from ..collectives.redistribute import is_redistribution, state_redistribution
from ..ir import TrainingDAG, forward_nodes
from ..ops import COMM_NOTE, PHASE, STEP_START, UNIT, UNSHARD, cast_dtype
from ..options import Strategy
from ..sharding.units import find_units


def _gather_dtype(marker: fx.Node) -> torch.dtype | None:
    """The dtype `marker`'s every user casts the full parameter to (mixed precision's `param_dtype`), if one."""
    dtypes = {cast_dtype(user) for user in marker.users}
    return dtypes.pop() if len(dtypes) == 1 and None not in dtypes else None


def _splice_gather(dag: TrainingDAG, strategy: Strategy, marker: fx.Node, *, before: fx.Node,
                   like: fx.Node, phase: str, meta: dict | None = None) -> fx.Node:
    """State, before `before`, that `marker`'s shard is needed whole (`Shard(0)` -> `Replicate()`: an
    all-gather), in the dtype its users cast it to."""
    shard, full_shape, group_name = marker.args
    fqn = dag.input_by_name()[shard.name].fqn
    dtype = _gather_dtype(marker)
    if dtype is not None and dtype != shard.meta["val"].dtype:
        shard = cast(dag.joint.graph, shard, dtype, before=before, like=like,
                     meta={k: v for k, v in (meta or {}).items() if k == PHASE})
    return state_redistribution(dag.joint.graph, shard, Shard(0), Replicate(), group_name=group_name,
                                group_size=strategy.dp, group_rank=strategy.dp_index, global_shape=full_shape,
                                before=before, like=like, meta={COMM_NOTE: f"all_gather {fqn} ({phase})", **(meta or {})})


def _gather_once_per_step(dag: TrainingDAG, strategy: Strategy, markers: list[fx.Node]) -> None:
    graph = dag.joint.graph
    top = next(n for n in graph.nodes if n.op != "placeholder")
    gathered: dict[fx.Node, fx.Node] = {}
    for marker in markers:  # all gathers first: `top` may itself be a marker erased below
        shard = marker.args[0]
        if shard not in gathered:
            gathered[shard] = _splice_gather(dag, strategy, marker, before=top, like=marker, phase="step",
                                             meta={PHASE: STEP_START})
    for marker in markers:
        marker.replace_all_uses_with(gathered[marker.args[0]])
        graph.erase_node(marker)


def parameter_only_chain(marker: fx.Node, forward: set[fx.Node], order: dict[fx.Node, int]) -> list[fx.Node]:
    """The marker and the forward ops computed from it alone (views, casts), in graph order
    (`order`: the forward ops' positions). Walks from the marker through users, nearest
    first: each op is reached from an input, so the walk ends with the chain, not with the
    graph (a scan to the graph's end per parameter was quadratic in the model's size)."""
    chain = [marker]
    members = {marker}
    reached = [(order[user], user) for user in marker.users if user in forward]
    heapq.heapify(reached)
    seen = set()
    while reached:  # positions popped only grow: a user comes after what it reads
        _, node = heapq.heappop(reached)
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and all(i in members for i in node.all_input_nodes):
            chain.append(node)
            members.add(node)
            for user in node.users:
                if user in forward and user not in seen:
                    heapq.heappush(reached, (order[user], user))
    return chain


def _drop_idle_casts(graph: fx.Graph) -> None:
    """Remove the casts of gathered parameters that were gathered in the cast's dtype."""
    for node in list(graph.nodes):
        dtype = cast_dtype(node)
        if dtype is not None and is_redistribution(node.args[0]) and node.args[0].meta["val"].dtype == dtype:
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)


def _gather_per_use(dag: TrainingDAG, strategy: Strategy, markers: list[fx.Node]) -> None:
    graph = dag.joint.graph
    forward = forward_nodes(dag)
    order = {n: i for i, n in enumerate(graph.nodes)}
    units = find_units(dag)
    for marker in markers:
        unit = {UNIT: units.group(marker)}
        chain = parameter_only_chain(marker, forward, order)
        backward_uses = [(user, node) for node in chain for user in node.users if user not in forward]
        if backward_uses:
            first_use = min((user for user, _ in backward_uses), key=order.__getitem__)
            clones = {marker: _splice_gather(dag, strategy, marker, before=first_use, like=first_use,
                                             phase="backward", meta=unit)}
            with graph.inserting_before(first_use):
                for node in chain[1:]:
                    clones[node] = graph.node_copy(node, lambda n: clones.get(n, n))
            for user, node in backward_uses:
                user.replace_input_with(node, clones[node])
        full = _splice_gather(dag, strategy, marker, before=marker, like=marker, phase="forward", meta=unit)
        marker.replace_all_uses_with(full)
        graph.erase_node(marker)


def unshard_parameters(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    markers = [n for n in dag.joint.graph.nodes if n.op == "call_function" and n.target is UNSHARD]
    if not markers:
        return dag
    if strategy.zero == 3:
        _gather_per_use(dag, strategy, markers)
    else:
        _gather_once_per_step(dag, strategy, markers)
    _drop_idle_casts(dag.joint.graph)
    dag.joint.graph.lint()
    dag.joint.recompile()
    return dag
