"""What each parameter / gradient collective computes, as plain PyTorch code.

These functions run eagerly (over a real process group) and are also traced
into the per-rank graphs by `collectives.emit`, so eager use of a sharded
module and the compiled program run the very same arithmetic. They use
functional collectives (`_c10d_functional.*` + `wait_tensor`), which Inductor
compiles and which work over gloo and NCCL alike.

Sharded layout (FSDP2's convention, DTensor `Shard(0)` with padding): a tensor
of `rows` rows along dim 0 (a 0-d tensor counts as one row) is padded to
`shard_rows * group_size` rows and rank i holds rows [i*shard_rows, (i+1)*shard_rows).
Gradients are averaged over the group: each replica's loss is the mean over
its share of the global batch, so the mean of the replicas' gradients is the
gradient of the global-batch mean.
"""
from __future__ import annotations

import torch

_c10d = torch.ops._c10d_functional


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1) if t.dim() == 0 else t


def pad_rows(t: torch.Tensor, padded_rows: int) -> torch.Tensor:
    missing = padded_rows - t.shape[0]
    if missing == 0:
        return t
    return torch.cat([t, t.new_zeros((missing, *t.shape[1:]))])


def gather_rows(shard: torch.Tensor, full_shape: list[int], group_size: int, group_name: str) -> torch.Tensor:
    """All-gather row shards and cut the padding: the full parameter."""
    gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(shard.contiguous(), group_size, group_name))
    rows = full_shape[0] if full_shape else 1
    return gathered.narrow(0, 0, rows).reshape(full_shape)


def reduce_scatter_rows(grad: torch.Tensor, shard_rows: int, group_size: int, group_name: str) -> torch.Tensor:
    """Average a full gradient over the group and keep this rank's row shard (ZeRO-2/3)."""
    padded = pad_rows(_as_rows(grad), shard_rows * group_size).contiguous()
    return _c10d.wait_tensor(_c10d.reduce_scatter_tensor(padded, "avg", group_size, group_name))


def take_rows(full: torch.Tensor, shard_rows: int, group_size: int, group_rank: int) -> torch.Tensor:
    """This rank's row shard of a value every rank holds whole (no communication)."""
    padded = pad_rows(_as_rows(full), shard_rows * group_size)
    return padded.narrow(0, group_rank * shard_rows, shard_rows).clone()


def all_reduce_mean(grad: torch.Tensor, group_name: str) -> torch.Tensor:
    """Average a gradient over the group (DDP)."""
    return _c10d.wait_tensor(_c10d.all_reduce(grad.contiguous(), "avg", group_name))


# Expert parallelism. Inside an EP region a rank computes its own E/ep experts
# for the tokens of every rank of its ep group, laid out "rank-major": row
# i = source * (E/ep) + local expert, the same (E, ...) shape the model traced.


def all_to_all_experts(x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    """Exchange the group_size equal blocks of dim 0: block j goes to rank j, and block j
    of the result came from rank j. Dispatch (expert-major -> rank-major) and combine
    (rank-major -> expert-major) are this same exchange, and so is its backward."""
    blocks = [x.shape[0] // group_size] * group_size
    return _c10d.wait_tensor(_c10d.all_to_all_single(x.contiguous(), blocks, blocks, group_name))


def repeat_experts(shard: torch.Tensor, group_size: int) -> torch.Tensor:
    """This rank's experts' weights in the rank-major layout: its block once per source rank."""
    return shard.repeat(group_size, *([1] * (shard.dim() - 1)))


def fold_expert_grad(grad: torch.Tensor, group_size: int) -> torch.Tensor:
    """The gradient of this rank's experts from a rank-major one: summed over source
    ranks, and divided by the ep group's size, since each source's loss is the mean over
    its own batch (with the replicas' average over dp/ep, the average over all of dp)."""
    return grad.view(group_size, grad.shape[0] // group_size, *grad.shape[1:]).sum(0) / group_size
