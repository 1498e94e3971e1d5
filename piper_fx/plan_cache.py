"""The plan cache: a compile's plan, kept across processes.

Planning a step (capture and the strategy passes) is the same work every time
the same model is compiled with the same strategy, and costs about a second on
the example GPT, most of a warm compile once Inductor's FX graph cache holds
every task's code. A compile's `Plan` (what the rest of the compile and the
runtime read of the planned DAG: this rank's program with its task graphs, the
step's inputs and outputs) is pickled with FX's `GraphPickler` (fake values
included) under the Inductor cache directory (TORCHINDUCTOR_CACHE_DIR, shared by
ranks, runs and processes), keyed by everything planning reads:

  - the Dynamo graph: each node's op, target, arguments, the metadata planning
    reads (annotations: `custom`, piper_fx's regions by their order; module
    paths and classes: `nn_module_stack`; a placeholder's source, `ops.SOURCE`)
    and its example value's shape,
    stride, dtype and device;
  - each example input: its kind (parameter, buffer, batch), shape, stride,
    dtype, device, whether it requires grad, its DTensor placements and mesh,
    and the layout `prepare` gave it (row shards, experts);
  - the strategy (every option but the debug directory and `profile`, which
    planning does not read), the world size and rank, and the names and
    backends of the process groups its collectives use;
  - whether gradients are enabled (a training step or not) and autocast's state;
  - piper_fx's own source and torch's version.

A second compile of the same model, in this process or another one sharing the
cache directory, loads the plan instead of planning; Inductor then finds every
task in its FX graph cache. With debug dumps on, the plan keeps the dumps that
planning wrote, and a hit writes them again. Set PIPER_PLAN_CACHE=0 to plan
every time. A graph with constants of its own (`get_attr` nodes) is not cached:
its values would have to be in the key.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import io
import logging
import os
import re
import zlib
from dataclasses import dataclass, fields
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor

from .annotate import KINDS as REGION_KINDS
from .compat import (FakeTensorMode, ShapeEnv, inductor_cache_dir, load_graphs, pickle_graphs, qualified_name,
                     resolve_process_group)
from .ir import GraphInput, GraphOutput, InputRole, RankProgram, TrainingDAG
from .ops import META_PREFIX, SOURCE
from .options import Strategy
from .passes.functionalize_random import random_input
from .sharding.dtensor_params import placeholder_name, stood_for
from .sharding.experts import EXPERT_ATTR
from .sharding.row_shard import sharded_parameter_info

log = logging.getLogger(__name__)

ENV = "PIPER_PLAN_CACHE"
# Bumped when `Plan` changes shape; the source hash covers the rest of piper_fx.
FORMAT = 1
# Node metadata a plan keeps: piper_fx's own (`piper_*`: placements, collective notes,
# recomputation marks, read by the runtime's memory estimates and the dumps) and what code
# generation (Inductor) reads. Module stacks and node provenance are left out: they hold
# the model's classes and the trace's objects.
_KEPT_META = frozenset({"val", "tensor_meta", "stack_trace", "original_aten", "seq_nr", "partitioner_tag",
                        "autograd_backward", "is_gradient_acc", "desc", "custom"})


def _kept(key: str) -> bool:
    return key in _KEPT_META or key.startswith(META_PREFIX)


@dataclass
class Plan:
    """What a compile uses of its planned DAG, for this rank.

    `randomness`: the device of the random ops' seed input and the samples in a
    microbatch, if the graph has random ops. `seed`: the shape, dtype and device of
    the loss's incoming gradient, if it trains. `dumps`: the debug dumps planning
    wrote (relative path -> text), if they were on."""

    inputs: list[GraphInput]
    outputs: list[GraphOutput]
    dp_group: str | None
    parameter_holders: dict[str, tuple[int, ...]]
    program: RankProgram
    schedule: Any
    randomness: tuple[torch.device, int] | None
    seed: tuple[torch.Size, torch.dtype, torch.device] | None
    dumps: dict[str, str] | None = None


def plan_of(dag: TrainingDAG, rank: int, dumps: dict[str, str] | None = None) -> Plan:
    """The plan of `rank` in a planned `dag`."""
    seed = next((i for i in dag.inputs if i.role is InputRole.TANGENT), None)
    seed_val = dag.placeholders()[seed.name].meta["val"] if seed is not None else None
    return Plan(dag.inputs, dag.outputs, dag.dp_group, dag.parameter_holders, dag.programs[rank], dag.schedule,
                random_input(dag),
                (seed_val.shape, seed_val.dtype, seed_val.device) if seed_val is not None else None,
                dumps)


def enabled() -> bool:
    return os.environ.get(ENV, "1") not in ("0", "")


@lru_cache(maxsize=1)
def _source_hash() -> str:
    """A hash of piper_fx's source: a plan is only valid for the code that made it."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parent
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _describe_value(value: Any) -> str:
    """Shape, stride, dtype and device of a tensor (or of each in a structure); repr otherwise."""
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{tuple(value.stride())}{value.dtype}{value.device}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_describe_value(v) for v in value) + ")"
    return repr(value)


