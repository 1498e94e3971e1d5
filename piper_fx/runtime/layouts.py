"""Values laid out as the code that reads them was compiled for.

Inductor's code checks the strides of every input it is given, and a value can reach a
task in other strides than the ones it was traced with: a message arrives contiguous
(`p2p.Receiving`), and Inductor computes a task's outputs dense, in their order in memory,
so a broadcast view (an `expand`'s stride 0) that a task returns is a copy. `laid_out`
puts such a value in the strides its reader was compiled for.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..ir import broadcast_dims, wire_shape


def same_strides(value: torch.Tensor, shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether `value` is laid out in `stride` (that of a tensor of `shape`): the strides of
    its dims of more than one element, the only ones ever stepped, are those."""
    return all(have == want for have, want, size in zip(value.stride(), stride, shape) if size > 1)


def laid_out(value: torch.Tensor, shape: Sequence[int], stride: Sequence[int]) -> torch.Tensor:
    """`value` (of `shape`) in `stride`: itself if it is so; else its first element along
    each dim `stride` broadcasts (stride 0: the value is the same along it, as the traced
    one was), copied into `stride` where its other dims are laid out otherwise, and
    expanded back."""
    if same_strides(value, shape, stride):
        return value
    broadcast = broadcast_dims(shape, stride)
    for dim in broadcast:
        value = value.narrow(dim, 0, 1)
    compact = wire_shape(shape, broadcast)
    if not same_strides(value, compact, stride):
        value = torch.empty_strided(compact, stride, dtype=value.dtype, device=value.device).copy_(value)
    return value.expand(shape) if broadcast else value
