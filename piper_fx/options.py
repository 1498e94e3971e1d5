"""The strategy schema: `options` dict -> validated `Strategy`.

Each option maps onto the pass that consumes it:

| option       | consumed by                                              |
|--------------|----------------------------------------------------------|
| mesh.dp      | sharding.mesh (groups), passes.reduce_gradients          |
| mesh.pp      | passes.split_stages, passes.build_rank_programs          |
| mesh.ep      | prepare (expert shards), passes.shard_experts            |
| pipeline     | passes.split_stages (stages), passes.build_rank_programs |
|              | (schedule, microbatches), runtime.step (input split)     |
| zero         | prepare (layout), passes.unshard_parameters,             |
|              | passes.reduce_gradients                                  |
| bucket_mb    | passes.bucket_collectives (size cap of one flat bucket)  |
| overlap      | passes.reorder_for_overlap (prefetch gathers, sink waits)|
| prefetch     | passes.reorder_for_overlap (ZeRO-3 layers gathered ahead)|
| broadcast_buffers | runtime.step (buffers from the first replica, DDP's)  |
| units        | sharding.units (the layers ZeRO-3 gathers one at a time) |
| mixed_precision | capture (casts traced into the program),              |
|              | passes.unshard_parameters (gathers in param_dtype),      |
|              | passes.reduce_gradients (reductions in reduce_dtype)     |
| activation_checkpointing | passes.checkpoint_activations            |
| codegen      | capture (decompositions), codegen                        |
| regions      | codegen (tasks compiled whole or as their layers)        |
| profile      | codegen (collective waits timed inside tasks)            |
| debug_dir    | debug (dumps); env PIPER_DEBUG_DIR when not given        |

Everything is checked here, before any graph is traced, so a bad value never
half-runs: each error is a `PiperConfigError` naming the key, the value and what
would be valid.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch
import torch.distributed as dist

from .errors import PiperConfigError

ZERO_LEVELS = (0, 1, 2, 3)
CODEGENS = ("inductor", "eager")
MESH_DIMS = ("pp", "dp", "ep")
TOP_LEVEL_KEYS = ("mesh", "zero", "bucket_mb", "overlap", "prefetch", "broadcast_buffers", "units", "mixed_precision",
                  "activation_checkpointing", "codegen", "regions", "profile", "debug_dir", "pipeline", "directives")
PIPELINE_KEYS = ("schedule", "microbatches", "stages_per_rank")
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
FLOATING_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                   "float64": torch.float64}
AC_MODES = ("none", "full", "selective")


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's `MixedPrecisionPolicy`: parameters are read (and gathered) in
    `param_dtype`; gradients are reduced in `reduce_dtype` and kept in the
    parameters' own dtype; floating outputs are cast to `output_dtype`, and
    floating inputs to `param_dtype` when `cast_forward_inputs`. None: unchanged."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    @property
    def reduction_dtype(self) -> torch.dtype | None:
        """The dtype gradients are reduced in: `reduce_dtype`, else `param_dtype` (as FSDP2); None: their own."""
        return self.reduce_dtype or self.param_dtype


@dataclass(frozen=True)
class Strategy:
    """A validated strategy. `world_size` and `rank` are those of the process group."""

    dp: int
    pp: int = 1
    ep: int = 1  # expert parallel: each group of ep consecutive dp ranks shares out the experts
    zero: int = 0
    bucket_mb: float = 25.0
    overlap: bool = True
    prefetch: int = 1
    # DDP's `broadcast_buffers=True`: before a call whose model's previous call trained with gradient
    # synchronization on (or its first), every replica takes the first one's buffers (`runtime.step`).
    broadcast_buffers: bool = False
    # Patterns naming the model's units (module class names or fnmatch patterns on module
    # names); None: found automatically (`sharding.units`).
    units: tuple[str, ...] | None = None
    mixed_precision: MixedPrecision = MixedPrecision()
    # "none", "full" (keep each unit's inputs, recompute the rest in backward) or "selective"
    # (also keep matmul and attention outputs); see passes.checkpoint_activations.
    activation_checkpointing: str = "none"
    codegen: str = "inductor"
    # Under Inductor, whether a task of repeated layers compiles as one region per layer, each
    # distinct one once (True), whole (False), or by the device ("auto"; `codegen.fewest_regions`).
    regions: str | bool = "auto"
    profile: bool = False
    debug_dir: str | None = None
    world_size: int = 1
    rank: int = 0
    schedule: Any = "1f1b"  # a preset's name, or a validated `schedules.Schedule`
    microbatches: int = 1
    stages_per_rank: int = 1
    # Not an option: False plans the program a step runs while the model's gradient
    # synchronization is off (`piper_fx.no_sync`), whose gradients leave unreduced.
    gradient_sync: bool = True
    # Not an option: True plans the program of a window's first call after it, which adds
    # what the window held to each gradient before reducing it (`passes.reduce_gradients`).
    adds_held_gradients: bool = False

    @property
    def num_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def dp_index(self) -> int:
        return self.rank % self.dp

    @property
    def ep_index(self) -> int:
        return self.dp_index % self.ep

    @property
    def pp_index(self) -> int:
        return self.rank // self.dp

    @property
    def shards_parameters(self) -> bool:
        """Whether parameters live as 1/dp shards (ZeRO >= 1 over more than one replica)."""
        return self.zero >= 1 and self.dp > 1

    def layout_key(self) -> tuple:
        """What `prepare` fixed: compiling with a different key needs a new `prepare`."""
        return (self.dp, self.pp, self.ep, self.shards_parameters, self.mixed_precision.param_dtype)

    def with_rank(self, rank: int) -> "Strategy":
        return replace(self, rank=rank)

    def agreement_key(self) -> tuple:
        """What every rank must agree on (the debug directory may differ per rank)."""
        schedule = self.schedule if isinstance(self.schedule, str) else (
            self.schedule.name, self.schedule.stage_to_rank, tuple(tuple(map(str, row)) for row in self.schedule.actions))
        return (self.dp, self.pp, self.ep, self.zero, self.bucket_mb, self.overlap, self.prefetch,
                self.broadcast_buffers, self.units,
                self.mixed_precision, self.activation_checkpointing, self.codegen, self.regions, schedule,
                self.microbatches, self.stages_per_rank)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _process_group_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def parse_options(options: Mapping[str, Any] | None) -> Strategy:
    """Validate `options` against the process group and return the `Strategy`.

    Each step checks a group of options and returns their `Strategy` fields;
    they run in the order written, so the first bad option is the one named."""
    options = _options_mapping(options)
    world_size, rank = _process_group_world()
    dp, pp, ep = _parse_mesh(options.get("mesh", {}), world_size)
    return Strategy(dp=dp, pp=pp, ep=ep, world_size=world_size, rank=rank, **_parse_zero(options),
                    **_parse_communication(options), **_parse_mixed_precision(options),
                    **_parse_activation_checkpointing(options), **_parse_codegen(options),
                    **_parse_debug_dir(options), **_parse_schedule(options, pp))


def _options_mapping(options: Mapping[str, Any] | None) -> Mapping[str, Any]:
    """The options as a mapping of known top-level keys."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise PiperConfigError("options", options, "a dict of strategy options")
    for key in options:
        if key not in TOP_LEVEL_KEYS:
            raise PiperConfigError(key, options[key], f"unknown option; valid options are {list(TOP_LEVEL_KEYS)}")
    return options


