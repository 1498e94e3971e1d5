"""Start every data-parallel replica from the same values, as DDP does.

DDP broadcasts rank 0's parameters and buffers when it wraps a model, so
replicas that were initialized differently (no common seed) still train as one
model. piper_fx does the same: `prepare` before it shards, and the backend for
parameters it has not seen synchronized yet (a model compiled without `prepare`,
or built on the meta device and materialized after it).
"""
from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..compat import resolve_process_group

_SYNCED_ATTR = "_piper_replicas_synced"


@torch.no_grad()
def broadcast_from_first_replica(tensors: Iterable[torch.Tensor], group_name: str | None) -> None:
    """Overwrite `tensors` with the values of the dp group's first rank (collective), once each.
    DTensor parameters are skipped: `prepare` made them after synchronizing their values, but
    for the replicated ones materialized since on the meta device (`mark_unsynchronized`),
    whose local tensors are overwritten. A tensor on the meta device has no values yet: it is
    left to the backend, which synchronizes the model's tensors when it compiles."""
    if group_name is None:
        return
    group = resolve_process_group(group_name)
    source = dist.get_global_rank(group, 0)
    for tensor in tensors:
        if getattr(tensor, _SYNCED_ATTR, isinstance(tensor, DTensor)) or tensor.is_meta:
            continue
        dist.broadcast(tensor.to_local() if isinstance(tensor, DTensor) else tensor.data, src=source, group=group)
        setattr(tensor, _SYNCED_ATTR, True)


@torch.no_grad()
def broadcast_buffers(buffers: Sequence[torch.Tensor], group_name: str) -> int:
    """Overwrite `buffers` (plain tensors) with the values of the dp group's first rank
    (collective), as DDP with `broadcast_buffers=True` does before each forward: one broadcast
    of a flat copy per dtype, as DDP coalesces them. Returns the bytes this rank broadcast (the
    source's sent, the others' received)."""
    group = resolve_process_group(group_name)
    source = dist.get_global_rank(group, 0)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for buffer in buffers:
        by_dtype.setdefault(buffer.dtype, []).append(buffer)
    moved = 0
    for tensors in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in tensors])  # a copy: the others' copied back below
        dist.broadcast(flat, src=source, group=group)
        moved += flat.numel() * flat.element_size()
        if dist.get_rank() != source:
            for tensor, value in zip(tensors, flat.split([t.numel() for t in tensors])):
                tensor.copy_(value.view_as(tensor))
    return moved


def mark_unsynchronized(parameter: DTensor) -> None:
    """Have the backend start `parameter`'s replicas, a `Replicate()` DTensor given its memory
    after `prepare` (on the meta device, then `to_empty`), from the first one's values when it
    compiles, as `prepare` does for a model built with its values."""
    setattr(parameter, _SYNCED_ATTR, False)