def _describe_input(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return f"{type(value).__name__}:{value!r}"
    parts = [type(value).__name__, _describe_value(value), str(value.requires_grad),
             str(isinstance(value, nn.Parameter))]
    if isinstance(value, DTensor):
        mesh = value.device_mesh
        parts += [repr(value.placements), repr(mesh.mesh.tolist()), repr(mesh.mesh_dim_names),
                  _describe_value(value.to_local())]
    info = sharded_parameter_info(value)
    if info is not None:
        parts.append(repr(info))
    if hasattr(value, EXPERT_ATTR):
        parts.append(repr(getattr(value, EXPERT_ATTR)))
    return "|".join(parts)


class _Unstable(Exception):
    """A part of the key whose text is not the same in every process (an object's address)."""


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _class_name(cls: Any) -> str:
    return f"{cls.__module__}.{cls.__qualname__}" if isinstance(cls, type) else str(cls)


def _target(target: Any) -> str:
    """A node's target by its importable name; a function defined in a function, or a lambda,
    has none that tells it from another of its name."""
    if isinstance(target, str):
        return target
    if "<" in getattr(target, "__qualname__", ""):
        raise _Unstable(repr(target))
    return qualified_name(target)


def plan_key(gm: fx.GraphModule, example_inputs: list, strategy: Strategy, groups: tuple,
             kept_holders: dict[int, tuple[int, ...]] | None = None) -> str | None:
    """The key of the plan of `gm` compiled with `example_inputs` and `strategy` (the process
    groups `groups` named, the pipeline ranks `kept_holders` kept for parameters by argument
    index), or None if it is not cached: a graph with constants of its own, or with a value
    whose text differs between processes (a function defined in a function)."""
    if gm.graph.find_nodes(op="get_attr"):
        return None
    digest = hashlib.sha256()

    def add(text: str) -> None:
        if _ADDRESS.search(text):
            raise _Unstable(text)
        digest.update(text.encode())
        digest.update(b"\0")

    try:
        _add_all(add, gm, example_inputs, strategy, groups)
        add(f"kept holders {sorted((kept_holders or {}).items())!r}")
    except _Unstable as unstable:
        log.info("piper_fx: the plan is not cached: %.200s has no stable key", unstable)
        return None
    return digest.hexdigest()


def _add_all(add, gm: fx.GraphModule, example_inputs: list, strategy: Strategy, groups: tuple) -> None:
    add(f"format {FORMAT} torch {torch.__version__} piper {_source_hash()}")
    # piper_fx's region ids (`annotate`) count up over the process; planning reads only their
    # order, so the key has each one's place among its kind's (0 for the graph's first region).
    regions: dict[str, dict[Any, int]] = {kind: {} for kind in REGION_KINDS}
    for node in gm.graph.nodes:
        try:
            target = _target(node.target)
        except Exception as error:  # noqa: BLE001 - a target without a qualified name
            raise _Unstable(repr(node.target)) from error
        add(f"{node.op} {node.name} {target} {node.args!r} {node.kwargs!r}")
        if "custom" in node.meta:
            custom = {key: regions[key].setdefault(value, len(regions[key])) if key in regions else value
                      for key, value in node.meta["custom"].items()}
            add(f"custom={custom!r}")
        if SOURCE in node.meta:  # a placeholder's: which inputs are the model's buffers
            add(f"source={node.meta[SOURCE]}")
        if "nn_module_stack" in node.meta:  # keyed by the modules' ids: their paths and classes alone
            add(repr([(path, _class_name(cls)) for path, cls in node.meta["nn_module_stack"].values()]))
        add(_describe_value(node.meta.get("example_value")))
    for value in example_inputs:  # a program placeholder: the parameter it stands for, and its name
        add(_describe_input(stood_for(value)) + f"|{placeholder_name(value)}")
    # Global state tracing reads: whether the step trains, and autocast's (on CPU and GPU).
    add(f"grad {torch.is_grad_enabled()} " + " ".join(
        f"autocast {d} {torch.is_autocast_enabled(d)} {torch.get_autocast_dtype(d)}" for d in ("cpu", "cuda")))
    # Every option but those the plan does not depend on (code generation reads `profile` and `regions`).
    unplanned = ("debug_dir", "profile", "regions")
    options = {f.name: getattr(strategy, f.name) for f in fields(strategy) if f.name not in unplanned}
    add(repr(sorted(options.items())))
    add(repr(groups))
    add(repr([_group_backend(name) for name in groups]))  # planning reads them too


def _group_backend(name: str | None) -> str | None:
    """The backend of the process group named `name` ("gloo", "nccl", "fake", ...), which
    `passes.limit_gathers_in_flight` reads; None without one."""
    if name is None or not dist.is_initialized():
        return None
    return dist.get_backend(resolve_process_group(name))


def _path(key: str) -> Path:
    return Path(inductor_cache_dir()) / "piper_plans" / key[:2] / f"{key}.plan"


def load(key: str) -> Plan | None:
    """The plan stored under `key`, or None (none stored, or one this torch cannot read)."""
    path = _path(key)
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        # Static shapes, as in capture's fake mode: Inductor's FX graph cache needs a shape env.
        with _collector_paused():
            plan = load_graphs(zlib.decompress(data), FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True))
    except Exception as error:  # noqa: BLE001 - a stale or damaged entry is planned again
        log.warning("piper_fx: could not read the cached plan %s (%s: %s); planning again",
                    path, type(error).__name__, error)
        return None
    return plan if isinstance(plan, Plan) else None


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector paused while a plan loads: unpickling makes some 10^5
    objects that all live on (graph nodes, their metadata and fake values), and each
    automatic collection walks those made so far again. The plan of a GPT of 12 blocks under
    ZeRO-3 loaded in 0.47-0.57 s with it on, 0.26 s with it off. Nothing of the load is
    garbage, so nothing is collected after."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def store(key: str, plan: Plan, strict: bool = False) -> None:
    """Keep `plan` under `key`, written whole or not at all. A plan that cannot be pickled,
    or a directory that cannot be written, is not kept (planning again is slower, not
    wrong), with a warning; with `strict` (in verified runs: the tests), a plan that cannot
    be pickled raises."""
    try:
        data = zlib.compress(pickle_graphs(plan, _kept), 1)
    except Exception as error:
        if strict:
            raise
        log.warning("piper_fx: the plan is not cached (%s: %s)", type(error).__name__, error)
        return
    path = _path(key)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with io.open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError as error:  # a full or read-only disk: the compile goes on
        log.warning("piper_fx: the plan is not cached (%s)", error)
