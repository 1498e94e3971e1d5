"""How a module holding parameters `prepare` laid out reads, converts and copies them.

Reading `module.<name>` goes through a property of a subclass of the module's
class made for that module alone (as SimpleFSDP does, `read_through`): under
`torch.compile` the parameter's program placeholder (`dtensor_params`), which
Dynamo traces and guards as a plain tensor; eagerly a replicated parameter's
local tensor, and a sharded one's `DTensor` outside a forward (as FSDP2's) or
its full tensor, gathered, inside one (`gathers_in_eager_forward`). The same
class converts the module (`_apply`: `to_empty` materializes a model laid out
on the meta device in place, any other move of a laid-out parameter is
refused) and copies it (`copy.deepcopy`, pickling). `replicate_parameters`
and `trace_in_dtype` lay out what they lay out through it.
"""
from __future__ import annotations

import copy
import inspect
import threading
import types
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ..compat import dtensor_like, local_tensor
from ..errors import PiperError
from .dtensor_params import (mark_replicated, materialize, parameter_owners, placeholder_name, program_placeholder,
                             program_tensor)


def replicate_parameters(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make every plain-tensor parameter of `model` a `Replicate()` DTensor parameter on the
    1-D `mesh` (the strategy mesh's "dp"), in place, sharing the original's storage;
    reads of the module attribute give its local tensor. Parameters already DTensors
    (ZeRO shards, blocks of experts) are left as they are; tied ones stay tied."""
    for original, holders in parameter_owners(model, skip=lambda p: isinstance(p, DTensor)):
        value = DTensor.from_local(original.detach(), mesh, [Replicate()], run_check=False)
        parameter = nn.Parameter(value, requires_grad=original.requires_grad)
        mark_replicated(parameter)
        placeholder = program_placeholder(parameter, holders[0][0])
        for _, module, name in holders:
            module._parameters[name] = parameter
            read_through(module, name, placeholder)


def trace_in_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Make Dynamo trace every floating parameter of `model` in `dtype` (mixed precision's
    `param_dtype`), as FSDP2 runs the model with its parameters cast: a model that reads a
    parameter's or an activation's dtype to choose one (Hugging Face's RMSNorm casting back
    to its input's dtype, rotary tables cast to the query's) then chooses `dtype`, where
    Dynamo tracing the fp32 parameters baked float32 into the graph. Each parameter's
    program placeholder is made in `dtype` (a plain parameter gets one, read through as
    DTensor parameters are, `read_through`); the piper backend stands the parameter in,
    read cast to `dtype` (`capture`), so the program computes with its values."""
    for parameter, holders in parameter_owners(model, skip=lambda p: not p.is_floating_point() or p.dtype == dtype):
        placeholder = program_placeholder(parameter, holders[0][0], dtype)
        for _, module, name in holders:
            placeholders = module.__dict__.get(_PLACEHOLDERS)
            if placeholders is not None and name in placeholders:  # read through already: its gather stays
                placeholders[name] = placeholder
            else:
                read_through(module, name, placeholder)


_OWN_CLASS = "_piper_reads_through"  # marks the class `read_through` made for one module
_PLACEHOLDERS = "_piper_program_placeholders"  # a module's placeholders by parameter name (a plain dict)


def read_through(module: nn.Module, name: str, placeholder: nn.Parameter,
                 gather: tuple[torch._ops.OpOverload, list[int], str] | None = None) -> None:
    """Make reading `module.<name>` return the parameter's local tensor eagerly (a plain
    parameter itself), and its `program_placeholder` under `torch.compile`, the parameter
    staying registered under `name` (so `named_parameters` and `state_dict` keep their
    keys). With `gather`, a marker op (`piper::unshard`, `piper::unshard_experts`), the full
    shape and the group name it takes, the read is the parameter's `DTensor` itself, as
    FSDP2's is outside a forward (so a write, `weight.zero_()` or `nn.init.normal_(weight)`,
    reaches this rank's rows), and inside an eager forward (`gathers_in_eager_forward`) the
    op's of its local rows: the full tensor, gathered.

    A property on a subclass of the module's class made for this module alone (its
    `__class__` is swapped once). The module keeps its placeholders in a plain dict, which
    Dynamo traces as a module's own attribute (a dict subclass, traced as a user object,
    made its trace slower than the DTensors' had been). A parameter registered anew
    under `name` (e.g. `load_state_dict(..., assign=True)`) drops its placeholder and the
    property (`_register_parameter`): the new one is read itself. A copy of the module
    (`copy.deepcopy`) gets the placeholders of its own parameters, not copies of the original's.

    The property's getter is written for its name and read (`_getter`): Dynamo guards a
    getter it traces by its code, and by every closure cell it reads, a dozen guards a
    parameter for a closure over the name and a read function (639 of the 1531 lines of
    guards of a GPT of 4 blocks under ZeRO-0, all checked before every call).
    """
    cls = _own_class(module)
    module.__dict__[_PLACEHOLDERS][name] = placeholder
    setattr(cls, name, property(_getter(name, gather, isinstance(module._parameters[name], DTensor))))
    if gather is not None:
        gathers_in_eager_forward(module)


def _own_class(module: nn.Module) -> type:
    """The subclass of `module`'s class made for it alone (made and swapped in on the first call)."""
    cls = type(module)
    if not getattr(cls, _OWN_CLASS, False):
        cls = type(cls.__name__, (cls,), {_OWN_CLASS: True, "__module__": cls.__module__,
                                          "register_parameter": _register_parameter, "_apply": _apply,
                                          "__getstate__": _getstate, "__setstate__": _setstate,
                                          "__deepcopy__": _deepcopy})
        module.__class__ = cls
        module.__dict__[_PLACEHOLDERS] = {}
    return cls


class _EagerForwards(threading.local):
    """How many forwards of modules `gathers_in_eager_forward` marked are running eagerly on
    this thread: while any is, a sharded parameter's read gives the full tensor, gathered."""

    depth = 0


_EAGER_FORWARDS = _EagerForwards()


def gathers_in_eager_forward(module: nn.Module) -> None:
    """Make `module`'s forward, run eagerly, read every sharded parameter as its full tensor
    (gathered by its marker op's collective, every rank of the group running it, as FSDP2's
    pre-forward all-gather): `prepare` marks the model itself and every module holding a
    sharded parameter, so the model, or any of those modules called alone, runs as a plain
    module, while outside a forward the parameter reads as its `DTensor`. Under
    `torch.compile` the forward is the module's own, its reads the program placeholders.

    The forward is a copy of `_forward_gathering` for this module's class (no closure, so
    Dynamo guards its code alone), signed as the class's own forward (`inspect.signature`,
    which Hugging Face's `generate` reads to choose the arguments it passes). It calls the
    class's forward (as it was when `prepare` ran) through a keyword-only default of its own,
    whose code Dynamo guards (one check), where finding it through `type(self).__mro__` at
    each call was four checks (the MRO's type and length, the base class, its forward's code)
    for every module a forward runs (a GPT of 2 blocks under ZeRO-3: 737 lines of guards,
    against 793)."""
    cls = _own_class(module)
    if "forward" in cls.__dict__:
        return
    base = cls.__mro__[1].forward
    forward = types.FunctionType(_forward_gathering.__code__, _forward_gathering.__globals__, "forward")
    forward.__kwdefaults__ = {"_piper_forward": base}
    forward.__qualname__ = f"{cls.__qualname__}.forward"
    forward.__doc__, forward.__wrapped__ = base.__doc__, base
    forward.__signature__ = inspect.signature(base)
    cls.forward = forward


def _forward_gathering(self, *args, _piper_forward=None, **kwargs):
    if torch.compiler.is_compiling():
        return _piper_forward(self, *args, **kwargs)
    _EAGER_FORWARDS.depth += 1
    try:
        return _piper_forward(self, *args, **kwargs)
    finally:
        _EAGER_FORWARDS.depth -= 1


# `read_through`'s getters, by their source: written as dataclasses write their methods, their
# name, op, shape and group constants of their code, which reads nothing else but this module's
# globals. `_piper_program_placeholders` is `_PLACEHOLDERS`, spelled out for Dynamo to trace.
# The property goes with its placeholder (`_register_parameter`), so a compiled read does not
# ask whether the placeholder is there: Dynamo traced `name in dict` into a guard checked at
# every call, one a parameter (29 of a GPT's 671 lines of guards), and Dynamo's trace of a GPT
# of 12 blocks took 1.47 s (ZeRO-0) and 2.53 s (ZeRO-3), medians, against 1.34 and 2.34 without.
# An eager read still asks, at no cost worth naming.
_GETTER_SOURCE = """def get(self):
    if torch.compiler.is_compiling():
        return {compiled}
    if {name!r} in self._piper_program_placeholders:
        return {eager}
    return self._parameters[{name!r}]
"""
_GETTERS: dict[str, Callable] = {}


def _getter(name: str, gather: tuple[torch._ops.OpOverload, list[int], str] | None, distributed: bool) -> Callable:
    def read(tensor: str) -> str:
        if gather is None:
            return tensor
        op, full_shape, group_name = gather  # `str(op)`: "piper.unshard.default"
        return f"torch.ops.{op}({tensor}, {[int(size) for size in full_shape]!r}, {group_name!r})"

    parameter = f"self._parameters[{name!r}]"
    local = parameter + (".to_local()" if distributed else "")
    eager = local if gather is None else f"{read(local)} if _EAGER_FORWARDS.depth else {parameter}"
    source = _GETTER_SOURCE.format(name=name, compiled=read(f"self._piper_program_placeholders[{name!r}]"),
                                   eager=eager)
    getter = _GETTERS.get(source)
    if getter is None:
        namespace: dict = {}
        exec(compile(source, f"<piper_fx getter of {name}>", "exec"), globals(), namespace)
        getter = _GETTERS[source] = namespace["get"]
    return getter


def _register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
    """A parameter registered anew under `name` is read as it is: its placeholder dropped, and
    the property reading it, from a class of this module's own (copies share the class)."""
    if self.__dict__[_PLACEHOLDERS].pop(name, None) is not None and name in type(self).__dict__:
        cls = type(self)
        kept = {key: value for key, value in cls.__dict__.items() if key not in (name, "__dict__", "__weakref__")}
        self.__class__ = type(cls.__name__, cls.__bases__, kept)
    type(self).__mro__[1].register_parameter(self, name, param)  # the module's own class


def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
    """`nn.Module._apply` (what `to`, `to_empty`, `cuda`, `float` and the like run) for a module
    holding parameters `prepare` laid out. A parameter laid out on the meta device (the model
    built under `torch.device("meta")`, as for FSDP2) is materialized in place where `fn` makes
    its memory (`to_empty(device=...)`, `dtensor_params.materialize`). Any other conversion that leaves each
    laid-out parameter as it is (to the device and dtype it has) converts the rest (buffers,
    other parameters, children); one that would make any of them anew is a `PiperError` naming
    it, before this module changed. A laid-out parameter's memory is shared by what the step
    reads (its padded rows, its program placeholder), which a new tensor would leave behind;
    PyTorch's own swap of a DTensor parameter's contents refuses it anyway ("Couldn't swap"),
    for the references kept of it."""
    placeholders = self.__dict__[_PLACEHOLDERS]
    made: dict[str, torch.Tensor] = {}  # each meta parameter's new program tensor
    for name, placeholder in placeholders.items():
        parameter = self._parameters.get(name)
        if parameter is None or (placeholder.is_meta and not parameter.is_meta):
            continue  # dropped, or materialized by another module holding it (tied)
        if parameter.is_meta:
            program = program_tensor(parameter)
            made[name] = fn(program)
            if not made[name].is_meta and (made[name].shape, made[name].dtype) == (program.shape, program.dtype):
                continue
        elif fn(parameter) is parameter:
            continue
        raise PiperError(
            f"piper_fx: parameter {placeholder_name(placeholder)} cannot be moved or converted after "
            "piper_fx.prepare laid it out (its shard, padding and the compiled step's view of its memory "
            "are made for the tensor prepare was given): move or convert the model (.to, .cuda, .float, "
            "...) before prepare; a model built on the meta device is materialized by to_empty")
    for name, program in made.items():
        if self._parameters[name].is_meta:  # not under a name before it in this module
            materialize(self._parameters[name], program, placeholders[name])
    for name, placeholder in placeholders.items():
        parameter = self._parameters.get(name)
        if parameter is not None and placeholder.is_meta and not parameter.is_meta:
            placeholders[name] = program_placeholder(parameter, placeholder_name(placeholder), placeholder.dtype)
    tied = [[(module, name) for _, module, name in holders]
            for _, holders in parameter_owners(self, skip=lambda p: False) if len(holders) > 1]
    order = list(self._parameters)
    laid_out = {name: self._parameters.pop(name) for name in placeholders if name in self._parameters}
    try:
        converted = type(self).__mro__[1]._apply(self, fn, recurse)
    finally:  # the laid-out parameters back among the others, as `_apply` left those, in their order
        others = dict(self._parameters)
        self._parameters.clear()
        self._parameters.update((name, laid_out[name] if name in laid_out else others[name]) for name in order)
    # PyTorch's `_apply` makes a parameter it cannot convert in place (a plain one on the meta
    # device, given memory by `to_empty`) anew in each module holding it: tied ones are one again.
    for (module, name), *others in tied:
        for other, other_name in others:
            other._parameters[other_name] = module._parameters[name]
    if _refuse_parameters_on_meta in self._forward_pre_hooks.values() and not any(p.is_meta for p in self.parameters()):
        _stop_refusing_parameters_on_meta(self)  # materialized (`laid_out_on_meta`)
    return converted


def laid_out_on_meta(model: nn.Module) -> None:
    """For a model `prepare` laid out on the meta device (built under `torch.device("meta")`, as
    for FSDP2): have `model.to_empty(...)` (any `_apply`) keep its tied parameters tied, as it
    keeps those `prepare` laid out (`dtensor_params.materialize`) and FSDP2 its own (PyTorch
    would make each plain meta parameter, all of them at dp = 1, anew in every module holding
    it); and until no parameter is left on the meta device, have a call of the model raise a
    `PiperError` naming them, as FSDP2's first forward does, where Dynamo's fake tensors would
    stop at the first op mixing devices ("Tensor device mismatch"). Materializing the model
    removes that check (`_apply`), so the compiled model traces no hook of piper_fx's."""
    _own_class(model)
    model.register_forward_pre_hook(_refuse_parameters_on_meta)


@torch.compiler.disable
def _refuse_parameters_on_meta(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook of a model `laid_out_on_meta`, run outside Dynamo: a `PiperError` naming
    the parameters still on the meta device; once none is, it removes itself."""
    on_meta = [name for name, p in module.named_parameters() if p.is_meta]
    if on_meta:
        named = f"{on_meta[:8]}" + (f" and {len(on_meta) - 8} more" if len(on_meta) > 8 else "")
        raise PiperError(
            f"piper_fx: the model's parameters should be materialized from the meta device before "
            f"training, but these are still on it: {named}. Call model.to_empty(device=...) after "
            "piper_fx.prepare, then initialise them (reset_parameters(), or load a state dict with "
            "torch.distributed.checkpoint.state_dict.set_model_state_dict)")
    _stop_refusing_parameters_on_meta(module)


def _stop_refusing_parameters_on_meta(module: nn.Module) -> None:
    for key, hook in list(module._forward_pre_hooks.items()):
        if hook is _refuse_parameters_on_meta:
            del module._forward_pre_hooks[key]


def _getstate(self: nn.Module) -> dict:
    state = type(self).__mro__[1].__getstate__(self)
    # Not the placeholders, which stand for these very parameters: their names and dtypes, to
    # make those of the parameters the state's new module holds.
    state[_PLACEHOLDERS] = {name: (placeholder_name(p), p.dtype) for name, p in state[_PLACEHOLDERS].items()}
    return state


def _deepcopy(self: nn.Module, memo: dict) -> nn.Module:
    """`copy.deepcopy(self)`, as Python copies a module (a new object of its class given a deep
    copy of its `__getstate__`), with each of its parameters' gradients that is a DTensor over
    a view at an offset into a larger tensor copied first, into `memo`. The step hands
    gradients over as views into their reduction's flat bucket (as FSDP2's sharded gradients
    are views into its reduce-scatter's output), and torch's `Tensor.__deepcopy__` takes such
    a DTensor for one with a storage of its own and fails ("Attempted to call copy_() on an
    invalid python storage", torch 2.13), so a model holding a step's gradients could not be
    copied (an EMA copy, say)."""
    for parameter in self._parameters.values():
        grad = None if parameter is None else parameter.grad
        if isinstance(grad, DTensor) and grad.storage_offset() != 0 and id(grad) not in memo:
            memo[id(grad)] = dtensor_like(local_tensor(grad).clone(), grad)
    copied = type(self).__new__(type(self))
    memo[id(self)] = copied
    copied.__setstate__(copy.deepcopy(self.__getstate__(), memo))
    return copied


def _setstate(self: nn.Module, state: dict) -> None:
    made = state.pop(_PLACEHOLDERS, {})
    type(self).__mro__[1].__setstate__(self, state)
    self.__dict__[_PLACEHOLDERS] = {name: program_placeholder(self._parameters[name], fqn, dtype)
                                    for name, (fqn, dtype) in made.items()}
