"""A fused optimizer step over piper_fx's DTensor parameters, run on their local tensors.

A stock optimizer built with `fused=True` (torchtitan's AdamW) steps every
parameter in one call of a fused op, `aten._fused_adamw_` (or `_fused_adam_`),
whose tensor lists hold, index by index, a parameter, its gradient and its states.
Over DTensors, DTensor's dispatch of that call costs more than the kernel
does on a model of small tensors: the optimizer keeps each `step` as a plain
scalar tensor, which DTensor replicates implicitly by making a spec for each
one on every call, and it hashes the call's hundreds of specs. Measured on
this project's CPU machine, one process, the example GPT of 4 blocks of width
128 (52 parameters) and fused AdamW: a step took 0.43 ms over plain tensors,
1.02 ms over the same parameters as ZeRO-0's `Replicate()` DTensors through
DTensor's dispatch and 0.61 ms with this; as ZeRO-3's `Shard(0)` rows of 2
ranks, 0.30, 0.87 and 0.47 ms (`python benchmarks/step_split.py` shows it in
a training step).

Each of these ops is elementwise within an index. Where a parameter, its
gradient and its states share the parameter's mesh and placements, none of
them `Partial` (as the hand-over, `accumulate_grad`, and the optimizer's
`zeros_like` states make them), DTensor's sharding propagation moves nothing
and runs the kernel on the local tensors; the handler installed here does the
same directly. The `step` states and a tensor learning rate or gradient
scale are scalars, plain or replicated. Any other call (another placement at
some index, a `Partial` gradient, a plain tensor among the parameter-shaped
lists, parameters piper_fx did not lay out, e.g. FSDP2's in the same process)
goes through DTensor's own dispatch unchanged.
"""
from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..compat import dtensor_dispatch, dtensor_op_handlers, local_tensor
from .holdings import has_holding

# The optimizers' fused in-place ops that DTensor has a sharding strategy for (it refuses fused SGD
# and Adagrad, and so do these), and in each the positions of its tensor lists shaped like the
# parameters: every tensor list but the `step` states (scalars), read off the op's schema.
_FUSED_OPTIMIZER_OPS = ("_fused_adam_", "_fused_adamw_")


def _parameter_shaped_lists(op: torch._ops.OpOverload) -> frozenset[int]:
    return frozenset(i for i, argument in enumerate(op._schema.arguments)
                     if isinstance(argument.type, torch.ListType) and argument.name != "state_steps")


_PARAMETER_SHAPED: dict[torch._ops.OpOverload, frozenset[int]] = {
    overload: _parameter_shaped_lists(overload)
    for packet in (getattr(torch.ops.aten, name, None) for name in _FUSED_OPTIMIZER_OPS) if packet is not None
    for overload in (getattr(packet, name) for name in packet.overloads())
}


def step_fused_optimizers_on_local_tensors() -> None:
    """Route DTensor's dispatch of the fused optimizer ops through `_on_local_tensors`, once per
    process (a handler someone else installed for an op is left in place)."""
    handlers = dtensor_op_handlers()
    for op in _PARAMETER_SHAPED:
        handlers.setdefault(op, _on_local_tensors)


def _on_local_tensors(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """DTensor's handler of a fused optimizer op: the op on the local tensors where that is
    what DTensor's dispatch would run (`_local_arguments`), else DTensor's dispatch."""
    local = _local_arguments(op, args, kwargs)
    if local is None:
        return dtensor_dispatch(op, args, kwargs)
    return op(*local[0], **local[1])


def _local_arguments(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[list, dict] | None:
    """`args` and `kwargs` with every DTensor replaced by its local tensor, or None where the
    call is not one this module runs: parameters piper_fx laid out, each index's tensors of the
    parameter's mesh and placements (none `Partial`), and the scalars plain or replicated."""
    params = args[0]
    if not params or not isinstance(params[0], DTensor) or not has_holding(params[0]):
        return None
    try:
        specs = [_spec(param) for param in params]
        shaped = _PARAMETER_SHAPED[op]
        local_args = [_like_parameters(arg, specs) if position in shaped
                      else [_scalar(tensor) for tensor in arg] if isinstance(arg, (list, tuple))  # `step`s
                      else _scalar(arg)
                      for position, arg in enumerate(args)]
        return local_args, {name: _scalar(value) for name, value in kwargs.items()}
    except _NotLocal:
        return None


class _NotLocal(Exception):
    """An argument of a call that DTensor's own dispatch runs."""


def _spec(param: object):
    """A parameter's spec, which every tensor of its index shares: its placements none `Partial`."""
    if not isinstance(param, DTensor):
        raise _NotLocal
    spec = param._spec
    if not _without_partial(spec.placements):
        raise _NotLocal
    return spec


# Placements found without `Partial`, by identity: a parameter's spec, and so its placements, is
# the same object step after step (checking them anew costs a microsecond a parameter).
_WITHOUT_PARTIAL: dict[int, tuple] = {}


def _without_partial(placements: tuple) -> bool:
    if _WITHOUT_PARTIAL.get(id(placements)) is placements:
        return True
    if any(placement.is_partial() for placement in placements):
        return False
    if len(_WITHOUT_PARTIAL) > 4096:  # placements of parameters long gone
        _WITHOUT_PARTIAL.clear()
    _WITHOUT_PARTIAL[id(placements)] = placements
    return True


def _like_parameters(tensors: list, specs: list) -> list:
    """The local tensors of a list shaped like the parameters: each a DTensor of its
    parameter's mesh and placements. Empty where the optimizer keeps none (no
    `max_exp_avg_sqs` without amsgrad)."""
    if not tensors:
        return tensors
    if len(tensors) != len(specs):
        raise _NotLocal
    local = []
    for tensor, spec in zip(tensors, specs):
        if not isinstance(tensor, DTensor):
            raise _NotLocal
        own = tensor._spec
        if own is not spec and (
                (own.mesh is not spec.mesh and own.mesh != spec.mesh)
                or (own.placements is not spec.placements and own.placements != spec.placements)):
            raise _NotLocal
        local.append(local_tensor(tensor))
    return local


def _scalar(value: object) -> object:
    """A scalar argument (a `step`, a tensor learning rate, a gradient scale) as the kernel takes
    it: a plain tensor or number itself, a replicated DTensor's local tensor."""
    if not isinstance(value, DTensor):
        return value
    if not all(placement.is_replicate() for placement in value._spec.placements):
        raise _NotLocal
    return local_tensor(value)
