"""`piper_fx.clip_grad_norm_`: gradient clipping by the norm of the whole model's gradient.

`torch.nn.utils.clip_grad_norm_` sees the gradients a process holds. Under
piper_fx those are pieces of the model's gradient: a ZeRO shard (a DTensor,
which torch's sees whole), one replica of many (plain data parallelism, a block of experts
copied over the ep groups' replicas), or nothing at all for parameters that
the rank's pipeline stages do not read. Each rank would clip by another norm,
and replicas would drift apart.

Requires: every rank of the default process group calls it, with the same
`max_norm` and `norm_type`, after `backward` and before the optimizer step
(it is a collective, even on a rank that holds no gradient). `parameters`
are those of a model laid out by `prepare` or compiled by the backend, which
record how each rank holds each parameter (`sharding.holdings`); a parameter
with no record is taken as whole and this rank's alone (counted on every rank).

Guarantees: the norm returned is, on every rank, the norm of the whole
model's gradient, as single-process `torch.nn.utils.clip_grad_norm_` computes
it on the unsplit model (to floating-point rounding: pieces are summed per rank,
then over ranks): each parameter's gradient counted once. Every held gradient
is scaled by the same coefficient on every rank (PyTorch's
`clip_grads_with_norm_`'s), so replicas stay identical. One
all-reduce over the default process group per call; none without one, or in a
world of one rank (then the result is exactly `torch.nn.utils.clip_grad_norm_`'s).
"""
from __future__ import annotations

import functools
import math
import types
import warnings
from typing import Iterable

import torch
import torch.distributed as dist
from torch import nn

from .sharding.holdings import Holding, holding_of
from .sharding.mesh import process_group_device_type


def clip_grad_norm_(parameters: torch.Tensor | Iterable[torch.Tensor] | nn.Module, max_norm: float,
                    norm_type: float = 2.0, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Clip the gradients of `parameters` by the norm of the whole model's gradient, over all ranks.

    `torch.nn.utils.clip_grad_norm_`'s signature and semantics, for a model
    split by piper_fx: `torch.nn.utils.clip_grad_norm_` on a rank sees only
    this rank's pieces (one replica of many, no gradient for parameters of
    other pipeline stages; DTensor shards it does see whole), so its norm
    differs from rank to rank and from the model's. This one computes the norm
    each parameter's gradient would have in single-process training, counting
    each piece once (the first replica of each, on the pipeline rank that
    trains it), combines the ranks' parts with one all-reduce
    (sum of norm**p, or max for `inf`), and scales every gradient this rank
    holds by PyTorch's coefficient `min(max_norm / (total_norm + 1e-6), 1)`.

    Collective: every rank of the default process group must call it, even one
    that holds no gradient, with the same `max_norm` and `norm_type`. Without a
    process group (or in a world of one rank) it is `torch.nn.utils.clip_grad_norm_`,
    bit for bit.

    Args:
        parameters: an iterable of parameters, a single tensor, or an `nn.Module`
            (its parameters): those of a model prepared or compiled by piper_fx.
        max_norm: max norm of the gradients.
        norm_type: the p-norm's p, or `inf`. Across ranks p must be positive
            (0 and negative orders are defined per tensor, not per piece).
        error_if_nonfinite: raise (on every rank, as torch does) if the total norm
            is nan or inf.
        foreach: as in torch: use the foreach kernels (None: where supported).

    Returns:
        The total norm of the model's gradient (a 0-dim tensor on the
        gradients' device), the same on every rank.
    """
    if isinstance(parameters, nn.Module):
        parameters = list(parameters.parameters())
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)  # a generator is read once
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=2)
    norm_type = float(norm_type)
    with torch.no_grad():
        total_norm = _total_norm(parameters, norm_type, foreach)
        if error_if_nonfinite and torch.logical_or(total_norm.isnan(), total_norm.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients from "
                "`parameters` is non-finite, so it cannot be clipped. To disable "
                "this error and scale the gradients by the non-finite norm anyway, "
                "set `error_if_nonfinite=False`")
        _scale(parameters, max_norm, total_norm, foreach)
    return total_norm


def _scale(parameters: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor, foreach: bool | None) -> None:
    """`torch.nn.utils.clip_grads_with_norm_` on the pieces this rank holds (a DTensor
    gradient's local rows: the coefficient is the same on every rank, so no DTensor op is needed)."""
    grads = [Holding.local(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return
    coefficient = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for grad in grads:
        by_device.setdefault(grad.device, []).append(grad)
    for device, device_grads in by_device.items():
        if foreach or (foreach is None and device.type != "cpu"):
            torch._foreach_mul_(device_grads, coefficient.to(device))
        else:
            for grad in device_grads:
                grad.mul_(coefficient.to(device))


def _total_norm(parameters: list[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    """The norm of the whole model's gradient: this rank's counted pieces, combined over all ranks."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    grads = [p.grad for p in parameters if p.grad is not None]
    if not distributed:
        pieces = [holding_of(p).local(p.grad) for p in parameters if p.grad is not None]
        if not pieces:  # torch's is a CPU zero; ours is where the gradients would be
            return torch.zeros((), dtype=_norm_dtype(parameters), device=_device(parameters, grads))
        return torch.nn.utils.get_total_norm(pieces, norm_type, False, foreach)
    if not (norm_type > 0):  # nan too
        raise ValueError(f"piper_fx.clip_grad_norm_: norm_type {norm_type} cannot be combined over ranks; "
                         "use a positive order or inf (orders <= 0 are defined per whole tensor)")
    counted = []
    for p in parameters:
        if p.grad is None:
            continue
        holding = holding_of(p)
        piece = holding.local(p.grad) if holding.counted else None
        if piece is not None and piece.numel():  # a rank may hold none of a parameter's rows
            counted.append(piece)
    # What travels is the same on every rank, whatever it holds: its dtype and size
    # depend on the parameters (every rank holds every parameter, or a piece of it).
    dtype, device = _norm_dtype(parameters), _device(parameters, grads)
    wire_dtype = torch.promote_types(dtype, torch.float32)
    local = (torch.nn.utils.get_total_norm(counted, norm_type, False, foreach).to(device, wire_dtype)
             if counted else torch.zeros((), dtype=wire_dtype, device=device))
    if math.isinf(norm_type):
        # The max, and whether any rank's part is nan (a max over ranks may drop a nan).
        nan = local.isnan()
        part = torch.stack([torch.where(nan, torch.zeros_like(local), local), nan.to(wire_dtype)])
        dist.all_reduce(part, op=dist.ReduceOp.MAX)
        total = torch.where(part[1] > 0, torch.full_like(part[0], math.nan), part[0])
    else:
        part = local.pow(norm_type)
        dist.all_reduce(part, op=dist.ReduceOp.SUM)
        total = part.pow(1.0 / norm_type)
    return total.to(dtype)


def _norm_dtype(parameters: list[torch.Tensor]) -> torch.dtype:
    """The dtype torch's norm of these parameters' gradients has (their promoted dtype)."""
    dtypes = [p.dtype for p in parameters if p.is_floating_point() or p.is_complex()]
    if not dtypes:
        return torch.get_default_dtype()
    dtype = functools.reduce(torch.promote_types, dtypes)
    return dtype.to_real() if dtype.is_complex else dtype


def _device(parameters: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.device:
    """Where the norm lives: the first gradient's device, else the first parameter's,
    else (a rank that holds nothing) the device the process group communicates on."""
    if grads:
        return grads[0].device
    if parameters:
        return parameters[0].device
    return torch.device(process_group_device_type())
