"""The reduction of gradients a model's steps held while its synchronization was off
(`piper_fx.no_sync`), at the first call after.

Each held gradient is this replica's whole, unreduced one, summed over the window's
calls in the mixed-precision policy's reduction dtype (`held`), as FSDP2 sums its
unsharded gradients under `set_requires_gradient_sync(False)`. They are reduced as the
strategy's program reduces gradients (`passes.reduce_gradients`), in the same
arithmetic (`collectives.lowering`, `collectives.buckets`), averaged over the
parameter's data-parallel group in the policy's reduction dtype: a replicated
parameter's (ZeRO-0, 0-d ones at any level) all-reduced; a row-sharded one's
all-reduced and this rank's rows kept at ZeRO-1, reduce-scattered at ZeRO-2/3.
Tensors of a kind and dtype go in buckets of at most `bucket_mb`, in the step's
order of its gradients, the same on every rank of the group. What each gives is the
program's form of the parameter's gradient (a row shard's padded rows), which the
step hands over as it hands over its program's.

The window's collectives run after its last call's program, not overlapped with its
backward as that program's would be: the cost of one reduction a window, where the
window saved one a call.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.tensor import DTensor, Shard

from ..collectives.buckets import FLAT_BUCKET
from ..collectives.lowering import pad_rows
from ..compat import resolve_process_group

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class GradientReduction:
    """How a strategy reduces gradients: ZeRO's level, the data-parallel group of parameters
    that are not DTensors (a model compiled without `prepare`), the reduction dtype (None:
    each gradient's own) and the bucket size."""

    zero: int
    dp_group: str
    reduce_dtype: torch.dtype | None
    bucket_bytes: int

    def held(self, grad: torch.Tensor) -> torch.Tensor:
        """A call's gradient as the window holds it: in the reduction dtype, as FSDP2 accumulates
        its unsharded gradients (in `reduce_dtype`, else in `param_dtype`, the parameter's)."""
        if self.reduce_dtype is None or not grad.is_floating_point() or grad.dtype == self.reduce_dtype:
            return grad
        return grad.to(self.reduce_dtype)

    def __call__(self, parameters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 sent: dict[str, int]) -> list[torch.Tensor]:
        """Each of `grads` (whole, unreduced) reduced for its parameter, in the program's form;
        the bytes this rank sent are added to `sent` by collective kind."""
        pieces = [_Piece.of(p, g, self) for p, g in zip(parameters, grads)]
        out: list[torch.Tensor | None] = [None] * len(pieces)
        bucket: list[int] = []
        for index, piece in enumerate(pieces):
            if bucket and (not piece.joins(pieces[bucket[0]]) or
                           sum(pieces[i].bytes for i in bucket) + piece.bytes > self.bucket_bytes):
                self._reduce([pieces[i] for i in bucket], bucket, out, sent)
                bucket = []
            bucket.append(index)
        if bucket:
            self._reduce([pieces[i] for i in bucket], bucket, out, sent)
        return out

    @staticmethod
    def _reduce(pieces: list["_Piece"], indices: list[int], out: list, sent: dict[str, int]) -> None:
        first = pieces[0]
        rows = first.group_size if first.scatters else 1
        flat = FLAT_BUCKET([p.grad for p in pieces], rows, first.dtype)
        kind = "reduce_scatter" if first.scatters else "all_reduce"
        sent[kind] = sent.get(kind, 0) + flat.numel() * flat.element_size()
        if first.scatters:
            reduced = _c10d.reduce_scatter_tensor(flat, "avg", first.group_size, first.group_name)
        else:
            reduced = _c10d.all_reduce(flat, "avg", first.group_name)
        reduced = _c10d.wait_tensor(reduced)
        offset = 0
        for index, piece in zip(indices, pieces):
            size = piece.grad.numel() // rows
            out[index] = piece.result(reduced.narrow(0, offset, size))
            offset += size


@dataclass
class _Piece:
    """One gradient to reduce: over which group, by which collective, in which dtype."""

    grad: torch.Tensor  # as the bucket takes it: rows padded to the group's where it scatters
    shape: torch.Size  # the parameter's whole shape
    dtype: torch.dtype  # the reduction's
    out_dtype: torch.dtype  # the parameter's
    group_name: str
    group_size: int
    group_rank: int
    shard_rows: int | None  # a row shard's padded rows; None for a replica
    scatters: bool  # reduce-scattered (ZeRO-2/3's row shards), else all-reduced

    @staticmethod
    def of(parameter: torch.Tensor, grad: torch.Tensor, reduction: GradientReduction) -> "_Piece":
        sharded = isinstance(parameter, DTensor) and parameter.dim() > 0 and isinstance(parameter.placements[0], Shard)
        if isinstance(parameter, DTensor):
            group = parameter.device_mesh.get_group()
        else:
            group = resolve_process_group(reduction.dp_group)
        size = group.size()
        dtype = reduction.reduce_dtype if reduction.reduce_dtype is not None and grad.is_floating_point() else grad.dtype
        shard_rows = -(-parameter.shape[0] // size) if sharded else None
        scatters = sharded and reduction.zero >= 2
        flat = grad.reshape(1) if grad.dim() == 0 else grad
        if scatters:
            flat = pad_rows(flat, shard_rows * size)
        return _Piece(flat.contiguous(), grad.shape, dtype, parameter.dtype, group.group_name, size, group.rank(),
                      shard_rows, scatters)

    @property
    def bytes(self) -> int:
        return self.grad.numel() * self.dtype.itemsize

    def joins(self, first: "_Piece") -> bool:
        """Whether this goes in the bucket `first` began."""
        return (self.scatters, self.group_name, self.dtype) == (first.scatters, first.group_name, first.dtype)

    def result(self, reduced: torch.Tensor) -> torch.Tensor:
        """The parameter's gradient in the program's form, from its part of the bucket's result."""
        if self.scatters:
            piece = reduced.view(self.shard_rows, *self.shape[1:])
        elif self.shard_rows is not None:  # ZeRO-1: the whole gradient averaged; this rank's rows
            whole = pad_rows(reduced.view(self.shape), self.shard_rows * self.group_size)
            piece = whole.narrow(0, self.group_rank * self.shard_rows, self.shard_rows)
            return piece.to(self.out_dtype, copy=True)  # not a view that keeps the whole gradient
        else:
            piece = reduced.view(self.shape)
        return piece.to(self.out_dtype)  # a view of the bucket's result in the parameter's dtype
