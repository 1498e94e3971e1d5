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
unreduced, scaled by the loss's incoming gradient and summed over the calls, by
parameter (`hold`). The parameters' `.grad` do not change meanwhile: they
are DTensors whose placement states what every replica holds (a `Replicate()`
gradient is the same on every rank), which a replica's own gradient is not, so
they are held apart, as FSDP2 holds its unsharded gradients. The first call with
synchronization on reduces what was held with its own, the strategy's collectives, so
the parameters then get what one call on the window's batches would give them, and
the collectives of the window's other calls are saved. Where the strategy allows it
(`passes.reduce_gradients.reduces_held_gradients`: no pipeline, no experts) that call
runs a program of its own (`after_window`), taking each parameter's held gradient as an
input and adding it to the call's right before its reduction, so the window's
reductions overlap the call's backward, as DDP's reducer overlaps those of the `.grad`
its window accumulated; elsewhere it runs the program without reductions, adds its own,
and reduces everything held after it in one pass of bucketed collectives
(`runtime.held_gradients`). ZeRO-3 still gathers its parameters in every call (FSDP2
too, without `reshard_after_backward=False`). A backward holds the gradients it
accumulates: `backward(inputs=...)` those of the parameters it names;
`torch.autograd.grad`, which accumulates none, is refused inside a window (nothing is
handed back before its end), and after one gets its own call's gradients, reduced,
leaving what is held for the next `backward()` (`runtime.held_gradients`).

