"""Parameters sharded by rows over the data-parallel group (ZeRO-1/2/3).

`prepare` replaces each parameter by its rows, a `Shard(0)` DTensor parameter
on the dp mesh (`dtensor_params`, so a stock optimizer built afterwards keeps
state only for them), whose reads turn it back into the full tensor with the
`piper::unshard` op. Dynamo traces that op as a marker; the strategy passes
lower it (and its backward, `piper::reduce_grad`) to collectives placed as the
ZeRO level says. In a forward run eagerly, outside `torch.compile`, the ops
run their collectives directly, so a prepared model still works as a plain
module (every rank of the group must run it, as with FSDP).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from ..collectives import lowering
from ..compat import resolve_process_group
from .dtensor_params import parameter_owners, program_placeholder, row_sharded_parameter
from .read_through import read_through


@dataclass(frozen=True)
class RowShardLayout:
    """How one parameter of `full_shape` is split by rows over `group_size` ranks."""

    full_shape: tuple[int, ...]
    group_size: int

    @property
    def rows(self) -> int:
        return self.full_shape[0] if self.full_shape else 1

    @property
    def shard_rows(self) -> int:
        return math.ceil(self.rows / self.group_size)

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.shard_rows, *self.full_shape[1:])

    def local_rows(self, group_rank: int) -> int:
        """How many real rows rank `group_rank` holds (DTensor's uneven `Shard(0)`)."""
        start = min(group_rank * self.shard_rows, self.rows)
        return min(start + self.shard_rows, self.rows) - start

    def shard_of(self, full: torch.Tensor, group_rank: int) -> torch.Tensor:
        """The padded row shard that rank `group_rank` holds (a new tensor)."""
        rows = full.reshape(1, *full.shape) if full.dim() == 0 else full
        shard = rows.new_zeros(self.shard_shape)
        start = min(group_rank * self.shard_rows, self.rows)
        shard[: self.local_rows(group_rank)].copy_(rows[start:start + self.local_rows(group_rank)])
        return shard

    def parameter(self, full: torch.Tensor, mesh: DeviceMesh, requires_grad: bool) -> nn.Parameter:
        """This rank's rows of `full` as a `Shard(0)` DTensor parameter on the 1-D `mesh`, kept in
        their padded buffer (`dtensor_params`)."""
        rank = mesh.get_local_rank()
        return row_sharded_parameter(self.shard_of(full, rank), self.local_rows(rank), self.full_shape, mesh,
                                     requires_grad)


@dataclass(frozen=True)
class ShardedParameter:
    """What piper_fx knows of a parameter that `prepare` sharded."""

    fqns: tuple[str, ...]
    layout: RowShardLayout
    group_name: str
    mesh_dim: str = "dp"  # "dp": a ZeRO shard; "ep": a block of experts (sharding.experts)


# Kept on the DTensor Parameter itself, so it follows the object (and its deepcopies).
INFO_ATTR = "_piper_sharded"


def sharded_parameter_info(t: object) -> ShardedParameter | None:
    return getattr(t, INFO_ATTR, None) if isinstance(t, nn.Parameter) else None


def define_row_markers(gather_name: str, reduce_name: str):
    """Define a pair of marker ops over row shards and return them (as `torch.ops.piper.*` overloads):

    - `piper::<gather_name>(shard, full_shape, group_name)`: the full tensor of
      `full_shape`, gathered from every rank's rows (an all-gather over the group);
    - `piper::<reduce_name>(grad, shard_rows, group_name)`: this rank's rows of
      the group-averaged gradient (a reduce-scatter); the gather's backward.

    `shard` is this rank's rows, padded (as the program reads them) or not (a
    DTensor's local rows, read eagerly); the reduction gives back as many rows.

    Dynamo traces them as opaque ops that the passes find by target and lower
    as the strategy says; run eagerly (outside `torch.compile`) they do their
    collectives, so a prepared model still works as a plain module.
    """
    def gather(shard: torch.Tensor, full_shape: list[int], group_name: str) -> torch.Tensor:
        size = _group_size(group_name)
        padded = lowering.pad_rows(shard, RowShardLayout(tuple(full_shape), size).shard_rows)
        return lowering.gather_rows(padded, full_shape, size, group_name).clone()

    def reduce(grad: torch.Tensor, shard_rows: int, group_name: str) -> torch.Tensor:
        size = _group_size(group_name)
        padded_rows = RowShardLayout(tuple(grad.shape), size).shard_rows
        return lowering.reduce_scatter_rows(grad, padded_rows, size, group_name)[:shard_rows].clone()

    gather_op = torch.library.custom_op(f"piper::{gather_name}", gather, mutates_args=())
    reduce_op = torch.library.custom_op(f"piper::{reduce_name}", reduce, mutates_args=())
    gather_op.register_fake(lambda shard, full_shape, group_name: shard.new_empty(full_shape))
    reduce_op.register_fake(lambda grad, shard_rows, group_name: grad.new_empty((shard_rows, *grad.shape[1:])))

    def setup_context(ctx, inputs, output):
        shard, _, group_name = inputs
        ctx.shard_rows, ctx.group_name = shard.shape[0], group_name

    def backward(ctx, grad):
        return reduce_op(grad, ctx.shard_rows, ctx.group_name), None, None

    gather_op.register_autograd(backward, setup_context=setup_context)
    return getattr(torch.ops.piper, gather_name).default, getattr(torch.ops.piper, reduce_name).default


def _group_size(group_name: str) -> int:
    return dist.get_world_size(resolve_process_group(group_name))


# The markers Dynamo traces where a shard is read, and where its gradient leaves.
UNSHARD, REDUCE_GRAD = define_row_markers("unshard", "reduce_grad")


def shard_parameters(model: nn.Module, mesh: DeviceMesh, keep: Callable[[nn.Parameter], bool] = lambda p: False
                     ) -> None:
    """Replace every parameter of `model` but those `keep` selects (and 0-d ones, which
    have no rows to split) by this rank's rows, a `Shard(0)` DTensor parameter on the
    1-D `mesh` (the strategy mesh's "dp"), in place.

    Tied parameters (one `Parameter` held by several modules) stay tied: they
    get one DTensor parameter, read through `piper::unshard` in every module that holds it.
    Each whole parameter is let go once its rows replace it, as FSDP2's `fully_shard` lets
    go of each module's: a rank holds the model and its shards at once only if the caller
    keeps the model's parameters.
    """
    group_name = mesh.get_group().group_name
    owners = parameter_owners(model, skip=lambda p: p.dim() == 0 or keep(p))
    owners.reverse()
    while owners:
        original, holders = owners.pop()
        layout = RowShardLayout(tuple(original.shape), mesh.size())
        shard = layout.parameter(original.detach(), mesh, original.requires_grad)
        setattr(shard, INFO_ATTR, ShardedParameter(tuple(fqn for fqn, _, _ in holders), layout, group_name))
        full_shape = list(layout.full_shape)
        placeholder = program_placeholder(shard, holders[0][0])
        for _, module, name in holders:
            module._parameters[name] = shard
            read_through(module, name, placeholder, (UNSHARD, full_shape, group_name))
