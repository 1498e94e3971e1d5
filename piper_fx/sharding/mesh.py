"""The device mesh of a strategy and the process groups of its dimensions.

Rank layout: rank r has pipeline index r // dp and data-parallel
index r % dp, i.e. a row-major ("pp", "dp") mesh, which is what
`init_device_mesh` builds. The mesh is built for the device type the process
group communicates on (`process_group_device_type`): "cuda" under NCCL, "cpu"
under gloo.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..options import Strategy


# Backends that serve one device type. Others serve several (the fake group,
# "cpu:gloo,cuda:nccl"): their ranks compute on the accelerator if there is one.
_BACKEND_DEVICE_TYPES = {"gloo": "cpu", "nccl": "cuda", "xccl": "xpu", "hccl": "hpu"}


def process_group_device_type() -> str:
    """The device type the default process group communicates on ("cpu" without one)."""
    if not dist.is_initialized():
        return "cpu"
    backend = dist.get_backend()
    if backend in _BACKEND_DEVICE_TYPES:
        return _BACKEND_DEVICE_TYPES[backend]
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    return accelerator.type if accelerator is not None else "cpu"


# The meshes built over each default process group, by (shape, dimension names):
# the group's own, dropped with it, so a process group made anew (after
# `destroy_process_group`) gets meshes, and sub-groups, of its own.
_MESHES: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, DeviceMesh]] = weakref.WeakKeyDictionary()


def _mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    meshes = _MESHES.setdefault(dist.group.WORLD, {})
    if (shape, names) not in meshes:
        meshes[(shape, names)] = init_device_mesh(process_group_device_type(), shape, mesh_dim_names=names)
    return meshes[(shape, names)]


def _device_mesh(pp: int, dp: int) -> DeviceMesh:
    return _mesh((pp, dp), ("pp", "dp"))


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


def _expert_mesh(pp: int, dp: int, ep: int) -> DeviceMesh:
    # Data-parallel index d = replica * ep + ep_index: the ep ranks sharing out
    # the experts are consecutive, as in torchtitan (ep borrows the inner dp ranks).
    return _mesh((pp, dp // ep, ep), ("pp", "expert_dp", "ep"))


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
