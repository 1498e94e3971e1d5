"""`piper_fx.full_state_dict`: full tensors of a (possibly sharded) model."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from .compat import resolve_process_group
from .sharding.holdings import holding_of
from .sharding.row_shard import sharded_parameter_info


def _from_owner(value: torch.Tensor, parameter: torch.Tensor) -> torch.Tensor:
    """`value` as the pipeline rank that trains the parameter has it (collective over the pp group)."""
    owner = holding_of(parameter).pipeline
    if owner is None:
        return value
    owner, group_name = owner
    group = resolve_process_group(group_name)
    value = value.contiguous()
    dist.broadcast(value, src=dist.get_global_rank(group, owner), group=group)
    return value


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters and buffers under their original names, on every rank.

    Collective for sharded and pipelined models (every rank must call it):
    shards are gathered over the data-parallel group, and each parameter of a
    pipeline comes from the pipeline rank that trains it. Keys match `model.state_dict()` of the unprepared model, tied
    parameters included under each of their names.
    """
    state: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, parametrize.ParametrizationList):
            continue  # its `original` is the shard, reported below as the full tensor
        prefix = f"{module_name}." if module_name else ""
        for name, p in module._parameters.items():
            if p is not None:
                state[prefix + name] = _from_owner(p.detach().clone(), p)
        if parametrize.is_parametrized(module):
            for name in module.parametrizations:
                original = module.parametrizations[name].original
                if sharded_parameter_info(original) is None:
                    raise RuntimeError(f"{prefix}{name} has a parametrization piper_fx did not make")
                state[prefix + name] = _from_owner(getattr(module, name).detach().clone(), original)
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                state[prefix + name] = b.detach().clone()
    return state
