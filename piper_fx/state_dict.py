"""`piper_fx.full_state_dict`: full tensors of a (possibly sharded) model."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from .sharding.row_shard import sharded_parameter_info


@torch.no_grad()
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Full parameters and buffers under their original names, on every rank.

    Collective for sharded models (every rank of the data-parallel group must
    call it). Keys match `model.state_dict()` of the unprepared model, tied
    parameters included under each of their names.
    """
    state: dict[str, torch.Tensor] = {}
    for module_name, module in model.named_modules():
        if isinstance(module, parametrize.ParametrizationList):
            continue  # its `original` is the shard, reported below as the full tensor
        prefix = f"{module_name}." if module_name else ""
        for name, p in module._parameters.items():
            if p is not None:
                state[prefix + name] = p.detach().clone()
        if parametrize.is_parametrized(module):
            for name in module.parametrizations:
                original = module.parametrizations[name].original
                if sharded_parameter_info(original) is None:
                    raise RuntimeError(f"{prefix}{name} has a parametrization piper_fx did not make")
                state[prefix + name] = getattr(module, name).detach().clone()
        for name, b in module._buffers.items():
            if b is not None and name not in module._non_persistent_buffers_set:
                state[prefix + name] = b.detach().clone()
    return state
