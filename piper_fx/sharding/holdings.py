"""How each rank holds each parameter: the placement record that checkpoints and clipping read.

A parameter of a piper_fx model is held by a rank in one of three ways: whole
(a replica, as under plain data parallelism), as its row shard over a group
(ZeRO's dp group, or the ep group for a block of experts), and, under a
pipeline, possibly stale (ranks whose stages do not read it never update it).
`prepare` records a `Holding` for every parameter it lays out and the backend
completes it when it compiles (replicas of a model compiled without
`prepare`, the pipeline rank that trains each parameter). Kept here, keyed by
the parameter's identity for as long as it lives, not on the user's objects.

What follows from a holding, defined once: the DTensor view of a held tensor
(`Shard(0)` over the shard group, with DTensor's uneven split, which is the
padded row layout's with the padding dropped), whether this rank's copy is
current, and whether this rank is the one that counts its piece when every
rank's pieces are summed (a global gradient norm).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.nn.utils import parametrize
from torch.utils.weak import WeakIdKeyDictionary

from ..compat import resolve_process_group
from .mesh import process_group_device_type
from .row_shard import sharded_parameter_info


@dataclass(frozen=True)
class Holding:
    """How this rank holds one parameter."""

    global_shape: tuple[int, ...]
    shard_group: str | None = None    # dim 0 split over this group (padded rows); None: held whole
    replica_group: str | None = None  # ranks holding the very same piece; None: no other
    pipeline: tuple[int, str] | None = None  # (pipeline rank that trains it, pp group) under a pipeline

    @property
    def current(self) -> bool:
        """Whether this rank holds an up-to-date copy of its piece: under a pipeline, only the
        trainer does; of a 0-d parameter sharded by rows, only the shard group's first rank
        holds the value (the others hold a padding row)."""
        if self.pipeline is not None and _group_rank(self.pipeline[1]) != self.pipeline[0]:
            return False
        return not (self.global_shape == () and self.shard_group is not None and _group_rank(self.shard_group))

    @property
    def counted(self) -> bool:
        """Whether this rank's piece is the one counted when summing over all ranks:
        current, and the first of its replicas."""
        return self.current and (self.replica_group is None or _group_rank(self.replica_group) == 0)

    def local(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (the parameter, its gradient or an optimizer state of its shape)
        without the padding rows of the last shards: a view."""
        if self.shard_group is None:
            return tensor
        size = dist.get_world_size(resolve_process_group(self.shard_group))
        rows = self.global_shape[0] if self.global_shape else 1
        shard_rows = -(-rows // size)
        start = min(_group_rank(self.shard_group) * shard_rows, rows)
        return tensor[: min(start + shard_rows, rows) - start]

    def dtensor(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` as the global value it is a piece of: a `DTensor` sharded by rows over
        the shard group, or `tensor` itself when held whole (a 0-d view for a 0-d
        parameter). Shares its storage."""
        if self.shard_group is None:
            return tensor
        if self.global_shape == ():  # a 0-d parameter: its one row (the value, where `current`)
            return tensor.reshape(())
        group = resolve_process_group(self.shard_group)
        mesh = DeviceMesh.from_group(group, process_group_device_type())
        return DTensor.from_local(self.local(tensor), mesh, [Shard(0)], run_check=False,
                                  shape=torch.Size(self.global_shape), stride=_contiguous_strides(self.global_shape))


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


def _group_rank(group_name: str) -> int:
    return dist.get_rank(resolve_process_group(group_name))


_HOLDINGS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def record_holding(parameter: torch.Tensor, holding: Holding) -> None:
    _HOLDINGS[parameter] = holding


def has_holding(parameter: torch.Tensor) -> bool:
    return parameter in _HOLDINGS


def holding_of(parameter: torch.Tensor) -> Holding:
    """The recorded holding, or that of a parameter piper_fx never laid out: whole, on this rank alone."""
    holding = _HOLDINGS.get(parameter)
    if holding is None:
        info = sharded_parameter_info(parameter)
        shape = info.layout.full_shape if info is not None else tuple(parameter.shape)
        holding = Holding(shape, info.group_name if info is not None else None)
    return holding


def record_pipeline_trainer(parameter: torch.Tensor, pp_rank: int, pp_group_name: str) -> None:
    record_holding(parameter, replace(holding_of(parameter), pipeline=(pp_rank, pp_group_name)))


@dataclass(frozen=True)
class HeldParameter:
    """A parameter of the model as this rank holds it."""

    fqns: tuple[str, ...]     # its names in the unprepared model's state dict (several when tied)
    parameter: nn.Parameter   # what the optimizer holds: the parameter, or this rank's shard of it
    holding: Holding


def held_parameters(model: nn.Module) -> list[HeldParameter]:
    """Every parameter of `model` once, in `named_parameters` order, under the names of the unprepared model."""
    fqns: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, parametrize.ParametrizationList):
            continue  # its `original` is reported under the name it stands for, below
        prefix = f"{module_name}." if module_name else ""
        named = [(name, p) for name, p in module._parameters.items() if p is not None]
        if parametrize.is_parametrized(module):
            named += [(name, module.parametrizations[name].original) for name in module.parametrizations]
        for name, p in named:
            names = fqns.setdefault(id(p), [])
            if prefix + name not in names:
                names.append(prefix + name)
            params[id(p)] = p
    return [HeldParameter(tuple(names), params[key], holding_of(params[key])) for key, names in fqns.items()]
