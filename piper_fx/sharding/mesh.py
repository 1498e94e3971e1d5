"""The device mesh of a strategy and the process groups of its dimensions.

Rank layout (DESIGN.md): rank r has pipeline index r // dp and data-parallel
index r % dp, i.e. a row-major ("pp", "dp") mesh, which is what
`init_device_mesh` builds.
"""
from __future__ import annotations

import functools

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..options import Strategy


@functools.lru_cache(maxsize=None)
def _device_mesh(pp: int, dp: int) -> DeviceMesh:
    return init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))


def dp_group_name(strategy: Strategy) -> str | None:
    """Name of this rank's data-parallel process group, or None when dp == 1.

    Every rank must call this in the same order the first time a mesh shape is
    used: building sub-groups is itself collective.
    """
    if strategy.pp > 1:
        mesh = _device_mesh(strategy.pp, strategy.dp)  # builds the pp groups too, on every rank
        return mesh.get_group("dp").group_name if strategy.dp > 1 else None
    if strategy.dp == 1:
        return None
    return dist.group.WORLD.group_name



def pp_group_name(strategy: Strategy) -> str | None:
    """Name of this rank's pipeline process group, or None when pp == 1."""
    if strategy.pp == 1:
        return None
    return _device_mesh(strategy.pp, strategy.dp).get_group("pp").group_name


@functools.lru_cache(maxsize=None)
def _expert_mesh(pp: int, dp: int, ep: int) -> DeviceMesh:
    # Data-parallel index d = replica * ep + ep_index: the ep ranks sharing out
    # the experts are consecutive, as in torchtitan (ep borrows the inner dp ranks).
    return init_device_mesh("cpu", (pp, dp // ep, ep), mesh_dim_names=("pp", "expert_dp", "ep"))


def ep_group_name(strategy: Strategy) -> str | None:
    """Name of this rank's expert-parallel group (the ranks that share out the experts), or None when ep == 1."""
    if strategy.ep == 1:
        return None
    return _expert_mesh(strategy.pp, strategy.dp, strategy.ep).get_group("ep").group_name


def expert_replica_group_name(strategy: Strategy) -> str | None:
    """Name of the group of ranks holding the same expert shard (one per ep group), or None when alone."""
    if strategy.ep == 1 or strategy.dp == strategy.ep:
        return None
    return _expert_mesh(strategy.pp, strategy.dp, strategy.ep).get_group("expert_dp").group_name
