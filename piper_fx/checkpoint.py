"""Checkpoints with torch.distributed.checkpoint (DCP): save, resume bit-exact, resume under another strategy.

A checkpoint is what single-process PyTorch would save, in pieces: the
unprepared model's state dict (every name, tied parameters under each of
theirs, persistent buffers), the optimizer's state dict in the layout of
`torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` (keyed by
each parameter's first name), the step count, rank 0's RNG state and the
dropout stream of the model's compiled step, if it has random ops. Each
rank hands DCP what it holds: a ZeRO shard or a block of experts as the
`DTensor` parameter it is (`sharding/dtensor_params.py`), a whole parameter
as itself, and under a pipeline only what it keeps current
(`sharding/holdings.py`). DCP writes each piece once (replicas are deduplicated)
and, on load, reads into each rank whatever part of the saved pieces the
current layout needs, so a checkpoint saved under one strategy (or by a plain
process) loads under any other (or into a plain model).

Requires: a model laid out by `prepare` (or not prepared at all), and for an
optimizer, one built on its parameters after `prepare`. Under a process group
every rank calls `save_checkpoint` and `load_checkpoint` (they are collective);
without one they run in this process alone. `path` is a directory every rank
sees. Saving a pipelined model after it is compiled (under a pipeline only
the rank that trains a parameter keeps it current; before compiling that is
unknown and every rank's copy counts as current).
Guarantees:
  - saving reads and never changes the model, the optimizer or the RNG;
  - the checkpoint's "model" keys are the unprepared model's `state_dict()`
    keys; each parameter and each optimizer state comes from a rank that
    keeps it current;
  - loading, before or after compiling, leaves every parameter and optimizer
    state of this rank's layout (all it stores, current or not: after
    compiling under a pipeline, not those of other ranks' stages) holding the
    saved values, the parameter groups' hyperparameters restored, and the
    RNG (CPU, and the model's accelerator if the checkpoint has its state) set
    to rank 0's at saving, and the model's dropout stream (`philox.py`: the
    key and step count of its compiled step, now or when it is compiled)
    continuing the saved one; it returns the saved step. Written in place: the
    parameters stay the objects the optimizer and the compiled step hold.
Known limits: Buffers are saved from every rank as they are (a buffer a
pipeline stage changes is not taken from its stage). Optimizer states of a
sharded parameter must be scalars or have the parameter's shape (Adam, SGD
and the like); any other shape is refused.
"""
from __future__ import annotations

import contextlib
import functools
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn

from .compat import init_optim_state
from .philox import restore_stream, stream_state
from .sharding.holdings import Holding, held_parameters, is_stored

if TYPE_CHECKING:
    from torch.distributed.checkpoint.planner import LoadPlanner, ReadItem

MODEL, OPTIMIZER, STEP, RNG, DROPOUT = "model", "optimizer", "step", "rng", "dropout"
_STATE, _GROUPS, _PARAMS = "state", "param_groups", "params"
_STREAM = ("seed", "step")  # the dropout stream's state, as `philox.stream_state` gives it


# ---- State dicts: what this rank holds, as pieces of the unprepared model's tensors.

def _model_entries(model: nn.Module, current_only: bool) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """fqn -> (value for DCP, the tensor it writes into), in `state_dict()` order."""
    holdings = {id(h.parameter): h.holding for h in held_parameters(model)}
    entries: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for fqn, value in model.state_dict(keep_vars=True).items():
        holding = holdings.get(id(value))
        if holding is not None and (not holding.stored or (current_only and not holding.current)):
            continue
        entries[fqn] = _piece(value.detach())
    return entries


