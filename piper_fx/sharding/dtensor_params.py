"""Parameters as DTensors: how `prepare` holds a parameter, and how the program reads it.

A parameter that `prepare` shards (a ZeRO shard over dp, a block of experts
over ep) becomes an `nn.Parameter` holding a `DTensor` placed `Shard(0)` on
the group's mesh, with DTensor's uneven split (rank i holds rows
[i*ceil(R/n), ...), the last ranks fewer or none). So a stock optimizer built
afterwards keeps DTensor state of this rank's rows, as with FSDP2, and
PyTorch's `state_dict`, `torch.distributed.checkpoint` and
`clip_grad_norm_` see the parameter's real placement.

The module keeps the parameter under its own name (`state_dict()` keys are
the model's); reading the attribute goes through a property of a subclass of
the module's class made for that module (as SimpleFSDP does,
`read_through`). Run eagerly, the read gives a replicated parameter's local
tensor; a sharded one's outside a forward is the DTensor itself, as FSDP2's is
(a write into it reaches the rows), and inside an eager forward
(`gathers_in_eager_forward`) the full tensor, its local rows turned into it by
a marker op (`piper::unshard`, `piper::unshard_experts`) whose eager kernel
gathers them.

Under `torch.compile`, Dynamo never sees the DTensor: the read gives the
parameter's *program placeholder* instead (`program_placeholder`), a plain
`nn.Parameter` sharing the storage of the tensor the program computes with
(`program_tensor`: the plain padded rows, every rank's piece of the same size,
as the all-gathers need), through the same marker. Dynamo traces and guards a
plain tensor, as it would an unsharded model's parameter, in C++ and with no
guard on a placement (whose Python guards on DTensors the backend had to
remove from Dynamo's internals). The compiled step then
stands each placeholder's parameter in for it (`stood_for`): the program reads
the parameter's current program tensor and hands its gradient to the
parameter. Each padded row buffer is kept with its parameter, the DTensor's
local tensor a view of its first rows, so the program reads the very storage
the optimizer updates.

With mixed precision, every floating parameter's placeholder is in `param_dtype`
(`trace_in_dtype`; a plain parameter, at dp = 1, gets one too), its bytes the first
of its program tensor's: Dynamo traces the model as FSDP2 runs it, its parameters
cast, so the dtypes a model reads to choose one (an activation's, a parameter's)
are `param_dtype`, and the step reads the parameter cast to it (`capture`).

Every other parameter (all of them at ZeRO-0, 0-d ones at any level, those
that are not experts under ep) is a whole replica over dp: `prepare` makes it
a `Replicate()` DTensor on the dp mesh sharing the original's storage
(`replicate_parameters`), read as its local tensor, which is the program's
tensor. Its gradient is handed back as a `Replicate()` DTensor too, so the
optimizer, `state_dict` and `clip_grad_norm_` see every parameter's placement.
"""
from __future__ import annotations

import inspect
import threading
import types
import weakref
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from ..compat import dtensor_like, local_tensor
from ..errors import PiperError
from .replicas import mark_unsynchronized


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


# What piper_fx records of a parameter, by the parameter (weakly; `parameter_records`).
_PARAMETER_RECORDS: list[WeakIdKeyDictionary] = []


def parameter_records() -> WeakIdKeyDictionary:
    """A new dictionary of what piper_fx records of each parameter, keyed by the parameter
    (weakly, by identity). A parameter laid out on the meta device keeps its records when
    `to_empty` materializes it in place (`_materialize`): every such dictionary is made here."""
    records = WeakIdKeyDictionary()
    _PARAMETER_RECORDS.append(records)
    return records


# Each sharded parameter's padded rows: its DTensor's local tensor is a view of their first rows.
_PADDED_ROWS = parameter_records()


