"""Gradient accumulation without communication: `no_sync` and `set_requires_gradient_sync`.

    with piper_fx.no_sync(model):            # DDP's `model.no_sync()`
        for x, y in microbatches[:-1]:
            (step(x, y) / n).backward()      # no gradient collective
    (step(*microbatches[-1]) / n).backward()  # reduces what the window held, once

`piper_fx.set_requires_gradient_sync(model, False)` (FSDP2's method of that name)
turns synchronization off until it is turned on again; `no_sync` does so for a
`with` block. Either way, while it is off, each call's step runs a program planned
without gradient reductions (`passes.reduce_gradients`, `Strategy.gradient_sync`
False) and holds every parameter's gradient of this replica's rows whole,
unreduced, scaled by the loss's incoming gradient and summed over the calls, in
the model's `SyncWindow`. The parameters' `.grad` do not change meanwhile: they
are DTensors whose placement states what every replica holds (a `Replicate()`
gradient is the same on every rank), which a replica's own gradient is not, so
they are held apart, as FSDP2 holds its unsharded gradients. The first call with
synchronization on runs that program too, adds its own, and reduces everything
held in one pass of bucketed collectives, the strategy's (`runtime.held_gradients`):
the parameters then get what one call on the window's batches would give them,
and the collectives of the window's other calls are saved. ZeRO-3 still gathers
its parameters in every call (FSDP2 too, without `reshard_after_backward=False`).
A backward holds the gradients it accumulates: `backward(inputs=...)` those of the
parameters it names; `torch.autograd.grad`, which accumulates none, is refused inside
a window (nothing is handed back before its end), and after one gets its own call's
gradients, reduced, leaving what is held for the next `backward()`
(`runtime.held_gradients.held_until_synced`).

Every rank of a data-parallel group must turn synchronization off and on at the
same calls, as with DDP and FSDP2, and on the model it compiled (or its compiled
wrapper). A step finds its model's window from one of the model's parameters,
whichever compiled frame or batch shape runs them (so a window set on a submodule
alone is not its model's); a model whose synchronization was never turned off
pays nothing for this. With expert parallelism (ep > 1) a block of experts' gradient
is summed over its ep group's tokens in every call, as without a window (that is
the experts' computation, not their synchronization), and averaged over the ranks
holding the same block at the window's end.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterator

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .errors import PiperError
from .options import Strategy
from .sharding.dtensor_params import parameter_records, stood_for


class SyncWindow:
    """A model's gradient synchronization: whether it is on, and the gradients its steps hold
    while it is off (by parameter, each this replica's whole, unreduced gradient)."""

    __slots__ = ("requires_sync", "held", "__weakref__")

    def __init__(self) -> None:
        self.requires_sync = True
        self.held: WeakIdKeyDictionary = WeakIdKeyDictionary()

    @property
    def unsynced(self) -> bool:
        """Whether the model's next call runs the program without reductions: while
        synchronization is off, and at the first call after, which reduces what is held."""
        return not self.requires_sync or len(self.held) > 0

    def hold(self, parameter: torch.Tensor, grad: torch.Tensor) -> None:
        """Add `grad` (the step's own tensor, kept as it is the first time) to what is held
        for `parameter`."""
        held = self.held.get(parameter)
        if held is None:
            self.held[parameter] = grad
        else:
            held.add_(grad)

    def take(self, parameter: torch.Tensor) -> torch.Tensor | None:
        """What is held for `parameter`, no longer held."""
        return self.held.pop(parameter, None)


def unsynced(strategy: Strategy) -> Strategy:
    """`strategy` planned without gradient reductions, for the calls of a window."""
    return replace(strategy, gradient_sync=False)


# Each parameter of a model whose synchronization was set -> the model's window.
_WINDOWS = parameter_records()


def window_of(parameter: torch.Tensor) -> SyncWindow | None:
    """The window of the model `parameter` (or the program placeholder standing for it)
    belongs to, if its synchronization was ever set."""
    return _WINDOWS.get(stood_for(parameter)) if len(_WINDOWS) else None


def _window(model: nn.Module) -> SyncWindow:
    if not isinstance(model, nn.Module):
        raise PiperError(f"gradient synchronization is set on a model (an nn.Module, compiled or not), "
                         f"not a {type(model).__name__}")
    parameters = list(model.parameters())
    if not parameters:
        raise PiperError(f"the {type(model).__name__} has no parameters whose gradient synchronization to set")
    windows = {id(w): w for w in (_WINDOWS.get(p) for p in parameters) if w is not None}
    window = next(iter(windows.values())) if len(windows) == 1 else SyncWindow()
    if len(windows) > 1:  # parts set before one by one: the model's is now one window
        window.requires_sync = all(other.requires_sync for other in windows.values())
        for other in windows.values():
            for parameter, grad in other.held.items():
                window.hold(parameter, grad)
    for parameter in parameters:
        _WINDOWS[parameter] = window
    return window


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn `model`'s gradient synchronization off (False) or on again (True), as FSDP2's
    `FSDPModule.set_requires_gradient_sync`: while it is off, each call holds its gradients
    unreduced, and the first call with it on reduces them all (module docstring)."""
    if not isinstance(requires_gradient_sync, bool):
        raise PiperError(f"requires_gradient_sync is a bool, not {requires_gradient_sync!r}")
    _window(model).requires_sync = requires_gradient_sync


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """A block of calls of `model` whose gradients are held unreduced, as under DDP's
    `no_sync()`: the first call after the block reduces them with its own (module docstring)."""
    window = _window(model)
    before, window.requires_sync = window.requires_sync, False
    try:
        yield
    finally:
        window.requires_sync = before
