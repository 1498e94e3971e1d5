"""`piper_fx.full_state_dict`: full tensors of a (possibly sharded) model."""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from .compat import resolve_process_group
from .sharding.holdings import holding_of, is_stored, whole_state_dict


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
    """Full parameters and buffers under their names, on every rank.

    Collective for sharded and pipelined models (every rank must call it):
    DTensor parameters are gathered over their group, and each parameter of a
    pipeline comes from the pipeline rank that trains it (each buffer the forward
    updates, from the one whose stage updates it). Keys are those of the
    unprepared model's `state_dict()`, tied parameters included under each of
    their names (under a pipeline every rank's, where a rank's own state dict
    holds its stages' alone).
    """
    state: dict[str, torch.Tensor] = {}
    with whole_state_dict():
        entries = model.state_dict(keep_vars=True)
    for name, value in entries.items():
        if not is_stored(value):  # a stage this rank does not run
            state[name] = _from_owner(torch.empty(value.shape, dtype=value.dtype, device=value.device), value)
        elif isinstance(value, nn.Parameter):
            full = value.full_tensor() if isinstance(value, DTensor) else value.detach().clone()
            state[name] = _from_owner(full, value)
        else:  # a buffer: under a pipeline, one the forward updates comes from the rank whose stage does
            state[name] = _from_owner(value.detach().clone(), value)
    return state
