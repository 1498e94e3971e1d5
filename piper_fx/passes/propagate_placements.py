"""Pass: attach a DTensor-style placement to every node of the joint graph.

Requires: the joint graph with `val` metadata (after the collective passes, so
their nodes get specs too).
Guarantees: `node.meta["piper_spec"]` on every placeholder and call: the
replica's batch `Shard(0)`, replicated parameters `Replicate()`, row-sharded
ones `Shard(0)`, gradients `Partial` until a collective reduces them. Purely
descriptive: no node is changed. Shown in the placement table dump.
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from ..ir import InputRole, TrainingDAG
from ..options import Strategy
from ..sharding.specs import planning_mesh, propagate


def _seed(role: InputRole, ndim: int):
    if role is InputRole.PARAM_SHARD or (role is InputRole.INPUT and ndim >= 1):
        return Shard(0)
    return Replicate()


def propagate_placements(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    placeholders = dag.placeholders()
    seeds = {i.name: _seed(i.role, placeholders[i.name].meta["val"].dim()) for i in dag.inputs}
    propagate(dag.joint.graph, seeds, planning_mesh(strategy.dp))
    return dag
