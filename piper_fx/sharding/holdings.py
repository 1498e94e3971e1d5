"""How each rank holds each parameter: the placement record that checkpoints and clipping read.

A parameter of a piper_fx model is held by a rank in one of three ways: whole
(a replica, as under plain data parallelism), as its rows over a group (a
`Shard(0)` DTensor parameter, `dtensor_params`: ZeRO's dp group, or the ep
group for a block of experts), and, under a pipeline, not at all: the
parameters of stages a rank does not run keep their objects (the model is
whole on every rank) but not their memory, released when the step is compiled. `prepare` records a `Holding`
for every parameter it lays out and the backend completes it when it compiles
(replicas of a model compiled without `prepare`, the pipeline rank that
trains each parameter). A buffer the forward updates is held so too under a
pipeline: by the rank whose stage updates it alone (`passes.update_buffers`).
Kept here, keyed by the parameter's identity for as long as it lives, not on
the user's objects.

What follows from a holding, defined once: this rank's piece of a held
tensor (the parameter, its gradient or an optimizer state of its shape),
whether this rank's copy is current, and whether this rank is the one that
counts its piece when every rank's pieces are summed (a global gradient norm).
"""
from __future__ import annotations

import contextlib
import contextvars
import itertools
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..compat import read_as_zeros, resolve_process_group
from .dtensor_params import parameter_records
from .row_shard import sharded_parameter_info