Synchronization is each parameter's, as FSDP2's is each module's: set on a submodule, it
holds the gradients of that submodule's parameters alone, and the model's others are
reduced at every call as before. While any parameter a call reads has it off, the call
runs the program without reductions, and the parameters whose synchronization is on are
reduced after it (with what they held), not overlapped with its backward. `no_sync` puts
each parameter's setting back as it found it, as DDP's puts its module's back. Every
rank of a data-parallel group must turn synchronization off and on at the same calls,
for the same parameters, as with DDP and FSDP2; a model whose synchronization was never
turned off pays nothing for this. With expert parallelism (ep > 1) a block of experts'
gradient is summed over its ep group's tokens in every call, as without a window (that
is the experts' computation, not their synchronization), and averaged over the ranks
holding the same block at the window's end.
"""
from __future__ import annotations

import contextlib
from dataclasses import replace
from typing import Iterable, Iterator

import torch
from torch import nn

from .errors import PiperError
from .options import Strategy
from .sharding.dtensor_params import parameter_records, stood_for


def unsynced(strategy: Strategy) -> Strategy:
    """`strategy` planned without gradient reductions, for the calls of a window."""
    return replace(strategy, gradient_sync=False)


def after_window(strategy: Strategy) -> Strategy:
    """`strategy` planned to reduce a window's held gradients with a call's own, for the first
    call after the window (`passes.reduce_gradients.reduces_held_gradients` must allow it)."""
    return replace(strategy, adds_held_gradients=True)


# By the parameter, never its program placeholder, and empty unless a window was opened: the
# parameters whose gradient synchronization is off (-> True); those whose gradients a window
# holds (-> True), on every rank alike, whichever ranks compute them (under a pipeline, the
# ranks of their stage), so that every rank chooses the same program at each call; and the
# gradients this rank holds (-> this replica's whole, unreduced gradient, summed over the
# window's calls).
_OFF = parameter_records()
_PENDING = parameter_records()
_HELD = parameter_records()
_SEED = parameter_records()  # the loss seed of the latest call whose gradient was held (None: 1)
_DIVIDED = parameter_records()  # held gradients a program read divided by their seed (`divided`)


def requires_sync(parameter: torch.Tensor) -> bool:
    """Whether `parameter`'s (or its program placeholder's) gradient synchronization is on."""
    return not _OFF or stood_for(parameter) not in _OFF


def window_state(parameters: Iterable[torch.Tensor]) -> str | None:
    """Where a call reading `parameters` (or their placeholders) stands in a window, the same on
    every rank: "off" where the synchronization of any is off, "held" where it is on for all
    and a window holds gradients of some (the window's first call after it), None otherwise."""
    if not _OFF and not _PENDING:
        return None
    parameters = list(map(stood_for, parameters))
    if any(p in _OFF for p in parameters):
        return "off"
    return "held" if any(p in _PENDING for p in parameters) else None


def set_pending(parameter: torch.Tensor, pending: bool) -> None:
    """Record that a window holds gradients of `parameter` (`pending`), or no longer does: at
    each backward, on every rank, whether it holds them itself or not."""
    if pending:
        _PENDING[parameter] = True
    elif _PENDING:
        _PENDING.pop(parameter, None)


def hold(parameter: torch.Tensor, grad: torch.Tensor, seed: torch.Tensor | None) -> None:
    """Add `grad` (the step's own tensor, kept as it is the first time), scaled by its call's
    loss `seed` (None: by 1), to what is held for `parameter`, which keeps that seed as the
    window's latest."""
    held = _whole(parameter)
    if held is None:
        _HELD[parameter] = grad
    else:
        held.add_(grad)
    _SEED[parameter] = seed


def _whole(parameter: torch.Tensor) -> torch.Tensor | None:
    """What is held for `parameter`, scaled back in place where a program read it `divided`."""
    held = _HELD.get(parameter)
    if held is not None and _DIVIDED.pop(parameter, None):
        held.mul_(_SEED[parameter])
    return held


def take(parameter: torch.Tensor) -> torch.Tensor | None:
    """What is held for `parameter`, no longer held; None where nothing is."""
    held = _whole(parameter)
    release(parameter)
    return held


def divided(parameter: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """What is held for `parameter`, divided in place by the loss seed of the latest call that
    added to it, and that seed (None: 1): as the program of a window's first call after it reads
    it (`runtime.held_gradients.take_into_program`). It stays held, scaled back where it is
    added to or taken, until `release`d; None where nothing is held."""
    held = _HELD.get(parameter)
    if held is None:
        return None
    seed = _SEED.get(parameter)
    if seed is not None and not _DIVIDED.get(parameter):
        held.div_(seed)
        _DIVIDED[parameter] = True
    return held, seed


def release(parameter: torch.Tensor) -> None:
    """Hold nothing more for `parameter`."""
    for records in (_HELD, _SEED, _DIVIDED):
        records.pop(parameter, None)


def held_gradients(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """The gradients held for `parameters`."""
    if not _HELD:
        return []
    return [grad for grad in map(_HELD.get, parameters) if grad is not None]


def _parameters(model: nn.Module) -> list[nn.Parameter]:
    if not isinstance(model, nn.Module):
        raise PiperError(f"gradient synchronization is set on a model (an nn.Module, compiled or not), "
                         f"not a {type(model).__name__}")
    parameters = list(model.parameters())
    if not parameters:
        raise PiperError(f"the {type(model).__name__} has no parameters whose gradient synchronization to set")
    return parameters


def _set(parameters: Iterable[nn.Parameter], on: bool) -> None:
    for parameter in parameters:
        if on:
            _OFF.pop(parameter, None)
        else:
            _OFF[parameter] = True


def set_requires_gradient_sync(model: nn.Module, requires_gradient_sync: bool) -> None:
    """Turn the gradient synchronization of `model`'s parameters (its submodules' included) off
    (False) or on again (True), as FSDP2's `FSDPModule.set_requires_gradient_sync`: while it is
    off, each call holds their gradients unreduced, and the first call with it on reduces them
    all (module docstring)."""
    if not isinstance(requires_gradient_sync, bool):
        raise PiperError(f"requires_gradient_sync is a bool, not {requires_gradient_sync!r}")
    _set(_parameters(model), requires_gradient_sync)


@contextlib.contextmanager
def no_sync(model: nn.Module) -> Iterator[None]:
    """A block of calls of `model` whose gradients are held unreduced, as under DDP's
    `no_sync()`: the first call after the block reduces them with its own (module docstring).
    Each parameter's synchronization is put back after as it was before."""
    parameters = _parameters(model)
    was_on = [requires_sync(p) for p in parameters]
    _set(parameters, False)
    try:
        yield
    finally:
        _set((p for p, on in zip(parameters, was_on) if on), True)
