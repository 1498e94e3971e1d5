"""How each rank holds each parameter: the placement record that checkpoints and clipping read.

A parameter of a piper_fx model is held by a rank in one of three ways: whole
(a replica, as under plain data parallelism), as its rows over a group (a
`Shard(0)` DTensor parameter, `dtensor_params`: ZeRO's dp group, or the ep
group for a block of experts), and, under a pipeline, not at all: the
parameters of stages a rank does not run keep their objects (the model is
whole on every rank) but not their storage, released when the step is compiled. `prepare` records a `Holding`
for every parameter it lays out and the backend completes it when it compiles
(replicas of a model compiled without `prepare`, the pipeline rank that
trains each parameter). Kept here, keyed by the parameter's identity for as
long as it lives, not on the user's objects.

What follows from a holding, defined once: this rank's piece of a held
tensor (the parameter, its gradient or an optimizer state of its shape),
whether this rank's copy is current, and whether this rank is the one that
counts its piece when every rank's pieces are summed (a global gradient norm).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from ..compat import resolve_process_group
from .row_shard import sharded_parameter_info


@dataclass(frozen=True)
class Holding:
    """How this rank holds one parameter."""

    global_shape: tuple[int, ...]
    shard_group: str | None = None    # dim 0 split over this group (a `Shard(0)` DTensor); None: held whole
    replica_group: str | None = None  # ranks holding the very same piece; None: no other
    pipeline: tuple[int, str] | None = None  # (pipeline rank that trains it, pp group) under a pipeline
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


_HOLDINGS: WeakIdKeyDictionary = WeakIdKeyDictionary()


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


def record_pipeline_trainer(parameter: torch.Tensor, pp_rank: int, pp_group_name: str) -> None:
    record_holding(parameter, replace(holding_of(parameter), pipeline=(pp_rank, pp_group_name)))


def release(parameter: torch.Tensor) -> None:
    """Free the storage of a parameter this rank never reads (a pipeline stage it does not run):
    the object, its shape and its place in the optimizer stay, its values are gone (as FSDP frees
    a sharded parameter's storage). Record it, so readers of values skip it."""
    record_holding(parameter, replace(holding_of(parameter), stored=False))
    local = Holding.local(parameter)
    if local.device.type != "meta":
        local.untyped_storage().resize_(0)


def is_stored(parameter: torch.Tensor) -> bool:
    return holding_of(parameter).stored


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