def _piece(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`tensor` (a parameter, buffer or optimizer state) as DCP sees it, and the local tensor it writes into."""
    return tensor, Holding.local(tensor)


def _optimizer_entries(model: nn.Module, optimizer: torch.optim.Optimizer, current_only: bool
                       ) -> tuple[dict[str, Any], dict[tuple, torch.Tensor]]:
    """The optimizer state dict and, by path in it, the tensor each DCP value writes into."""
    held = {id(h.parameter): h for h in held_parameters(model)}
    state: dict[str, dict[str, Any]] = {}
    groups: list[dict[str, Any]] = []
    destinations: dict[tuple, torch.Tensor] = {}
    for group in optimizer.param_groups:
        fqns = []
        for p in group[_PARAMS]:
            h = held.get(id(p))
            if h is None:
                raise ValueError(f"the optimizer holds a parameter of shape {tuple(p.shape)} that is not one of "
                                 "the model's (build the optimizer on the model's parameters after prepare)")
            fqn = h.fqns[0]
            fqns.append(fqn)
            if p not in optimizer.state or (current_only and not h.holding.current):
                continue
            state[fqn] = {}
            for key, value in optimizer.state[p].items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:
                    if h.holding.shard_group is not None and value.shape != p.shape:
                        raise NotImplementedError(
                            f"optimizer state {key!r} of {fqn} has shape {tuple(value.shape)}, neither a scalar "
                            f"nor the parameter's shard shape {tuple(p.shape)}: piper_fx cannot say which part "
                            "of the full state it is")
                    value, destinations[(OPTIMIZER, _STATE, fqn, key)] = _piece(value.detach())
                elif isinstance(value, torch.Tensor):
                    destinations[(OPTIMIZER, _STATE, fqn, key)] = value
                state[fqn][key] = value
        groups.append({**{k: v for k, v in group.items() if k != _PARAMS}, _PARAMS: fqns})
    return {_STATE: state, _GROUPS: groups}, destinations


@torch.no_grad()
def model_state_dict(model: nn.Module, *, current_only: bool = True) -> dict[str, torch.Tensor]:
    """The model's state dict as this rank holds it, for DCP: every name (tied
    parameters under each), persistent buffers too; a sharded parameter as the
    `DTensor` it is, a whole one as itself. With
    `current_only`, without the parameters this rank does not keep current (under a
    pipeline, those its stages do not train)."""
    return {fqn: value for fqn, (value, _) in _model_entries(model, current_only).items()}


@torch.no_grad()
def optimizer_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, *,
                         current_only: bool = True) -> dict[str, Any]:
    """`optimizer`'s state dict in `get_optimizer_state_dict`'s layout, keyed by each
    parameter's first name in the unprepared model: states of the parameter's shape as
    `DTensor` views like the parameter's (sharing their storage), scalars as they are.
    With `current_only`, without the states of parameters this rank does not keep current."""
    return _optimizer_entries(model, optimizer, current_only)[0]


# ---- Saving and loading.

def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@contextlib.contextmanager
def _single_process_is_meant():
    """Silences DCP's warning that, without a process group, it works in this process
    alone: here that is what is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.get_default_device()


def _rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    """This process's RNG states: the CPU's, and `device`'s when it is an accelerator."""
    states = {"cpu": torch.get_rng_state()}
    if device.type != "cpu" and device.type != "meta":
        states[device.type] = torch.get_device_module(device.type).get_rng_state(device)
    return states


@torch.no_grad()
def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None, *,
                    step: int | None = None) -> None:
    """Save `model` (and `optimizer`, the step count, rank 0's RNG state and the dropout
    stream) to the directory `path` with DCP, each piece from a rank that keeps it current.
    Collective under a process group: every rank calls it."""
    state: dict[str, Any] = {MODEL: model_state_dict(model), STEP: step}
    if optimizer is not None:
        state[OPTIMIZER] = optimizer_state_dict(model, optimizer)
    if _rank() == 0:  # the other ranks leave it out, so the checkpoint's is rank 0's
        state[RNG] = _rng_states(_model_device(model))
    stream = stream_state(list(model.parameters()))
    if stream is not None:  # the same on every rank
        state[DROPOUT] = {key: torch.tensor(value, dtype=torch.int64) for key, value in zip(_STREAM, stream)}
    dcp = _dcp()
    with _single_process_is_meant():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.fspath(path)))


def _dcp():
    """`torch.distributed.checkpoint`, imported when a checkpoint is saved or loaded: it brings
    `torch.distributed.elastic` with it (2.5 MB of a process, and a quarter of the time
    `import piper_fx` took beside the modules torch's FSDP loads), which a job that saves no
    checkpoint need not load."""
    import torch.distributed.checkpoint as dcp
    return dcp


