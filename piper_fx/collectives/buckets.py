"""The ops a bucket of collectives is made of (`passes.bucket_collectives`), which the
compiled code calls as they are.

- `piper::flat_bucket`: a bucket's flat buffer, made by one op where Inductor would make
  and compile a copy kernel per tensor of the bucket (Inductor's `custom_ops` bucket
  mode makes the same choice).
- `piper::gather_bucket`: a bucket's all-gather, in place as FSDP2's: the rank's shards
  are copied into its own slot of the gathered buffer, which the collective then fills.
  No flat input lives apart from the result, for gloo's worker thread to hold past the
  step's use of it, and the graph names no rank (it is found when the op runs), so every
  rank of a group has the same task code (`codegen.shared`).
- `piper::unpack_bucket`: a gathered bucket's tensors, each copied out of it whole, by one
  op as FSDP2's `split_with_sizes_copy`, where Inductor would make and compile copy kernels
  (about a second of a cold compile each on a CPU, for every layout of bucket).
"""
from __future__ import annotations

import torch

from ..compat import flatten_dense_tensors, resolve_process_group


def _cast(tensors: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    return [t.to(dtype) for t in tensors] if any(t.dtype != dtype for t in tensors) else tensors


@torch.library.custom_op("piper::flat_bucket", mutates_args=())
def _flat_bucket(tensors: list[torch.Tensor], rows: int, dtype: torch.dtype) -> torch.Tensor:
    """A bucket's flat buffer: `tensors`, each cast to `dtype` and seen as `rows` rows,
    laid out row by row (row r holds each tensor's row r in turn). A reduce-scatter's
    bucket has a row per rank of the group, so that rank r's part of the result holds its
    part of every tensor; an all-reduce's has one row. One call of `torch.cat` (with one
    row, of `flatten_dense_tensors`, which views each tensor in C++: 0.13 ms for 148 of
    them, 2.6 MB, where viewing them in Python took 0.4 ms), where Inductor would make and
    compile a kernel per tensor: on a GPT of 12 blocks under ZeRO-3, the backward's last
    region (a bucket of 148 gradients) took 18 s of a rank's cold compile that way."""
    tensors = _cast(tensors, dtype)
    if rows > 1 or len(tensors) == 1:  # (`flatten_dense_tensors` returns one tensor as a view of it)
        return torch.cat([t.reshape(rows, -1) for t in tensors], dim=1).reshape(-1)
    return flatten_dense_tensors(tensors)


@_flat_bucket.register_fake
def _(tensors, rows, dtype):
    return tensors[0].new_empty(sum(t.numel() for t in tensors), dtype=dtype)


FLAT_BUCKET = torch.ops.piper.flat_bucket.default


@torch.library.custom_op("piper::gather_bucket", mutates_args=())
def _gather_bucket(shards: list[torch.Tensor], group_size: int, group_name: str, dtype: torch.dtype) -> torch.Tensor:
    """Start gathering a bucket of `shards` over the group: the result holds each rank's
    shards, cast to `dtype` and flattened one after another, rank after rank, once its
    `wait_tensor` returns. The rank's own shards are copied into its slot of the result
    and gathered from there (`all_gather_into_tensor_out`, whose work the wait finds)."""
    numel = sum(t.numel() for t in shards)
    gathered = shards[0].new_empty(group_size * numel, dtype=dtype)
    mine = gathered.narrow(0, resolve_process_group(group_name).rank() * numel, numel)
    torch.cat([t.reshape(-1) for t in _cast(shards, dtype)], out=mine)
    return torch.ops._c10d_functional.all_gather_into_tensor_out(mine, group_size, group_name, out=gathered)


@_gather_bucket.register_fake
def _(shards, group_size, group_name, dtype):
    return shards[0].new_empty(group_size * sum(t.numel() for t in shards), dtype=dtype)


GATHER_BUCKET = torch.ops.piper.gather_bucket.default


@torch.library.custom_op("piper::unpack_bucket", mutates_args=())
def _unpack_bucket(gathered: torch.Tensor, group_size: int, dims: list[int], shape: list[int]) -> list[torch.Tensor]:
    """The tensors of a gathered bucket (`gather_bucket`'s result once waited for), each new and
    contiguous: tensor i, of `dims[i]` dimensions, its shape the next `dims[i]` sizes of
    `shape`, holds every rank's shard of it (its rows, rank after rank), each shard
    `1/group_size` of it, where the bucket holds each rank's shards one after another."""
    out = _unpacked_like(gathered, group_size, dims, shape)
    torch.split_with_sizes_copy(gathered.view(group_size, -1), [t.numel() // group_size for t in out], dim=1,
                                out=[t.view(group_size, -1) for t in out])
    return out


def _unpacked_like(gathered: torch.Tensor, group_size: int, dims: list[int], shape: list[int]) -> list[torch.Tensor]:
    out, start = [], 0
    for n in dims:
        out.append(gathered.new_empty(shape[start:start + n]))
        start += n
    return out


_unpack_bucket.register_fake(_unpacked_like)

UNPACK_BUCKET = torch.ops.piper.unpack_bucket.default
