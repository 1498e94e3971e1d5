"""Pass: turn every stated placement change into its collective.

Requires: the joint graph, where the strategy passes (`shard_experts`,
`unshard_parameters`, `reduce_gradients`) stated each change of a value's
placement as a `piper::redistribute` marker, and inserted no collective
themselves.
Guarantees: no marker remains; each was replaced, in place, by the code of its
row in `collectives.redistribute.LOWERINGS` (an all-gather, reduce-scatter,
all-reduce or all-to-all of functional collectives, or a local slice),
carrying the marker's annotations and notes (phase, unit, what it moves), its
readers' values following the collective's (a view of a gathered parameter is on
the gathered parameter's storage, wherever the task split puts the gather); a
change over the dp group leaves its target placement on its result (`ops.PLACED`),
for `propagate_placements`. A
change with no row is a `PiperError` naming the marker and the change. So
which collective runs, and over which group, follows from the placements alone.
"""
from __future__ import annotations

from ..decompositions import decompositions_for
from ..collectives.emit import insert_traced, replace_uses
from ..collectives.redistribute import Redistribution, is_redistribution, lowering_of
from ..errors import PiperError
from ..ir import TrainingDAG
from ..ops import COMM_NOTE, PHASE, PLACED, UNIT
from ..options import Strategy


def lower_redistributions(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    graph = dag.joint.graph
    markers = [n for n in graph.nodes if is_redistribution(n)]
    if not markers:
        return dag
    lowerings = {}
    for marker in markers:  # every change checked before the graph changes
        change = Redistribution.of(marker)
        try:
            lowerings[marker] = change, lowering_of(change)
        except KeyError as e:
            raise PiperError(f"{marker.name} ({marker.meta.get(COMM_NOTE, 'a placement change')}): "
                             f"{e.args[0]} over group {change.group_name}") from None
    decompositions = decompositions_for(strategy)
    for marker, (change, lowering) in lowerings.items():
        notes = {key: marker.meta[key] for key in (COMM_NOTE, PHASE, UNIT) if key in marker.meta}
        lowered = insert_traced(graph, lowering.code(change), [marker.args[0]], before=marker, like=marker,
                                meta=notes, decompositions=decompositions)
        if change.group_name == dag.dp_group:  # the placements the dumps show are over dp
            lowered.meta[PLACED] = change.dst
        replace_uses(marker, lowered)
        graph.erase_node(marker)
    graph.lint()
    dag.joint.recompile()
    dag.refresh_output_names()
    return dag
