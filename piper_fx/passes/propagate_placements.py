"""Pass: attach a DTensor-style placement to every node of the joint graph.

Requires: the joint graph with `val` metadata (after the collective passes, so
their nodes get specs too).
Guarantees: a decided placement, `node.meta["piper_spec"]`, on every
placeholder, constant and call (`sharding.specs`): the replica's batch
`Shard(0)`, replicated parameters `Replicate()`, row-sharded ones `Shard(0)`,
gradients (and a window's held ones) `Partial` until a collective reduces them, every other value as
piper_fx's own rules or DTensor's sharding propagator place it (with
`meta["piper_spec_reads"]` where DTensor's rule read an input otherwise placed
than it is). A node that none of them places is a `PiperError` naming the
node, its op and its inputs' placements: no placement is guessed. With one
replica (a pipeline alone, dp = 1) such a node is `Replicate()`: every
placement of a value holds it whole on the one rank. Purely descriptive: no
node is changed. Shown in the placement table dump.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import Replicate, Shard

from ..collectives.redistribute import AVG
from ..ir import InputRole, TrainingDAG
from ..options import Strategy
from ..sharding.specs import planning_mesh, propagate, random_values_rule
from .functionalize_random import samples_per_microbatch


def _seed(role: InputRole, ndim: int):
    if role is InputRole.PARAM_SHARD or (role is InputRole.INPUT and ndim >= 1):
        return Shard(0)
    if role is InputRole.HELD_GRAD:  # a replica's own gradient, unreduced
        return AVG
    return Replicate()


def _device_type(dag: TrainingDAG) -> str | None:
    """The device type the graph's values are on (DTensor's propagator makes fake tensors of
    it, so device-specific kernels meet their own device); None for a graph with none."""
    for node in dag.placeholders().values():
        if isinstance(node.meta.get("val"), torch.Tensor):
            return node.meta["val"].device.type
    return None


def propagate_placements(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    placeholders = dag.placeholders()
    seeds = {i.name: _seed(i.role, placeholders[i.name].meta["val"].dim()) for i in dag.inputs}
    rng = {placeholders[i.name] for i in dag.inputs if i.role is InputRole.RNG}
    random_values = random_values_rule(rng, samples_per_microbatch(dag)) if rng else None
    # At least two ranks: on one, DTensor's rules take a sharded dimension of one row (a
    # microbatch of one sample) for none; the placements are those over any number of replicas.
    mesh = planning_mesh(max(strategy.dp, 2), _device_type(dag))
    propagate(dag.joint.graph, seeds, mesh, random_values, one_replica=strategy.dp == 1)
    return dag
