"""The device mesh of a strategy and the process groups of its dimensions.

Rank layout: rank r has pipeline index r // dp and data-parallel
index r % dp, i.e. a row-major ("pp", "dp") mesh, which is what
`init_device_mesh` builds; with experts, dp splits into ("expert_dp", "ep").
One mesh per strategy names every group (`strategy_mesh` gives each of its
dimensions), and DTensor parameters sit on its "dp" or "ep" dimension. The mesh
is built for the device type the process group communicates on
(`process_group_device_type`): "cuda" under NCCL, "cpu" under gloo.
"""
from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..compat import flatten_mesh
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


# Each dimension's mesh of the mesh built over each default process group, by (pp, dp, ep): the
# group's own, dropped with it, so a process group made anew (after `destroy_process_group`) gets a
# mesh, and sub-groups, of its own.
_MESHES: weakref.WeakKeyDictionary[dist.ProcessGroup, dict[tuple, dict[str, DeviceMesh]]] = \
    weakref.WeakKeyDictionary()


def strategy_mesh(strategy: Strategy, dim: str) -> DeviceMesh:
    """Dimension `dim` of the one device mesh that names every process group of `strategy`:
    "pp" and "dp", and with experts (ep > 1) "expert_dp" and "ep", whose flattening is "dp"
    (kept as `_flatten` made it: slicing a flattened dimension from its root mesh is
    deprecated in torch).

    Data-parallel index d = replica * ep + ep_index: the ep ranks sharing out the
    experts are consecutive, as in torchtitan (ep borrows the inner dp ranks).
    Building it is collective (sub-groups are made): every rank must ask for a
    strategy's mesh in the same order the first time.
    """
    pp, dp, ep = strategy.pp, strategy.dp, strategy.ep
    meshes = _MESHES.setdefault(dist.group.WORLD, {})
    if (pp, dp, ep) not in meshes:
        if ep == 1:
            mesh = init_device_mesh(process_group_device_type(), (pp, dp), mesh_dim_names=("pp", "dp"))
            meshes[(pp, dp, ep)] = {"pp": mesh["pp"], "dp": mesh["dp"]}
        else:
            mesh = init_device_mesh(process_group_device_type(), (pp, dp // ep, ep),
                                    mesh_dim_names=("pp", "expert_dp", "ep"))
            meshes[(pp, dp, ep)] = {"pp": mesh["pp"], "expert_dp": mesh["expert_dp"], "ep": mesh["ep"],
                                    "dp": flatten_mesh(mesh["expert_dp", "ep"], "dp")}
    return meshes[(pp, dp, ep)][dim]


def rank_groups(strategy: Strategy, dim: str) -> list[list[int]]:
    """The ranks of each of `strategy`'s groups along mesh dimension `dim` ("pp" or "ep"), laid
    out as `strategy_mesh` lays them, without building it."""
    dp, pp, ep = strategy.dp, strategy.pp, strategy.ep
    if dim == "pp":
        return [[stage * dp + index for stage in range(pp)] for index in range(dp)]
    if dim == "ep":
        return [[stage * dp + first + shard for shard in range(ep)]
                for stage in range(pp) for first in range(0, dp, ep)]
    raise ValueError(f"no rank groups along mesh dimension {dim!r}")


def _group_name(strategy: Strategy, dim: str, size: int) -> str | None:
    if size == 1:
        return None
    return strategy_mesh(strategy, dim).get_group().group_name


def dp_group_name(strategy: Strategy) -> str | None:
    """Name of this rank's data-parallel process group, or None when dp == 1.

    With one rank there is no mesh (nor need of a process group); otherwise the
    first call for a strategy builds its mesh, collectively (`strategy_mesh`).
    """
    if strategy.pp * strategy.dp == 1:
        return None
    strategy_mesh(strategy, "dp")  # builds every group, on every rank, whatever this one needs
    return _group_name(strategy, "dp", strategy.dp)


def pp_group_name(strategy: Strategy) -> str | None:
    """Name of this rank's pipeline process group, or None when pp == 1."""
    return _group_name(strategy, "pp", strategy.pp)


def ep_group_name(strategy: Strategy) -> str | None:
    """Name of this rank's expert-parallel group (the ranks that share out the experts), or None when ep == 1."""
    return _group_name(strategy, "ep", strategy.ep)


def expert_replica_group_name(strategy: Strategy) -> str | None:
    """Name of the group of ranks holding the same expert shard (one per ep group), or None when alone."""
    if strategy.ep == 1:
        return None
    return _group_name(strategy, "expert_dp", strategy.dp // strategy.ep)


def group_names(strategy: Strategy) -> tuple[str | None, ...]:
    """The names of every process group of `strategy` this rank is in (data-parallel,
    pipeline, expert-parallel, expert-replica), building its mesh first if need be
    (collectively: `dp_group_name`): what its collectives are planned with."""
    return (dp_group_name(strategy), pp_group_name(strategy), ep_group_name(strategy),
            expert_replica_group_name(strategy))