def _parse_mesh(mesh: Any, world_size: int) -> tuple[int, int, int]:
    """(dp, pp, ep): dp defaults to what pp leaves of the world; pp * dp must be the world."""
    if not isinstance(mesh, Mapping):
        raise PiperConfigError("mesh", mesh, "a dict such as {'dp': 2}")
    for dim, size in mesh.items():
        if dim not in MESH_DIMS:
            raise PiperConfigError(f"mesh.{dim}", size, f"unknown mesh dimension; valid are {list(MESH_DIMS)}")
        if not _is_int(size) or size < 1:
            raise PiperConfigError(f"mesh.{dim}", size, "a positive int")
    pp = mesh.get("pp", 1)
    dp = mesh.get("dp", max(1, world_size // pp))
    launched_world = 1 if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1") or 1)
    if not dist.is_initialized() and (dp * pp > 1 or launched_world > 1):
        raise PiperConfigError(
            "mesh", dict(mesh) or {"dp": dp},
            f"a mesh of size {max(dp * pp, launched_world)} needs an initialized process group "
            "(call torch.distributed.init_process_group first); none is initialized, so the "
            "world size is 1")
    if dp * pp != world_size:
        raise PiperConfigError(
            "mesh", dict(mesh), f"pp * dp must equal the world size {world_size} (got {pp} * {dp} = {pp * dp})")
    ep = mesh.get("ep", 1)
    if dp % ep:
        raise PiperConfigError("mesh.ep", ep, f"a divisor of dp={dp}: the experts are shared out over ep of the "
                                              "data-parallel ranks and replicated over the dp/ep groups of them")
    return dp, pp, ep


def _parse_zero(options: Mapping[str, Any]) -> dict[str, Any]:
    zero = options.get("zero", 0)
    if not _is_int(zero) or zero not in ZERO_LEVELS:
        raise PiperConfigError("zero", zero, f"one of {list(ZERO_LEVELS)}")
    return {"zero": zero}


def _parse_communication(options: Mapping[str, Any]) -> dict[str, Any]:
    """How collectives are bucketed and overlapped, and the units ZeRO-3 gathers."""
    bucket_mb = options.get("bucket_mb", 25.0)
    if not isinstance(bucket_mb, (int, float)) or isinstance(bucket_mb, bool) or not bucket_mb > 0:
        raise PiperConfigError("bucket_mb", bucket_mb, "a positive number of megabytes")
    overlap = options.get("overlap", True)
    if not isinstance(overlap, bool):
        raise PiperConfigError("overlap", overlap, "True or False")
    prefetch = options.get("prefetch", 1)
    if not _is_int(prefetch) or prefetch < 0:
        raise PiperConfigError("prefetch", prefetch, "an int >= 0: how many ZeRO-3 layers to gather ahead")
    broadcast_buffers = options.get("broadcast_buffers", False)
    if not isinstance(broadcast_buffers, bool):
        raise PiperConfigError("broadcast_buffers", broadcast_buffers, "True or False")
    units = options.get("units")
    if units is not None and (isinstance(units, str) or not isinstance(units, (list, tuple)) or not units
                              or not all(isinstance(p, str) and p for p in units)):
        raise PiperConfigError("units", units, "None (find the repeated layers automatically) or a non-empty list "
                                               "of module class names ('LlamaDecoderLayer') or fnmatch patterns on "
                                               "module names ('model.layers.*')")
    return {"bucket_mb": float(bucket_mb), "overlap": overlap, "prefetch": prefetch,
            "broadcast_buffers": broadcast_buffers, "units": None if units is None else tuple(units)}


def _parse_dtype(key: str, value: Any) -> torch.dtype | None:
    if value is None:
        return None
    name = str(value).removeprefix("torch.") if isinstance(value, (str, torch.dtype)) else None
    if name not in FLOATING_DTYPES:
        raise PiperConfigError(key, value, f"None or a floating dtype: one of {list(FLOATING_DTYPES)} "
                                           "(a name or the torch.dtype)")
    return FLOATING_DTYPES[name]


def _parse_mixed_precision(options: Mapping[str, Any]) -> dict[str, Any]:
    """FSDP2's `MixedPrecisionPolicy`, as a dict (or the policy object itself)."""
    policy = options.get("mixed_precision")
    if policy is None:
        return {}
    if not isinstance(policy, Mapping):
        fields = {k: getattr(policy, k) for k in MIXED_PRECISION_KEYS if hasattr(policy, k)}
        if len(fields) != len(MIXED_PRECISION_KEYS):
            raise PiperConfigError("mixed_precision", policy, f"a dict with keys {list(MIXED_PRECISION_KEYS)} "
                                                              "or a torch MixedPrecisionPolicy")
        policy = fields
    for key in policy:
        if key not in MIXED_PRECISION_KEYS:
            raise PiperConfigError(f"mixed_precision.{key}", policy[key],
                                   f"unknown key; valid keys are {list(MIXED_PRECISION_KEYS)}")
    param = _parse_dtype("mixed_precision.param_dtype", policy.get("param_dtype"))
    reduce = _parse_dtype("mixed_precision.reduce_dtype", policy.get("reduce_dtype"))
    output = _parse_dtype("mixed_precision.output_dtype", policy.get("output_dtype"))
    cast_inputs = policy.get("cast_forward_inputs", True)
    if not isinstance(cast_inputs, bool):
        raise PiperConfigError("mixed_precision.cast_forward_inputs", cast_inputs, "True or False")
    if param is not None and reduce is not None and torch.finfo(reduce).bits < torch.finfo(param).bits:
        raise PiperConfigError("mixed_precision.reduce_dtype", policy.get("reduce_dtype"),
                               f"a dtype at least as wide as param_dtype ({param}): gradients computed in "
                               f"{param} and reduced in {reduce} lose their low bits in the sum")
    if param is not None and reduce is not None and {param, reduce} == {torch.float16, torch.bfloat16}:
        raise PiperConfigError("mixed_precision.reduce_dtype", policy.get("reduce_dtype"),
                               "float32 (or param_dtype): float16 and bfloat16 hold different ranges")
    return {"mixed_precision": MixedPrecision(param, reduce, output, cast_inputs)}


def _parse_activation_checkpointing(options: Mapping[str, Any]) -> dict[str, Any]:
    ac = options.get("activation_checkpointing")
    if ac is None:
        return {}
    mode = ac.get("mode") if isinstance(ac, Mapping) else None
    if not isinstance(ac, Mapping) or set(ac) - {"mode"} or mode not in AC_MODES:
        raise PiperConfigError("activation_checkpointing", ac,
                               f"a dict {{'mode': m}} with m one of {list(AC_MODES)}")
    return {"activation_checkpointing": mode}


def _parse_codegen(options: Mapping[str, Any]) -> dict[str, Any]:
    codegen = options.get("codegen", "inductor")
    if codegen not in CODEGENS:
        raise PiperConfigError("codegen", codegen, f"one of {list(CODEGENS)}")
    regions = options.get("regions", "auto")
    if not (isinstance(regions, bool) or regions == "auto"):
        raise PiperConfigError("regions", regions, "'auto', True or False")
    profile = options.get("profile", False)
    if not isinstance(profile, bool):
        raise PiperConfigError("profile", profile, "True or False")
    return {"codegen": codegen, "regions": regions, "profile": profile}


def _parse_debug_dir(options: Mapping[str, Any]) -> dict[str, Any]:
    debug_dir = options.get("debug_dir", os.environ.get("PIPER_DEBUG_DIR") or None)
    if debug_dir is not None and not isinstance(debug_dir, (str, os.PathLike)):
        raise PiperConfigError("debug_dir", debug_dir, "a directory path (str or os.PathLike) or None")
    return {"debug_dir": os.fspath(debug_dir) if debug_dir is not None else None}


def _parse_schedule(options: Mapping[str, Any], pp: int) -> dict[str, Any]:
    """The pipeline schedule, from `directives` or from `pipeline` (a preset or the user's own)."""
    if "directives" in options:
        if "pipeline" in options:
            raise PiperConfigError("directives", options["directives"],
                                   "either directives or options['pipeline'], not both")
        from .directives import schedule_from_directives
        schedule, microbatches, stages_per_rank = _custom_schedule(
            "directives", lambda: schedule_from_directives(options["directives"], pp), pp)
    else:
        schedule, microbatches, stages_per_rank = _parse_pipeline(options.get("pipeline"), pp)
    return {"schedule": schedule, "microbatches": microbatches, "stages_per_rank": stages_per_rank}


def _parse_pipeline(pipeline: Any, pp: int) -> tuple[Any, int, int]:
    """(schedule, microbatches, stages_per_rank) from options['pipeline']."""
    if pipeline is None:
        return "1f1b", pp, 1
    if not isinstance(pipeline, Mapping):
        raise PiperConfigError("pipeline", pipeline, "a dict such as {'schedule': '1f1b', 'microbatches': 8}")
    for key in pipeline:
        if key not in PIPELINE_KEYS:
            raise PiperConfigError(f"pipeline.{key}", pipeline[key],
                                   f"unknown pipeline option; valid are {list(PIPELINE_KEYS)}")
    schedule = pipeline.get("schedule", "1f1b")
    if not isinstance(schedule, str):
        for key in ("microbatches", "stages_per_rank"):
            if key in pipeline:
                raise PiperConfigError(f"pipeline.{key}", pipeline[key],
                                       "absent: a custom schedule brings its own microbatches and stages")
        return _custom_schedule("pipeline.schedule", lambda: _build_custom(schedule, pp), pp)
    return _parse_preset(schedule, pipeline, pp)


# The option each parameter of a preset's shape comes from.
_SHAPE_OPTIONS = {"ranks": "mesh.pp", "stages_per_rank": "pipeline.stages_per_rank",
                  "microbatches": "pipeline.microbatches"}


def _parse_preset(name: str, pipeline: Mapping[str, Any], pp: int) -> tuple[str, int, int]:
    """A preset's name and shape, checked by the preset itself (`schedules.Preset.check`)."""
    from .schedules import PRESETS, ShapeError

    if name not in PRESETS:
        raise PiperConfigError("pipeline.schedule", name,
                               f"one of {sorted(PRESETS)}, a schedules.Schedule, or a builder returning one")
    preset = PRESETS[name]
    stages_per_rank = pipeline.get("stages_per_rank", preset.stages_per_rank)
    microbatches = pipeline.get("microbatches", pp)
    try:
        preset.check(pp, microbatches, stages_per_rank)
    except ShapeError as e:
        raise PiperConfigError(_SHAPE_OPTIONS[e.parameter], e.value, e.valid) from None
    return name, microbatches, stages_per_rank


def _build_custom(schedule: Any, pp: int):
    from .schedules import Schedule

    if isinstance(schedule, Schedule):
        return schedule
    if callable(schedule):
        built = schedule(pp)
        if not isinstance(built, Schedule):
            raise TypeError(f"the schedule builder returned {type(built).__name__}, not a schedules.Schedule")
        return built
    raise TypeError(f"{type(schedule).__name__} is not a schedule")


def _custom_schedule(key: str, make, pp: int):
    """A user's schedule (object, builder or directives), validated like a preset."""
    from .schedules import ScheduleError, validate

    try:
        schedule = validate(make())
    except (ScheduleError, TypeError, ValueError) as e:
        raise PiperConfigError(key, "<custom schedule>", str(e)) from None
    if schedule.num_ranks != pp:
        raise PiperConfigError(key, schedule.name, f"a schedule for pp={pp} ranks, not {schedule.num_ranks}")
    if schedule.num_stages % pp:
        raise PiperConfigError(key, schedule.name, f"the same number of stages on every rank "
                                                   f"({schedule.num_stages} stages on {pp} ranks)")
    per_rank = [schedule.stages_of(r) for r in range(pp)]
    if len({len(stages) for stages in per_rank}) != 1:
        raise PiperConfigError(key, schedule.name, f"the same number of stages on every rank, got {per_rank}")
    return schedule, schedule.num_microbatches, schedule.num_stages // pp


# The strategies (`agreement_key`) every rank of each default process group agreed on: the
# group's, dropped with it.
_AGREED: weakref.WeakKeyDictionary[dist.ProcessGroup, set[tuple]] = weakref.WeakKeyDictionary()


def parse_options_on_all_ranks(options: Mapping[str, Any] | None, recompile: bool = False) -> Strategy:
    """`parse_options`, agreed by every rank before anything runs.

    If any rank's options are invalid, or ranks were given different
    strategies, every rank raises a `PiperConfigError` naming the offending
    rank, instead of the valid ranks going on into collectives that the
    failing rank will never join. Collective when a process group exists,
    but for the `recompile` of a model with a strategy its ranks agreed on
    before: that may be one rank's alone, its peers in their steps'
    collectives.
    """
    try:
        strategy, error = parse_options(options), None
    except PiperConfigError as e:
        strategy, error = None, e
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if error is not None:
            raise error
        return strategy
    agreed = _AGREED.setdefault(dist.group.WORLD, set())
    if recompile and strategy is not None and strategy.agreement_key() in agreed:
        return strategy
    mine = ("error", error.key, repr(error.value), error.valid) if error else ("ok", strategy.agreement_key())
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    for rank, theirs in enumerate(everyone):
        if theirs[0] == "error":
            if error is not None and rank == dist.get_rank():
                raise error
            raise PiperConfigError(theirs[1], theirs[2], f"(rank {rank}'s options) {theirs[3]}")
    keys = {theirs[1] for theirs in everyone}
    if len(keys) > 1:
        by_rank = ", ".join(f"rank {r}: {theirs[1]}" for r, theirs in enumerate(everyone))
        raise PiperConfigError(
            "options", dict(options or {}),
            f"every rank must pass the same strategy (dp, pp, ep, zero, bucket_mb, codegen, pipeline, units); got {by_rank}")
    agreed.add(strategy.agreement_key())
    return strategy