def parameter_owners(model: nn.Module, skip: Callable[[nn.Parameter], bool]
                     ) -> list[tuple[nn.Parameter, list[tuple[str, nn.Module, str]]]]:
    """Every parameter of `model` once (tied ones included: one `Parameter` held by several
    modules), but those `skip` selects, in `named_modules` order, with every
    (fully qualified name, module, attribute name) that holds it."""
    owners: dict[int, tuple[nn.Parameter, list[tuple[str, nn.Module, str]]]] = {}
    seen: set[tuple[int, str]] = set()
    for module_name, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is None or (id(module), name) in seen or skip(p):
                continue
            seen.add((id(module), name))
            fqn = f"{module_name}.{name}" if module_name else name
            owners.setdefault(id(p), (p, []))[1].append((fqn, module, name))
    return list(owners.values())


# The `Replicate()` DTensor parameters `replicate_parameters` made.
_REPLICATED = parameter_records()


def is_replicated_parameter(t: object) -> bool:
    return isinstance(t, nn.Parameter) and t in _REPLICATED


def replicate_parameters(model: nn.Module, mesh: DeviceMesh) -> None:
    """Make every plain-tensor parameter of `model` a `Replicate()` DTensor parameter on the
    1-D `mesh` (the strategy mesh's "dp"), in place, sharing the original's storage;
    reads of the module attribute give its local tensor. Parameters already DTensors
    (ZeRO shards, blocks of experts) are left as they are; tied ones stay tied."""
    for original, holders in parameter_owners(model, skip=lambda p: isinstance(p, DTensor)):
        value = DTensor.from_local(original.detach(), mesh, [Replicate()], run_check=False)
        parameter = nn.Parameter(value, requires_grad=original.requires_grad)
        _REPLICATED[parameter] = True
        placeholder = program_placeholder(parameter, holders[0][0])
        for _, module, name in holders:
            module._parameters[name] = parameter
            read_through(module, name, placeholder)


def row_sharded_parameter(padded: torch.Tensor, local_rows: int, global_shape: tuple[int, ...],
                          mesh: DeviceMesh, requires_grad: bool) -> nn.Parameter:
    """A parameter holding `padded[:local_rows]` as this rank's rows of a `Shard(0)`
    DTensor of `global_shape` on `mesh` (sharing `padded`'s storage)."""
    local = padded.narrow(0, 0, local_rows)
    value = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=torch.Size(global_shape),
                               stride=contiguous_strides(global_shape))
    parameter = nn.Parameter(value, requires_grad=requires_grad)
    _PADDED_ROWS[parameter] = padded
    return parameter


def program_tensor(parameter: torch.Tensor) -> torch.Tensor:
    """The plain tensor the compiled program reads for `parameter`: for a row-sharded
    DTensor, this rank's rows padded to the group's common shard size (the buffer they
    live in, or a padded copy if the parameter's storage was replaced, e.g. by
    `model.to`); for another DTensor its local tensor; a plain tensor as it is."""
    if not isinstance(parameter, DTensor):
        return parameter
    local = local_tensor(parameter)
    if not _PADDED_ROWS:  # no parameter is padded (a lookup costs most of this function's time)
        return local
    padded = _PADDED_ROWS.get(parameter)
    if padded is None:
        return local
    if (local.untyped_storage().data_ptr() == padded.untyped_storage().data_ptr()
            and local.storage_offset() == padded.storage_offset() and local.stride() == padded.stride()):
        return padded
    copy = local.new_zeros(padded.shape)
    copy[: local.shape[0]].copy_(local)
    return copy


