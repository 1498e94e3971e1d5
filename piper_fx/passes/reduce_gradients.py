"""Pass: average parameter gradients over the data-parallel group.

Requires: the joint graph; ZeRO >= 1 gradients arrive through `piper::reduce_grad`
markers (the backward of `piper::unshard`), ZeRO-0 gradients as GRAD outputs of
PARAM placeholders.
Guarantees: every parameter gradient output is the dp-average its owner needs
and no `piper::reduce_grad` node remains:
  - ZeRO-0 (DDP): all-reduce(avg) of the full gradient;
  - ZeRO-1: all-reduce(avg) of the full gradient, then this rank's row shard;
  - ZeRO-2/3: reduce-scatter(avg) straight into the row shard.
With several microbatches, ZeRO-0/1 reductions are marked to run once per
step on the gradient summed over microbatches (as DDP under `no_sync` then a
final step); with one, they run in the backward where each gradient is
complete (as DDP's bucketed all-reduce during backward), so they overlap the
rest of the backward. ZeRO-2/3 reduce-scatter each microbatch's gradient where
it is complete. The order is
the backward order, the same on every rank (the graph is the same), so ranks
agree on the order of collectives.
"""
from __future__ import annotations

import functools

from ..capture import decompositions_for
from ..collectives.emit import insert_traced
from ..collectives.lowering import all_reduce_mean, all_reduce_then_take_rows, reduce_scatter_rows
from ..ir import InputRole, OutputRole, TrainingDAG
from ..ops import COMM_NOTE, PHASE, REDUCE_GRAD, STEP_END
from ..options import Strategy


def _lower_markers(dag: TrainingDAG, strategy: Strategy) -> None:
    graph = dag.joint.graph
    for marker in [n for n in graph.nodes if n.op == "call_function" and n.target is REDUCE_GRAD]:
        _, shard_rows, group_name = marker.args
        if strategy.zero == 1:
            fn = functools.partial(all_reduce_then_take_rows, shard_rows=shard_rows, group_size=strategy.dp,
                                   group_name=group_name, group_rank=strategy.dp_index)
            kind = "all_reduce"
        else:
            fn = functools.partial(reduce_scatter_rows, shard_rows=shard_rows, group_size=strategy.dp,
                                   group_name=group_name)
            kind = "reduce_scatter"
        # ZeRO-1 reduces the step's summed gradient once; ZeRO-2/3 reduce-scatter
        # every microbatch's, so no full gradient outlives its microbatch.
        phase = _once_per_step(strategy) if strategy.zero == 1 else {}
        reduced = insert_traced(graph, fn, [marker.args[0]], before=marker, like=marker,
                                decompositions=decompositions_for(strategy),
                                meta={COMM_NOTE: f"{kind} grad", **phase})
        marker.replace_all_uses_with(reduced)
        graph.erase_node(marker)
    dag.refresh_output_names()


def _once_per_step(strategy: Strategy) -> dict:
    """Metadata deferring a reduction to the step's end when gradients accumulate over microbatches."""
    return {PHASE: STEP_END} if strategy.microbatches > 1 else {}


def _all_reduce_full_gradients(dag: TrainingDAG, strategy: Strategy) -> None:
    graph = dag.joint.graph
    inputs_by_arg = {i.arg_index: i for i in dag.inputs if i.arg_index is not None}
    by_name = {n.name: n for n in graph.nodes}
    new_outputs = []
    for out in dag.outputs:
        node = by_name[out.name]
        source = inputs_by_arg.get(out.index) if out.role is OutputRole.GRAD else None
        if source is not None and source.role is InputRole.PARAM:
            node = insert_traced(graph, functools.partial(all_reduce_mean, group_name=dag.dp_group), [node],
                                 before=node.next, like=node, decompositions=decompositions_for(strategy),
                                 meta={COMM_NOTE: f"all_reduce grad {source.fqn}", **_once_per_step(strategy)})
        new_outputs.append(node)
    dag.set_outputs(new_outputs)


def reduce_gradients(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    if not dag.training or strategy.dp == 1:
        return dag
    _lower_markers(dag, strategy)
    if strategy.zero == 0:
        _all_reduce_full_gradients(dag, strategy)
    dag.joint.graph.lint()
    dag.joint.recompile()
    return dag
