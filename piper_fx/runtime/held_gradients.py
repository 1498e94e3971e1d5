"""The reduction of gradients a model's steps held while its synchronization was off
(`piper_fx.no_sync`), at the first call after. At each call's backward,
`held_until_synced` decides which gradients the window holds, which it reduces and
which it hands over.

Each held gradient is this replica's whole, unreduced one, summed over the window's
calls in the mixed-precision policy's reduction dtype (`held`), as FSDP2 sums its
unsharded gradients under `set_requires_gradient_sync(False)`. They are reduced as the
strategy's program reduces gradients (`passes.reduce_gradients`), in the same
arithmetic (`collectives.lowering`, `collectives.buckets`), averaged over the
parameter's data-parallel group in the policy's reduction dtype: a replicated
parameter's (ZeRO-0, 0-d ones at any level) all-reduced; a row-sharded one's
all-reduced and this rank's rows kept at ZeRO-1, reduce-scattered at ZeRO-2/3; a
block of experts (ep > 1), already summed over the tokens of its ep group in the
program (`passes.shard_experts`), all-reduced over the ranks holding the same
block, if others do.
Tensors of a kind and dtype go in buckets of at most `bucket_mb`, in the step's
order of its gradients, the same on every rank of the group. What each gives is the
program's form of the parameter's gradient (a row shard's padded rows), which the
step hands over as it hands over its program's.

Where the strategy allows it (`passes.reduce_gradients.reduces_held_gradients`), the
window's first call after it runs a program that adds each held gradient to its own
right before reducing it (`adds_held_gradients`), so the window's collectives overlap
that call's backward, as DDP's do: it reads the held gradient divided by the loss seed
of the window's latest call (`take_into_program`), as the call's own seed, known only
at its backward, scales the program's gradients after, and `given_back` hands them over,
correcting by a reduction of what was held where the call's seed is another, or where
the call's backward takes its gradients (`torch.autograd.grad`) or leaves them out,
which leave what was held for the next call. Elsewhere the window's collectives run after
its last call's program, not overlapped with its backward: the cost of one reduction a
window, where the window saved one a call. (While a window holds some of a model's
parameters alone, a submodule's, the others' are reduced so after each call's program.)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from ..collectives.buckets import FLAT_BUCKET
from ..collectives.lowering import pad_rows
from ..compat import leaf_use, resolve_process_group
from ..errors import PiperError
from ..gradient_sync import divided, hold, release, set_pending, take
from ..sharding.experts import is_expert_parameter

_c10d = torch.ops._c10d_functional


@dataclass(frozen=True)
class GradientReduction:
    """How a strategy reduces gradients: ZeRO's level, the data-parallel group of parameters
    that are not DTensors (a model compiled without `prepare`), the reduction dtype (None:
    each gradient's own), the bucket size, whether experts are shared out (ep > 1), and the
    group of ranks holding the same block of experts (None: none other)."""

    zero: int
    dp_group: str
    reduce_dtype: torch.dtype | None
    bucket_bytes: int
    experts_shared: bool = False
    expert_replicas: str | None = None

    def held(self, grad: torch.Tensor) -> torch.Tensor:
        """A call's gradient as the window holds it: in the reduction dtype, as FSDP2 accumulates
        its unsharded gradients (in `reduce_dtype`, else in `param_dtype`, the parameter's)."""
        if self.reduce_dtype is None or not grad.is_floating_point() or grad.dtype == self.reduce_dtype:
            return grad
        return grad.to(self.reduce_dtype)

    def __call__(self, parameters: Sequence[torch.Tensor], grads: Sequence[torch.Tensor],
                 sent: dict[str, int]) -> list[torch.Tensor]:
        """Each of `grads` (whole, unreduced) reduced for its parameter, in the program's form;
        the bytes this rank sent are added to `sent` by collective kind. Every bucket's
        collective is issued before the first is waited for."""
        pieces = [self._piece(p, g) for p, g in zip(parameters, grads)]
        buckets: list[list[int]] = []
        filled = 0
        for index, piece in enumerate(pieces):
            if not buckets or not piece.joins(pieces[buckets[-1][0]]) or filled + piece.bytes > self.bucket_bytes:
                buckets.append([])
                filled = 0
            buckets[-1].append(index)
            filled += piece.bytes
        issued = [(bucket, _issue([pieces[i] for i in bucket], sent)) for bucket in buckets]
        out: list[torch.Tensor | None] = [None] * len(pieces)
        for bucket, reduced in issued:
            reduced, offset = _c10d.wait_tensor(reduced), 0
            for index in bucket:
                piece = pieces[index]
                size = piece.grad.numel() // piece.rows
                out[index] = piece.result(reduced.narrow(0, offset, size))
                offset += size
        return out

    def _piece(self, parameter: torch.Tensor, grad: torch.Tensor) -> "_Piece":
        """How `grad`, held for `parameter`, is reduced."""
        dtype = self.reduce_dtype if self.reduce_dtype is not None and grad.is_floating_point() else grad.dtype
        flat = grad.reshape(1) if grad.dim() == 0 else grad
        # A block of experts: known by the parameter, as its ep group may be the very ranks of dp.
        if self.experts_shared and is_expert_parameter(parameter):
            group = resolve_process_group(self.expert_replicas) if self.expert_replicas is not None else None
            return _Piece(flat.contiguous(), grad.shape, dtype, parameter.dtype, group, None,
                          "all_reduce" if group is not None else None)
        if isinstance(parameter, DTensor):
            group = parameter.device_mesh.get_group()
        else:
            group = resolve_process_group(self.dp_group)
        if not (isinstance(parameter, DTensor) and parameter.dim() > 0 and isinstance(parameter.placements[0], Shard)):
            return _Piece(flat.contiguous(), grad.shape, dtype, parameter.dtype, group, None, "all_reduce")
        shard_rows = -(-parameter.shape[0] // group.size())
        if self.zero >= 2:
            flat = pad_rows(flat, shard_rows * group.size())
            return _Piece(flat.contiguous(), grad.shape, dtype, parameter.dtype, group, shard_rows, "reduce_scatter")
        return _Piece(flat.contiguous(), grad.shape, dtype, parameter.dtype, group, shard_rows, "all_reduce")


def held_until_synced(reduction: GradientReduction, off: frozenset[int],
                      args: Sequence[torch.Tensor], grads: dict[int, torch.Tensor],
                      nodes: Sequence[torch.autograd.graph.Node | None],
                      sent: dict[str, int], seed: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """The gradients to hand over from a program that leaves them unreduced, `nodes` saying
    where each argument's goes and `off` which of `args` had their synchronization off when
    the call was made. A gradient the backward adds into `.grad` (`backward()`) is held for
    its parameter (`gradient_sync.hold`) where synchronization was off, and handed over
    otherwise, reduced with what was held for it (`GradientReduction`); every rank records
    which parameters' gradients are held (`gradient_sync.set_pending`) from the backward's
    use of each, its own or not. One the backward leaves out (`backward(inputs=...)` not
    naming its parameter) is dropped, as PyTorch computes none. `grads` are scaled by the
    call's loss `seed` (None: by 1), which each held one keeps. One `torch.autograd.grad`
    takes is this call's alone, reduced where synchronization is on (what is held stays for
    the next call that accumulates); where it is off, a `PiperError`: a window hands no
    gradient back before its end, and a replica's unreduced one is not a gradient of its
    parameters. The bytes sent are added to `sent`."""
    uses = [leaf_use(node) for node in nodes]
    if any(uses[index] == "captured" for index in off):
        raise PiperError(
            "torch.autograd.grad of a step called while its model's gradient synchronization is off "
            "(piper_fx.no_sync, or set_requires_gradient_sync(model, False)): the window holds each call's "
            "gradients, unreduced, until its first call with synchronization on reduces them, and hands none "
            "back before. Call torch.autograd.grad on a call made with synchronization on, or accumulate "
            "with loss.backward()")
    for index, use in enumerate(uses):
        if use == "accumulated":
            set_pending(args[index], index in off)
    reduced, unreduced = [], []
    for index, grad in grads.items():
        use = uses[index]
        if use == "left out":
            continue
        if use == "captured":
            reduced.append(index)
            unreduced.append(reduction.held(grad))
            continue
        if index in off:
            hold(args[index], reduction.held(grad), held_seed(seed))
        else:  # this call's with what was held
            held = take(args[index])
            reduced.append(index)
            unreduced.append(reduction.held(grad) if held is None else held.add_(reduction.held(grad)))
    if not reduced:
        return {}
    return dict(zip(reduced, reduction([args[i] for i in reduced], unreduced, sent)))


def is_one_on_host(seed: torch.Tensor | None) -> bool:
    """Whether a loss seed is 1 (None) and known to be without a read that waits for a device."""
    return seed is None or (seed.device.type == "cpu" and seed.numel() == 1 and seed.item() == 1.0)


def held_seed(seed: torch.Tensor | None) -> torch.Tensor | None:
    """A call's loss seed as a held gradient keeps it, to be read divided by it
    (`take_into_program`): None for 1, else a copy of its own, a zero one as 1 (whichever it
    is divided by, `given_back` corrects by the call's own)."""
    if is_one_on_host(seed):
        return None
    seed = seed.detach()
    if seed.device.type == "cpu" and seed.numel() == 1:
        return None if seed.item() == 0.0 else seed.clone()
    return torch.where(seed == 0, torch.ones_like(seed), seed)  # on a device, without reading it


@dataclass(frozen=True)
class Taken:
    """What a window held for a parameter, as the program of its first call after it read it:
    divided by the loss seed of the window's latest call (`seed`; None: 1), and still held
    (`gradient_sync.divided`) until that call's backward hands it over."""

    fed: torch.Tensor
    seed: torch.Tensor | None


def take_into_program(parameter: torch.Tensor, shape: torch.Size, dtype: torch.dtype,
                      device: torch.device) -> tuple[torch.Tensor, Taken | None]:
    """What the program of a window's first call after it (`adds_held_gradients`) reads for
    `parameter`'s held gradient (of `shape` and `dtype`, contiguous, on `device`): the held one
    divided by the loss seed of the window's latest call, as the call's own seed scales the
    program's sum after (`given_back`), and what it took; zeros where the window held none. What
    it took stays held until the call's backward, so a call whose backward never runs loses
    none of it."""
    held = divided(parameter)
    if held is None:
        return torch.zeros(shape, dtype=dtype, device=device), None
    fed, seed = held
    return fed.contiguous(), Taken(fed, seed)


def given_back(reduction: GradientReduction, taken: dict[int, Taken], args: Sequence[torch.Tensor],
               grads: dict[int, torch.Tensor], nodes: Sequence[torch.autograd.graph.Node | None],
               sent: dict[str, int], seed: torch.Tensor | None) -> dict[int, torch.Tensor]:
    """The gradients to hand over from the program of a window's first call after it, which
    reduced what the window held (`taken`, by argument index, `take_into_program`) with the
    call's own, scaled after by the call's loss `seed` (None: 1). Where the backward adds one
    into `.grad`, its parameter holds nothing more (`gradient_sync.set_pending`); it is handed
    over as it is where the window's latest seed was the call's, and otherwise corrected by
    the difference of the seeds times what was held, reduced by itself. One the backward
    leaves out (`backward(inputs=...)`) is dropped, and one `torch.autograd.grad` takes is
    this call's alone: what was held, reduced, is taken off it; either way what was taken stays
    held for the next call that accumulates (`held_until_synced` does the same). Every
    rank makes the same corrections, as each rank's backward is the same. Reading a seed on a
    device waits for its queue (once a window). The bytes sent are added to `sent`."""
    uses = [leaf_use(node) for node in nodes]
    for index, use in enumerate(uses):
        if use == "accumulated":
            set_pending(args[index], False)
    call_seed = 1.0 if seed is None else seed
    corrections: dict[int, torch.Tensor | float] = {}
    for index, held in taken.items():
        window_seed = 1.0 if held.seed is None else held.seed
        if uses[index] == "captured":  # the call's own: s * reduced(own + held / seed) - s * reduced(held / seed)
            corrections[index] = -call_seed
        elif uses[index] == "accumulated" and float(window_seed) != float(call_seed):
            corrections[index] = window_seed - call_seed  # s * reduced(own + held / seed) + (seed - s) * ...
    if corrections:
        indices = [i for i in corrections if i in grads]
        reduced = reduction([args[i] for i in indices], [taken[i].fed for i in indices], sent)
        for index, correction in zip(indices, reduced):
            grads[index] = grads[index] + correction * corrections[index]
    for index in taken:
        if uses[index] == "accumulated":
            release(args[index])
        else:
            set_pending(args[index], True)
    return {index: grad for index, grad in grads.items() if uses[index] != "left out"}


def _issue(pieces: list["_Piece"], sent: dict[str, int]) -> torch.Tensor:
    """Start the collective of a bucket of `pieces` (of one kind, group and dtype); return its
    result, to wait for (the bucket itself where it has none: a block no other rank holds)."""
    first = pieces[0]
    flat = FLAT_BUCKET([p.grad for p in pieces], first.rows, first.dtype)
    if first.kind is None:
        return flat
    sent[first.kind] = sent.get(first.kind, 0) + flat.numel() * flat.element_size()
    if first.kind == "reduce_scatter":
        return _c10d.reduce_scatter_tensor(flat, "avg", first.group.size(), first.group.group_name)
    return _c10d.all_reduce(flat, "avg", first.group.group_name)


@dataclass
class _Piece:
    """One gradient to reduce: over which group, by which collective, in which dtype."""

    grad: torch.Tensor  # as the bucket takes it: rows padded to the group's where it scatters
    shape: torch.Size  # the gradient's whole shape
    dtype: torch.dtype  # the reduction's
    out_dtype: torch.dtype  # the parameter's
    group: dist.ProcessGroup | None
    shard_rows: int | None  # a row shard's padded rows; None for a replica or a block of experts
    kind: str | None  # "reduce_scatter" (ZeRO-2/3's row shards), "all_reduce", or None: kept as it is

    @property
    def rows(self) -> int:
        """The rows of its bucket's flat buffer: one a rank of the group where it scatters."""
        return self.group.size() if self.kind == "reduce_scatter" else 1

    @property
    def bytes(self) -> int:
        return self.grad.numel() * self.dtype.itemsize

    def joins(self, first: "_Piece") -> bool:
        """Whether this goes in the bucket `first` began."""
        return (self.kind, self.group, self.dtype) == (first.kind, first.group, first.dtype)

    def result(self, reduced: torch.Tensor) -> torch.Tensor:
        """The parameter's gradient in the program's form, from its part of the bucket's result."""
        if self.kind == "reduce_scatter":
            piece = reduced.view(self.shard_rows, *self.shape[1:])
        elif self.shard_rows is not None:  # ZeRO-1: the whole gradient averaged; this rank's rows
            whole = pad_rows(reduced.view(self.shape), self.shard_rows * self.group.size())
            piece = whole.narrow(0, self.group.rank() * self.shard_rows, self.shard_rows)
            return piece.to(self.out_dtype, copy=True)  # not a view that keeps the whole gradient
        else:
            piece = reduced.view(self.shape)
        return piece.to(self.out_dtype)  # a view of the bucket's result in the parameter's dtype