def parameter_grad(parameter: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The program's gradient `grad` for `parameter` (of `program_tensor`'s shape), as the
    parameter's own gradient: for a DTensor, a DTensor of the same placement without
    the padding rows."""
    if not isinstance(parameter, DTensor):
        return grad
    local = local_tensor(parameter)
    grad = _without_padding(grad, local)
    if grad.dtype != parameter.dtype:
        return DTensor.from_local(grad, parameter.device_mesh, parameter.placements, run_check=False,
                                  shape=parameter.shape, stride=parameter.stride())
    return dtensor_like(grad, parameter)


def accumulate_grad(parameter: DTensor, grad: torch.Tensor) -> None:
    """Add the program's gradient `grad` for the leaf DTensor `parameter` (of
    `program_tensor`'s shape) into `parameter.grad`, as autograd's AccumulateGrad would,
    the way FSDP2's post-backward hands its sharded parameters their gradients: with none
    yet, `grad` (without the padding rows, in the parameter's dtype and strides) becomes
    the gradient, a DTensor of the parameter's spec; else it is added in place.

    Through autograd every DTensor gradient pays DTensor's dispatch (the engine's checks
    and AccumulateGrad's detach): about 15 microseconds a parameter and step, where this
    takes 3. A plain tensor's costs autograd about 1, less than this would."""
    local = local_tensor(parameter)
    grad = _without_padding(grad, local)
    if grad.dtype != local.dtype:
        grad = grad.to(local.dtype)
    existing = parameter.grad
    if existing is None:
        if grad.stride() != local.stride() and _strides_differ(grad, local):
            grad = torch.empty_strided(local.shape, local.stride(), dtype=local.dtype,
                                       device=local.device).copy_(grad)
        parameter.grad = dtensor_like(grad, parameter)
    elif isinstance(existing, DTensor) and existing.placements == parameter.placements:
        local_tensor(existing).add_(grad)
    else:
        existing.add_(dtensor_like(grad, parameter))


def _without_padding(grad: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """The rows of the program's gradient `grad` (padded to the group's common shard size)
    that this rank's `local` tensor holds."""
    if local.dim() and grad.shape[0] != local.shape[0]:
        return grad.narrow(0, 0, local.shape[0])
    return grad


def _strides_differ(grad: torch.Tensor, like: torch.Tensor) -> bool:
    """Whether `grad` breaks AccumulateGrad's layout contract: `like`'s strides in every
    dimension longer than 1 (a dense parameter's layout, which the optimizer's foreach
    kernels and a later accumulation then share)."""
    return any(size > 1 and a != b for size, a, b in zip(like.shape, grad.stride(), like.stride()))


_STANDS_FOR = "_piper_stands_for"  # a program placeholder's attribute: a weak reference to its parameter
_NAME = "_piper_name"  # and the parameter's name in the model (the first, if tied)
# Each parameter's program placeholder, one per parameter (the placeholder refers to it weakly).
_PLACEHOLDER_OF = parameter_records()


def program_placeholder(parameter: nn.Parameter, name: str, dtype: torch.dtype | None = None) -> nn.Parameter:
    """What Dynamo traces in place of `parameter` (a DTensor, or a plain parameter traced in
    another dtype), named `name` in the model (made on the first call, the same one after
    for the same `dtype`): a plain `nn.Parameter` sharing the storage of its `program_tensor`
    (its shape and device, and its dtype unless `dtype` is given; no memory of its own), as
    trainable as the parameter, which `stood_for` gives back.

    In another `dtype` (mixed precision's `param_dtype`, `trace_in_dtype`) its bytes are
    not the parameter's values: the piper backend stands the parameter in for it, and
    Dynamo reads a placeholder's metadata only."""
    placeholder = _PLACEHOLDER_OF.get(parameter)
    if placeholder is not None and dtype is not None and placeholder.dtype != dtype:
        placeholder = None
    if placeholder is None:
        placeholder = nn.Parameter(_same_storage(program_tensor(parameter).detach(), dtype),
                                   requires_grad=parameter.requires_grad)
        setattr(placeholder, _STANDS_FOR, weakref.ref(parameter))
        setattr(placeholder, _NAME, name)
        # The piper backend hands gradients to the parameter; a gradient reaching the placeholder
        # means another backend traced the model and would train the placeholder in its place.
        placeholder.register_post_accumulate_grad_hook(_compiled_by_another_backend)
        _PLACEHOLDER_OF[parameter] = placeholder
    return placeholder


def _same_storage(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """A tensor of `tensor`'s shape, strides and device in `dtype` (default: its own), in
    `tensor`'s storage where it fits there (a narrower dtype: the first half of an fp32
    parameter's bytes as bf16), else in memory of its own."""
    if dtype is None or dtype == tensor.dtype:
        return tensor
    storage = tensor.untyped_storage()
    itemsize = dtype.itemsize
    offset, extent = tensor.storage_offset() * tensor.element_size(), 1
    for size, stride in zip(tensor.shape, tensor.stride()):
        extent += (size - 1) * stride
    if tensor.numel() == 0 or offset % itemsize or offset + extent * itemsize > storage.nbytes():
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device=tensor.device)
    return torch.empty(0, dtype=dtype, device=tensor.device).set_(
        storage, offset // itemsize, tensor.shape, tensor.stride())


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


def _compiled_by_another_backend(placeholder: nn.Parameter) -> None:
    raise RuntimeError(
        f"piper_fx: parameter {placeholder_name(placeholder)} got its gradient through the plain placeholder that "
        "torch.compile traces in its place: a model piper_fx.prepare laid out was compiled with a backend other "
        "than piper_fx's; compile it with backend=\"piper\" and the options given to prepare")


def stood_for(tensor: object) -> object:
    """The parameter `tensor` stands for if it is a program placeholder, else `tensor` itself."""
    parameter = getattr(tensor, _STANDS_FOR, None)
    return tensor if parameter is None else parameter()


def placeholder_name(tensor: object) -> str | None:
    """The model's name for the parameter `tensor` stands for, if it is a program placeholder."""
    return getattr(tensor, _NAME, None)


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
    under `name` (e.g. `load_state_dict(..., assign=True)`) drops its placeholder: the new
    one is read itself. A copy of the module (`copy.deepcopy`) gets the placeholders of its
    own parameters, not copies of the original's.

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
                                          "__getstate__": _getstate, "__setstate__": _setstate})
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
    which Hugging Face's `generate` reads to choose the arguments it passes)."""
    cls = _own_class(module)
    if "forward" in cls.__dict__:
        return
    base = cls.__mro__[1].forward
    forward = types.FunctionType(_forward_gathering.__code__, _forward_gathering.__globals__, "forward")
    forward.__qualname__ = f"{cls.__qualname__}.forward"
    forward.__doc__, forward.__wrapped__ = base.__doc__, base
    forward.__signature__ = inspect.signature(base)
    cls.forward = forward


def _forward_gathering(self, *args, **kwargs):
    forward = type(self).__mro__[1].forward
    if torch.compiler.is_compiling():
        return forward(self, *args, **kwargs)
    _EAGER_FORWARDS.depth += 1
    try:
        return forward(self, *args, **kwargs)
    finally:
        _EAGER_FORWARDS.depth -= 1


# `read_through`'s getters, by their source: written as dataclasses write their methods, their
# name, op, shape and group constants of their code, which reads nothing else but this module's
# globals. `_piper_program_placeholders` is `_PLACEHOLDERS`, spelled out for Dynamo to trace. A
# parameter registered anew under the name (its placeholder dropped) is read as it is.
_GETTER_SOURCE = """def get(self):
    if {name!r} in self._piper_program_placeholders:
        if torch.compiler.is_compiling():
            return {compiled}
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
    self.__dict__[_PLACEHOLDERS].pop(name, None)
    type(self).__mro__[1].register_parameter(self, name, param)  # the module's own class


def _apply(self: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> nn.Module:
    """`nn.Module._apply` (what `to`, `to_empty`, `cuda`, `float` and the like run) for a module
    holding parameters `prepare` laid out. A parameter laid out on the meta device (the model
    built under `torch.device("meta")`, as for FSDP2) is materialized in place where `fn` makes
    its memory (`to_empty(device=...)`, `_materialize`). Any other conversion that leaves each
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
            _materialize(self._parameters[name], program, placeholders[name])
    for name, placeholder in placeholders.items():
        parameter = self._parameters.get(name)
        if parameter is not None and placeholder.is_meta and not parameter.is_meta:
            placeholders[name] = _PLACEHOLDER_OF[parameter]
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
    return converted


def keep_tied_through_apply(model: nn.Module) -> None:
    """Have `model.to_empty(...)` (any `_apply`) keep its tied parameters tied, as it keeps
    those `prepare` laid out (`_materialize`) and FSDP2 its own: `prepare` asks it of a model
    built on the meta device, whose plain parameters (all of them at dp = 1) PyTorch would
    make anew, one per module holding each."""
    _own_class(model)


def _materialize(parameter: nn.Parameter, program: torch.Tensor, placeholder: nn.Parameter) -> None:
    """Give `parameter`, laid out on the meta device, the memory `program` (where `to_empty`
    made its program tensor: the padded rows of a sharded one), in place, as PyTorch's
    `_apply` swaps a DTensor parameter's contents: the same `Parameter` object, so the modules
    holding it (tied ones too) and the caller's references keep it, with its records
    (`parameter_records`) and a program placeholder on the new memory, in the old one's dtype.
    A replicated parameter is marked for the backend to start every replica from the first
    one's values when it compiles (`replicas`), as `prepare` did for a model built as usual.
    A parameter something else refers to weakly (compiled already) cannot be swapped: a
    `PiperError`, the parameter left as it was."""
    if isinstance(parameter, DTensor):
        local = program.narrow(0, 0, local_tensor(parameter).shape[0]) if parameter in _PADDED_ROWS else program
        value = DTensor.from_local(local, parameter.device_mesh, parameter.placements, run_check=False,
                                   shape=parameter.shape, stride=parameter.stride())
    else:
        value = program
    materialized = nn.Parameter(value, requires_grad=parameter.requires_grad)
    for key, attribute in parameter.__dict__.items():  # piper_fx's marks (its sharding, an expert's)
        materialized.__dict__.setdefault(key, attribute)
    records = [(kept, kept.pop(parameter)) for kept in _PARAMETER_RECORDS if parameter in kept]
    placeholder.__dict__.pop(_STANDS_FOR)  # its weak reference: swap_tensors refuses a tensor referred to weakly
    try:
        torch.utils.swap_tensors(parameter, materialized)
    except RuntimeError as error:
        setattr(placeholder, _STANDS_FOR, weakref.ref(parameter))
        for kept, record in records:
            kept[parameter] = record
        raise PiperError(
            f"piper_fx: parameter {placeholder_name(placeholder)} cannot be materialized ({error}): call "
            "to_empty on a model built on the meta device after piper_fx.prepare and before compiling it") from error
    for kept, record in records:
        kept[parameter] = record
    if parameter in _PADDED_ROWS:
        _PADDED_ROWS[parameter] = program
    if parameter in _REPLICATED:
        mark_unsynchronized(parameter)
    del _PLACEHOLDER_OF[parameter]
    program_placeholder(parameter, placeholder_name(placeholder), placeholder.dtype)


def _getstate(self: nn.Module) -> dict:
    state = type(self).__mro__[1].__getstate__(self)
    # Not the placeholders, which stand for these very parameters: their names and dtypes, to
    # make those of the parameters the state's new module holds.
    state[_PLACEHOLDERS] = {name: (placeholder_name(p), p.dtype) for name, p in state[_PLACEHOLDERS].items()}
    return state


def _setstate(self: nn.Module, state: dict) -> None:
    made = state.pop(_PLACEHOLDERS, {})
    type(self).__mro__[1].__setstate__(self, state)
    self.__dict__[_PLACEHOLDERS] = {name: program_placeholder(self._parameters[name], fqn, dtype)
                                    for name, (fqn, dtype) in made.items()}
