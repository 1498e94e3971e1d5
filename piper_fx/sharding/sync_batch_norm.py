"""`nn.SyncBatchNorm` across data-parallel replicas, in a form Dynamo traces.

PyTorch's `SyncBatchNorm` gathers each replica's batch statistics with eager
collectives inside an autograd Function (and runs on accelerators only), which
Dynamo cannot trace: it gives up on the model's frame. `prepare` makes each one
a `ReplicaSyncBatchNorm` (its class swapped in place, as FSDP2's `fully_shard`
swaps a module's class), whose training forward computes the same with a
functional, differentiable all-gather (`all_gather_single_autograd`, whose
backward reduce-scatters the statistics' gradients) over the module's
`process_group`, set to the strategy's data-parallel group: every replica
normalizes by the mean and variance of all replicas' rows, as one process
would on the global batch, and updates the running statistics from them (the
variance unbiased over every row, as `BatchNorm` does). Each replica's
mean, variance and row count are gathered and combined (Chan's parallel
variance), as `batch_norm_gather_stats_with_counts` combines them. With one
replica, in eval mode, or without running statistics outside training, it is
a `BatchNorm` of the replica's rows. Under a pipeline each microbatch's
statistics are its rows' across the replicas.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_gather_single_autograd

from ..errors import PiperError


class ReplicaSyncBatchNorm(nn.SyncBatchNorm):
    """A `SyncBatchNorm` whose statistics are gathered over its `process_group` (None: none,
    one replica) by functional collectives that Dynamo traces (module docstring)."""

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        self._check_non_zero_input_channels(input)
        momentum: float | torch.Tensor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # a cumulative average (a tensor: `.item()` would break the graph)
                momentum = 1.0 / self.num_batches_tracked
        if not self.training:  # the running statistics, or this replica's rows' without them, as SyncBatchNorm
            bn_training = self.running_mean is None and self.running_var is None
            return F.batch_norm(input, self.running_mean, self.running_var, self.weight, self.bias, bn_training,
                                0.0, self.eps)
        tracked = self.track_running_stats
        return _batch_norm_over_replicas(input, self.weight, self.bias, self.running_mean if tracked else None,
                                         self.running_var if tracked else None, momentum, self.eps,
                                         self.process_group)


def _batch_norm_over_replicas(input: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
                              running_mean: torch.Tensor | None, running_var: torch.Tensor | None,
                              momentum: float | torch.Tensor, eps: float,
                              group: dist.ProcessGroup | None) -> torch.Tensor:
    """Batch norm of `input` by the statistics of every replica's rows in `group` (this
    replica's alone where None), updating the running statistics from them. Statistics in
    fp32 for a reduced-precision input, as PyTorch's kernels accumulate them."""
    channels = input.shape[1]
    dims = [0, *range(2, input.dim())]
    x = input.float() if input.dtype in (torch.float16, torch.bfloat16) else input
    var, mean = torch.var_mean(x, dims, correction=0)
    if group is not None:
        count = torch.full_like(mean, input.numel() // channels)
        gathered = all_gather_single_autograd(torch.stack([mean, var, count]), gather_dim=0, group=group)
        means, variances, counts = gathered.view(-1, 3, channels).unbind(1)
        rows = counts.sum(0)
        mean = (counts * means).sum(0) / rows
        var = (counts * (variances + (means - mean) ** 2)).sum(0) / rows
    else:
        rows = input.numel() // channels
    if running_mean is not None and running_var is not None:
        with torch.no_grad():
            running_mean.lerp_(mean.detach().to(running_mean.dtype), momentum)
            running_var.lerp_((var.detach() * (rows / (rows - 1))).to(running_var.dtype), momentum)
    shape = [1, channels] + [1] * (input.dim() - 2)
    y = (x - mean.view(shape)) * torch.rsqrt(var + eps).view(shape)
    if weight is not None:
        y = y * weight.view(shape)
    if bias is not None:
        y = y + bias.view(shape)
    return y.to(input.dtype)


def replica_sync_batch_norms(model: nn.Module, group: dist.ProcessGroup | None) -> None:
    """Make each `nn.SyncBatchNorm` of `model` a `ReplicaSyncBatchNorm` over `group`, the
    strategy's data-parallel group (None: one replica), in place. One set to another process
    group is a `PiperError`: piper_fx's replicas are its data-parallel group's ranks."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.SyncBatchNorm) or isinstance(module, ReplicaSyncBatchNorm):
            continue
        if module.process_group is not None and module.process_group is not group:
            raise PiperError(f"the model's {name} (SyncBatchNorm) synchronizes over a process group of its own: "
                             "piper_fx synchronizes it over the strategy's data-parallel replicas; convert it with "
                             "nn.SyncBatchNorm.convert_sync_batchnorm(model) without a process group")
        module.__class__ = ReplicaSyncBatchNorm
        module.process_group = group
