"""Expert parameters, sharded by experts over the expert-parallel group.

A mixture-of-experts layer holds its experts as batched weights whose dim 0
indexes the expert (e.g. `w_in` of shape (experts, d, hidden)). The model says
which they are with `piper_fx.mark_experts(module)`; with `mesh.ep > 1`,
`prepare` replaces each by the block of experts this rank computes (rank i of
the ep group holds experts [i*E/ep, (i+1)*E/ep)) and registers a
parametrization that turns the block back into the full weight with the
`piper::unshard_experts` op. Dynamo traces that op as a marker, distinct from
ZeRO's `piper::unshard` (whose group may be the very same ranks when ep = dp); the pass
`shard_experts` lowers it and its backward (`piper::reduce_expert_grad`) to
the local computation of an expert-parallel layer. Used eagerly (outside
`torch.compile`, e.g. by `full_state_dict`) the ops gather the experts over
the group and reduce-scatter their gradient, so a prepared model still runs
as a plain module.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from ..collectives import lowering
from ..compat import resolve_process_group
from .row_shard import _INFO_ATTR, RowShardLayout, ShardedParameter

_EXPERT_ATTR = "_piper_expert"


def mark_experts(module: nn.Module) -> nn.Module:
    """Declare every parameter of `module` an expert weight: dim 0 indexes the experts.

    With `mesh.ep > 1`, `piper_fx.prepare` shards these over the expert-parallel
    group, and their computation must run inside `piper_fx.annotate("EP")`.
    Returns `module`.
    """
    for p in module.parameters():
        setattr(p, _EXPERT_ATTR, True)
    return module


def is_expert_parameter(p: object) -> bool:
    return isinstance(p, nn.Parameter) and getattr(p, _EXPERT_ATTR, False)


def _group_size(group_name: str) -> int:
    return dist.get_world_size(resolve_process_group(group_name))


@torch.library.custom_op("piper::unshard_experts", mutates_args=())
def unshard_experts(shard: torch.Tensor, num_experts: int, group_name: str) -> torch.Tensor:
    """Every expert's weight, from this rank's block of experts (all-gather over the ep group)."""
    return lowering.gather_rows(shard, [num_experts, *shard.shape[1:]], _group_size(group_name), group_name).clone()


@unshard_experts.register_fake
def _unshard_experts_fake(shard, num_experts, group_name):
    return shard.new_empty((num_experts, *shard.shape[1:]))


@torch.library.custom_op("piper::reduce_expert_grad", mutates_args=())
def reduce_expert_grad(grad: torch.Tensor, local_experts: int, group_name: str) -> torch.Tensor:
    """The gradient of this rank's experts, averaged over the ep group."""
    return lowering.reduce_scatter_rows(grad, local_experts, _group_size(group_name), group_name).clone()


@reduce_expert_grad.register_fake
def _reduce_expert_grad_fake(grad, local_experts, group_name):
    return grad.new_empty((local_experts, *grad.shape[1:]))


def _unshard_experts_backward(ctx, grad):
    return reduce_expert_grad(grad, ctx.local_experts, ctx.group_name), None, None


def _unshard_experts_setup(ctx, inputs, output):
    shard, _, group_name = inputs
    ctx.local_experts, ctx.group_name = shard.shape[0], group_name


unshard_experts.register_autograd(_unshard_experts_backward, setup_context=_unshard_experts_setup)


class UnshardExperts(nn.Module):
    """Parametrization: this rank's block of experts -> the weights of every expert."""

    def __init__(self, num_experts: int, group_name: str):
        super().__init__()
        self.num_experts = num_experts
        self.group_name = group_name

    def forward(self, shard: torch.Tensor) -> torch.Tensor:
        return unshard_experts(shard, self.num_experts, self.group_name)


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters `mark_experts` marked, by name."""
    return {name: p for name, p in model.named_parameters() if is_expert_parameter(p)}


def shard_experts(model: nn.Module, group_name: str, group_size: int, group_rank: int) -> None:
    """Replace every expert parameter of `model` by this rank's block of experts, in place.

    Requires: each expert parameter's dim 0 divides by `group_size` (checked by `prepare`).
    """
    held = [(module_name, module, name, p) for module_name, module in model.named_modules()
            for name, p in module._parameters.items() if p is not None and is_expert_parameter(p)]
    for module_name, module, name, p in held:  # parametrizing adds modules: not while walking them
        fqn = f"{module_name}.{name}" if module_name else name
        layout = RowShardLayout(tuple(p.shape), group_size)
        shard = nn.Parameter(layout.shard_of(p.detach(), group_rank), requires_grad=p.requires_grad)
        setattr(shard, _EXPERT_ATTR, True)
        setattr(shard, _INFO_ATTR, ShardedParameter((fqn,), layout, group_name, mesh_dim="ep"))
        module._parameters[name] = shard
        parametrize.register_parametrization(module, name, UnshardExperts(p.shape[0], group_name), unsafe=True)
