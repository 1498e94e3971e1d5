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
`read_through.py`). Run eagerly, the read gives a replicated parameter's local
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
(`read_through.trace_in_dtype`; a plain parameter, at dp = 1, gets one too), its bytes the first
of its program tensor's: Dynamo traces the model as FSDP2 runs it, its parameters
cast, so the dtypes a model reads to choose one (an activation's, a parameter's)
are `param_dtype`, and the step reads the parameter cast to it (`capture`).

Every other parameter (all of them at ZeRO-0, 0-d ones at any level, those
that are not experts under ep) is a whole replica over dp: `prepare` makes it
a `Replicate()` DTensor on the dp mesh sharing the original's storage
(`read_through.replicate_parameters`), read as its local tensor, which is the program's
tensor. Its gradient is handed back as a `Replicate()` DTensor too, so the
optimizer, `state_dict` and `clip_grad_norm_` see every parameter's placement.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
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
    `to_empty` materializes it in place (`materialize`): every such dictionary is made here."""
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


# The `Replicate()` DTensor parameters `read_through.replicate_parameters` made.
_REPLICATED = parameter_records()


def is_replicated_parameter(t: object) -> bool:
    return isinstance(t, nn.Parameter) and t in _REPLICATED


def mark_replicated(parameter: nn.Parameter) -> None:
    """Record `parameter` as a `Replicate()` DTensor parameter `prepare` made."""
    _REPLICATED[parameter] = True


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
        placeholder = nn.Parameter(_same_storage(program_tensor(parameter).detach(), dtype))
        setattr(placeholder, _STANDS_FOR, weakref.ref(parameter))
        setattr(placeholder, _NAME, name)
        # The piper backend hands gradients to the parameter; a gradient reaching the placeholder
        # means another backend traced the model and would train the placeholder in its place.
        # Registered while it requires grad (autograd refuses a hook on a tensor that does not),
        # kept while it follows a frozen parameter, and run again once that one is unfrozen.
        placeholder.register_post_accumulate_grad_hook(_compiled_by_another_backend)
        placeholder.requires_grad_(parameter.requires_grad)
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


def materialize(parameter: nn.Parameter, program: torch.Tensor, placeholder: nn.Parameter) -> None:
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