@functools.cache
def _write_through_planner() -> type[LoadPlanner]:
    """DCP's default load planner that checks every piece it reads landed in the tensor it
    stands for (a parameter's or optimizer state's storage) and copies it there if not:
    made once, when the first checkpoint is loaded (`_dcp`)."""

    class WriteThroughPlanner(_dcp().DefaultLoadPlanner):
        def __init__(self, destinations: dict[tuple, torch.Tensor]):
            super().__init__()
            self._by_path = destinations

        def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
            super().set_up_planner(state_dict, metadata, is_coordinator)
            self._destinations = {fqn: self._by_path[tuple(path)] for fqn, path in self.mappings.items()
                                  if tuple(path) in self._by_path}

        def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
            destination = self._destinations.get(read_item.dest_index.fqn)
            if destination is None or tensor.numel() == 0:
                return
            target = destination
            for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                target = target.narrow(dim, offset, length)
            if target.data_ptr() != tensor.data_ptr() or target.stride() != tensor.stride():
                target.copy_(tensor)

    return WriteThroughPlanner


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Give every parameter of `optimizer` that trains and that this rank stores a state (a step
    with zero gradients at lr 0) if one has none yet; the states it has and the gradients are
    kept as they are."""
    params = [p for group in optimizer.param_groups for p in group[_PARAMS]]
    if all(p in optimizer.state for p in params if p.requires_grad and is_stored(p)):
        return
    kept, grads = dict(optimizer.state), [p.grad for p in params]
    all_params = [group[_PARAMS] for group in optimizer.param_groups]
    optimizer.state.clear()
    for p in params:
        p.grad = None
    for group in optimizer.param_groups:  # a released parameter (another stage's) has no values to step
        group[_PARAMS] = [p for p in group[_PARAMS] if is_stored(p)]
    try:
        init_optim_state(optimizer)
    finally:
        for group, group_params in zip(optimizer.param_groups, all_params):
            group[_PARAMS] = group_params
        for p, grad in zip(params, grads):
            p.grad = grad
        optimizer.state.update(kept)


def _saved_keys(path: str | os.PathLike) -> set[str]:
    return set(_dcp().FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata)


def _request_saved_only(optim_state: dict[str, Any], destinations: dict[tuple, torch.Tensor],
                        saved: set[str]) -> None:
    """Drop from `optim_state` what the checkpoint does not have (a state of a parameter that
    never stepped, a hyperparameter another torch release added), so loading asks for none of it."""
    prefix = f"{OPTIMIZER}.{_STATE}"
    for fqn in list(optim_state[_STATE]):
        for key in list(optim_state[_STATE][fqn]):
            if f"{prefix}.{fqn}.{key}" not in saved:
                del optim_state[_STATE][fqn][key]
                destinations.pop((OPTIMIZER, _STATE, fqn, key), None)
        if not optim_state[_STATE][fqn]:
            del optim_state[_STATE][fqn]
    saved_groups = sum(key.startswith(f"{OPTIMIZER}.{_GROUPS}.") and key.endswith(f".{_PARAMS}") for key in saved)
    if saved_groups == 0:
        raise ValueError("the checkpoint has no optimizer: load it without one")
    if saved_groups != len(optim_state[_GROUPS]):
        raise ValueError(f"the checkpoint's optimizer has {saved_groups} parameter groups, this one "
                         f"{len(optim_state[_GROUPS])}")
    for i, group in enumerate(optim_state[_GROUPS]):
        for key in [k for k in group if k != _PARAMS and f"{OPTIMIZER}.{_GROUPS}.{i}.{k}" not in saved]:
            del group[key]


def _restore_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> None:
    """Hyperparameters from the loaded groups; no state for parameters the checkpoint has none of."""
    held = {id(h.parameter): h for h in held_parameters(model)}
    for i, (group, saved) in enumerate(zip(optimizer.param_groups, loaded[_GROUPS])):
        fqns = [held[id(p)].fqns[0] for p in group[_PARAMS]]
        if list(saved[_PARAMS]) != fqns:
            raise ValueError(f"parameter group {i} of the checkpoint holds {list(saved[_PARAMS])}, this "
                             f"optimizer's {fqns}")
        group.update({k: v for k, v in saved.items() if k != _PARAMS})
        for p, fqn in zip(group[_PARAMS], fqns):
            if fqn not in loaded[_STATE]:
                optimizer.state.pop(p, None)


@torch.no_grad()
def load_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None
                    ) -> int | None:
    """Load the checkpoint in directory `path` into `model` (and `optimizer`) in place,
    resharded to their current layout, restore the RNG to rank 0's at saving, and return
    the saved step. Call it after `prepare` and building the optimizer, before or after
    compiling. Collective under a process group: every rank calls it."""
    saved = _saved_keys(path)
    entries = _model_entries(model, current_only=False)
    state: dict[str, Any] = {MODEL: {fqn: value for fqn, (value, _) in entries.items()}}
    if STEP in saved:  # not in a checkpoint a plain process saved with DCP
        state[STEP] = None
    destinations = {(MODEL, fqn): destination for fqn, (_, destination) in entries.items()}
    if optimizer is not None:
        _init_optimizer_state(optimizer)
        state[OPTIMIZER], optim_destinations = _optimizer_entries(model, optimizer, current_only=False)
        _request_saved_only(state[OPTIMIZER], optim_destinations, saved)
        destinations.update(optim_destinations)
    rng = {kind: value for kind, value in _rng_states(_model_device(model)).items() if f"{RNG}.{kind}" in saved}
    if rng:
        state[RNG] = rng
        destinations.update({(RNG, kind): value for kind, value in rng.items()})
    if f"{DROPOUT}.{_STREAM[0]}" in saved:
        state[DROPOUT] = {key: torch.zeros((), dtype=torch.int64) for key in _STREAM}
    dcp = _dcp()
    with _single_process_is_meant():
        dcp.load(state, storage_reader=dcp.FileSystemReader(os.fspath(path)),
                 planner=_write_through_planner()(destinations))
    if DROPOUT in state:
        restore_stream(list(model.parameters()), *(int(state[DROPOUT][key]) for key in _STREAM))
    if optimizer is not None:
        _restore_optimizer(model, optimizer, state[OPTIMIZER])
    device = _model_device(model)
    for kind, value in state.get(RNG, {}).items():
        if kind == "cpu":
            torch.set_rng_state(value)
        else:
            torch.get_device_module(kind).set_rng_state(value, device)
    return state.get(STEP)
