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