@dataclass(frozen=True)
class Holding:
    """How this rank holds one parameter."""

    global_shape: tuple[int, ...]
    shard_group: str | None = None    # dim 0 split over this group (a `Shard(0)` DTensor); None: held whole
    replica_group: str | None = None  # ranks holding the very same piece; None: no other
    pipeline: tuple[int, str] | None = None  # (pipeline rank that trains it, pp group) under a pipeline
    readers: tuple[int, ...] = ()  # under a pipeline, the pipeline ranks whose stages read it (the first trains it)
    stored: bool = True  # False: no stage of this rank reads it, and its storage was released

    @property
    def current(self) -> bool:
        """Whether this rank holds an up-to-date copy of its piece: under a pipeline, only the trainer does."""
        return self.stored and (self.pipeline is None or _group_rank(self.pipeline[1]) == self.pipeline[0])

    @property
    def counted(self) -> bool:
        """Whether this rank's piece is the one counted when summing over all ranks:
        current, and the first of its replicas."""
        return self.current and (self.replica_group is None or _group_rank(self.replica_group) == 0)

    @staticmethod
    def local(tensor: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `tensor` (the parameter, its gradient or an optimizer state of
        its shape): a DTensor's local rows, a whole tensor itself."""
        return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _group_rank(group_name: str) -> int:
    return dist.get_rank(resolve_process_group(group_name))


_HOLDINGS = parameter_records()


def record_holding(parameter: torch.Tensor, holding: Holding) -> None:
    _HOLDINGS[parameter] = holding


def has_holding(parameter: torch.Tensor) -> bool:
    return parameter in _HOLDINGS


def holding_of(parameter: torch.Tensor) -> Holding:
    """The recorded holding, or that of a parameter piper_fx never laid out: whole, on this rank alone."""
    holding = _HOLDINGS.get(parameter)
    if holding is None:
        info = sharded_parameter_info(parameter)
        holding = Holding(tuple(parameter.shape), info.group_name if info is not None else None)
    return holding


def record_pipeline_readers(parameter: torch.Tensor, readers: tuple[int, ...], pp_group_name: str) -> None:
    """Under a pipeline, the pipeline ranks whose stages read `parameter`; the first trains it."""
    record_holding(parameter, replace(holding_of(parameter), pipeline=(readers[0], pp_group_name), readers=readers))


def release(parameter: torch.Tensor) -> None:
    """Free the storage of a parameter this rank never reads (a pipeline stage it does not run):
    the object, its shape and its place in the optimizer stay, its values are gone (as FSDP frees
    a sharded parameter's storage). On a CPU it then reads as zeros, holding no memory
    (`compat.read_as_zeros`); on an accelerator its storage is emptied (`resize_(0)`, as FSDP's),
    and a read of it is the device's fault. Record it, so readers of values skip it and memory
    counts leave it out (`is_stored`), and from now on keep it out of every optimizer step
    (`_skip_released`)."""
    record_holding(parameter, replace(holding_of(parameter), stored=False))
    _RELEASED[parameter] = True
    if not _OPTIMIZER_HOOK:
        _OPTIMIZER_HOOK.append(register_optimizer_step_pre_hook(_skip_released))
    local = Holding.local(parameter)
    if local.device.type == "cpu":
        read_as_zeros(local.untyped_storage())
    elif local.device.type != "meta":
        local.untyped_storage().resize_(0)


def is_stored(parameter: torch.Tensor) -> bool:
    return holding_of(parameter).stored


# ---- Released parameters as PyTorch's own state-dict and optimizer code see them.
#
# Under a pipeline a rank holds its stages' parameters only, as a stage module of
# torch.distributed.pipelining does: its state dict has their keys alone (DCP writes
# the union of the ranks'), loading leaves the others out, and no optimizer steps them.

_RELEASED = parameter_records()  # released parameters, as a set
_OPTIMIZER_HOOK: list = []  # the step pre-hook's handle, once installed
_WHOLE = contextvars.ContextVar("piper_fx_whole_state_dict", default=False)


def _skip_released(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Optimizer step pre-hook (every optimizer): a released parameter has no gradient, whatever
    set one (`torch.distributed.checkpoint.state_dict` initialises the state by stepping every
    parameter with zero gradients), and in `optimizer` an empty state, that of a parameter never
    stepped (a state loaded before compiling holds every stage's). Empty, not absent: loading
    an optimizer state dict with `set_state_dict` asks for an entry of every parameter."""
    if not _RELEASED:
        return
    held = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for parameter in list(_RELEASED.keys()):
        parameter.grad = None
        if id(parameter) in held and optimizer.state.get(parameter) != {}:
            optimizer.state[parameter] = {}


@contextlib.contextmanager
def whole_state_dict():
    """Within it, `state_dict()` of a model prepared for a pipeline has every key, released
    parameters included (for piper_fx's own readers, which fetch their values from their trainer)."""
    token = _WHOLE.set(True)
    try:
        yield
    finally:
        _WHOLE.reset(token)


def _released_names(model: nn.Module, prefix: str) -> list[str]:
    if not _RELEASED:
        return []
    return [prefix + name for name, t in itertools.chain(model.named_parameters(remove_duplicate=False),
                                                         model.named_buffers(remove_duplicate=False))
            if t in _RELEASED]


def _drop_released_from_state_dict(model: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    if not _WHOLE.get():
        for name in _released_names(model, prefix):
            state_dict.pop(name, None)


def _drop_released_from_loaded(model: nn.Module, state_dict: dict, prefix: str, local_metadata, strict,
                               missing_keys, unexpected_keys, error_msgs) -> None:
    for name in _released_names(model, prefix):  # nothing to write them into
        state_dict.pop(name, None)


def _released_are_not_missing(model: nn.Module, incompatible_keys) -> None:
    """Load post-hook; the keys are named from the module `load_state_dict` was called on,
    `model` or one holding it, so a released parameter's key ends with its name in `model`."""
    released = _released_names(model, "")
    if released:
        incompatible_keys.missing_keys[:] = [
            key for key in incompatible_keys.missing_keys
            if not any(key == name or key.endswith("." + name) for name in released)]


def hide_released_parameters(model: nn.Module) -> None:
    """Make `model.state_dict()` and `load_state_dict` see only the parameters this rank stores,
    once compiling has released the others (until then, every one): a released parameter's key
    is left out of the state dict, its value dropped from a loaded one, and its absence from a
    loaded state dict is no missing key under `strict`. PyTorch's `get_state_dict`,
    `set_state_dict` and `dcp.save` / `dcp.load` then work on a pipelined model as on
    torch.distributed.pipelining's stage modules."""
    model.register_state_dict_post_hook(_drop_released_from_state_dict)
    model.register_load_state_dict_pre_hook(_drop_released_from_loaded)
    model.register_load_state_dict_post_hook(_released_are_not_missing)


@dataclass(frozen=True)
class HeldParameter:
    """A parameter of the model as this rank holds it."""

    fqns: tuple[str, ...]     # its names in the model's state dict (several when tied)
    parameter: nn.Parameter   # what the optimizer holds: the parameter, or its rows as a DTensor
    holding: Holding


def held_parameters(model: nn.Module) -> list[HeldParameter]:
    """Every parameter of `model` once, in `named_parameters` order, with all its names."""
    fqns: dict[int, list[str]] = {}
    params: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqns.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return [HeldParameter(tuple(names), params[key], holding_of(params[key])) for key, names in fqns.items()]
