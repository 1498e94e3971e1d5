"""The `piper` torch.compile backend.

`torch.compile(model, backend="piper", options=strategy)` hands the Dynamo
graph of `model` here. The options and the compiled arguments are checked at
once; on the step's first call, the graph is captured as a joint
forward/backward graph, run through the strategy passes, lowered to this rank's
program and compiled task by task, and the call runs the first training step.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import warnings
import weakref
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.weak import WeakIdKeyDictionary

from . import plan_cache
from .arguments import batch_key, check_batches_agree, check_one_device
from .compiled_holdings import pipeline_readers, record_compiled_holdings, release_other_stages
from .capture import batch_shapes, call_sizes, capture, keep_input_sources, reads_state, symbolic_inputs
from .codegen import compile_program, fewest_regions, prepare, warm_up
from .compat import compile_fx, dynamo_trace_seconds, maybe_mark_dynamic
from .compile_stats import CompileStats, record
from .debug import DebugDump
from .gradient_sync import after_window, unsynced, window_state
from .ir import HELD_ROLES, InputRole, TrainingDAG
from .options import Strategy, parse_options_on_all_ranks
from .outputs import return_arguments_themselves, returned_numbers, returned_values
from .passes import dump_path, run_passes
from .passes.functionalize_random import step_randomness
from .passes.reduce_gradients import reduces_held_gradients
from .philox import attach_stream, stream_of
from .plan_cache import Plan, plan_of
from .prepare import check_prepared
from .runtime.executor import ProgramExecutor
from .runtime.held_gradients import GradientReduction
from .runtime.step import CompiledStep
from .schedules import svg, text_grid
from .sharding.dtensor_params import parameter_records, stood_for
from .sharding.mesh import dp_group_name, expert_replica_group_name, group_names
from .sharding.replicas import broadcast_from_first_replica
from .sharding.specs import placement_table
from .sharding.units import find_units
from .verify import verification_enabled


def plan(gm: fx.GraphModule, example_inputs: list, strategy: Strategy, dump: DebugDump | None = None,
         stats: CompileStats | None = None, kept_holders: dict[int, tuple[int, ...]] | None = None) -> TrainingDAG:
    """Capture `gm` and run the strategy passes: the DAG with the programs of this
    rank's pipeline (every rank with `strategy`'s data-parallel index). Needs the
    process group only for group names, so a fake one plans any world size.
    `kept_holders`: by argument index, the pipeline ranks an earlier compile of the
    model put each parameter on, which the split into stages keeps (`pipeline_readers`).
    Times capture and each pass into `stats`."""
    dump = dump or DebugDump(None, strategy.rank)
    stats = stats if stats is not None else CompileStats()
    dump.write("00_dynamo_graph.py", gm.print_readable(print_output=False))
    with stats.phase("capture"):
        dag = capture(gm, example_inputs, strategy, dp_group_name(strategy))
    dag.kept_holders = {i.name: (kept_holders or {})[i.arg_index] for i in dag.inputs
                        if i.arg_index in (kept_holders or {})}
    dump.write("01_joint_graph.py", dag.joint.print_readable(print_output=False))
    # At every ZeRO level, so a `units` pattern naming no module is an error on every rank whatever the strategy.
    dump.write("units.txt", find_units(dag).render())
    stats.lap("dumps")

    def after_pass(index: int, name: str, dag: TrainingDAG) -> None:
        stats.lap(f"pass:{name}")
        if not dump.enabled:
            return
        tasks = {t.name: t for t in dag.tasks}
        for program in dag.programs.values():  # and the fused tasks of overlapped pairs
            tasks.update(program.tasks)
        if tasks:
            text = "\n".join(f"# ---- task {t.name}\n{t.graph.print_readable(print_output=False)}"
                             for t in tasks.values())
        else:
            text = dag.joint.print_readable(print_output=False)
        dump.write(dump_path(index, name), text)
        if name == "propagate_placements":
            dump.write("placement_table.txt", placement_table(dag.joint.graph))
        stats.lap("dumps")

    return run_passes(dag, strategy, after_pass)


def planned_step(gm: fx.GraphModule, example_inputs: list, strategy: Strategy, dump: DebugDump,
                 stats: CompileStats) -> Plan:
    """This rank's plan of the step: loaded from the plan cache (`plan_cache`) when a compile
    of the same graph, inputs and strategy (and pipeline ranks kept for the parameters,
    `pipeline_readers`) made it before, in this process or another; planned now (`plan`)
    and stored there otherwise. Builds the strategy's process groups first, collectively:
    every rank, whether it finds its plan or not."""
    groups = group_names(strategy)
    kept = pipeline_readers(example_inputs, strategy)
    key = plan_cache.plan_key(gm, example_inputs, strategy, groups, kept) if plan_cache.enabled() else None
    if key is not None:
        with stats.phase("plan cache"):
            cached = plan_cache.load(key)
        if cached is not None and (cached.dumps is not None or not dump.enabled):
            stats.plan = "cache hit"
            with stats.phase("dumps"):  # those planning wrote, as it wrote them
                for path, text in (cached.dumps or {}).items() if dump.enabled else ():
                    dump.write(path, text)
            return cached
    dump.recorded = {} if dump.enabled and key is not None else None
    dag = plan(gm, example_inputs, strategy, dump, stats, kept)
    planned = plan_of(dag, strategy.rank, dump.recorded)
    with stats.phase("codegen prepare"):
        prepare(planned.program, strategy.codegen)
    dump.recorded = None
    if key is not None:
        with stats.phase("plan cache"):
            plan_cache.store(key, planned, strict=verification_enabled(strategy))
        stats.plan = "planned, cached"
    return planned


# The youngest generation's threshold while a step compiles (Python's default is 700): a
# compile makes hundreds of thousands of objects, most of them kept to its end, and at 700
# the collector went over them again and again (a 24-block ZeRO-3 cold compile spent 0.8-1.1 s
# in collections at 700, 0.4 s at 10,000, and held as much: peak RSS 603-612 MB and 604-616).
COMPILE_GC_THRESHOLD = 10_000


@contextlib.contextmanager
def _collecting_only_new_objects() -> Iterator[int]:
    """While inside, the cyclic garbage collector scans only the objects made since it was
    entered, and less often: those the process held already (torch's modules, the model,
    Dynamo's trace) are frozen (`gc.freeze`), and thawed into the oldest generation after,
    and the youngest generation collects after `COMPILE_GC_THRESHOLD` allocations. Yields how
    many were frozen. A compile makes hundreds of thousands of objects, so it sets off full
    collections, each of which would scan the whole process (on this project's machine,
    a 12-block ZeRO-3 cold compile spent 1.2-1.3 s in 4 of them, 0.7 s in 9 since). Where
    the process froze objects itself (say before forking data loader workers), nothing is
    frozen: thawing would thaw those too. Like `torch.distributed.checkpoint.state_dict`,
    which turns the collector off while it builds a state dict; here the compile's own
    garbage is still collected."""
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], COMPILE_GC_THRESHOLD), *thresholds[1:])
    try:
        if gc.get_freeze_count():
            yield 0
            return
        gc.freeze()
        try:
            yield gc.get_freeze_count()
        finally:
            gc.unfreeze()
    finally:
        gc.set_threshold(*thresholds)


# The parameters of every model compiled in this process, each with the batch shapes its model's
# steps were compiled for (one set per model). A model's first compile is every rank's at once
# (its first call); a later one (another batch shape, a recompile) may be one rank's alone, and
# exchanges nothing with its peers (`codegen.shared`, the options' agreement) but, for a batch
# shape new to it, with the ranks of its pipeline and expert groups, which compile for that
# shape at the same call (`check_batches_agree`).
_COMPILED = parameter_records()


def _compiled_before(arguments: list) -> bool:
    """Whether a step of the model whose parameters are among `arguments` was compiled."""
    return _batches_compiled_for(arguments) is not None


def _batches_compiled_for(arguments: list) -> set[tuple] | None:
    """The batch shapes (`arguments.batch_key`) steps of the model whose parameters are among
    `arguments` were compiled for; None if none was."""
    return next((_COMPILED[t] for t in arguments if isinstance(t, torch.Tensor) and t in _COMPILED), None)


def _whole_on_every_rank(gm: fx.GraphModule, example_inputs: list, strategy: Strategy) -> Callable:
    """A graph that reads no parameter or buffer (`reads_state`), as Dynamo traced it or compiled
    by Inductor as `torch.compile` compiles it, run whole.

    Each size Dynamo made symbolic in a tensor it returns stays dynamic where that tensor goes
    on: the graph after a break takes it as an argument of the model's (ProphetNet's shifted
    decoder inputs), which Dynamo would see at a fixed size, as the first call's. The batch's
    size then reaches the model's graph as a SymInt, as `prepare` marks it on the module's
    arguments, so that a pipeline's can be traced at microbatch size (`capture`)."""
    run = gm.forward if strategy.codegen == "eager" else compile_fx(gm, example_inputs)
    dynamic = [(index, [dim for dim, size in enumerate(value.shape) if isinstance(size, torch.SymInt)])
               for index, value in enumerate(returned_values(gm)) if isinstance(value, torch.Tensor)]
    dynamic = [(index, dims) for index, dims in dynamic if dims]
    if not dynamic:
        return run

    def run_keeping_sizes_dynamic(*args):
        returned = run(*args)
        for index, dims in dynamic:
            maybe_mark_dynamic(returned[index], dims)
        return returned
    return run_keeping_sizes_dynamic


def piper_backend(gm: fx.GraphModule, example_inputs: list, options: Mapping[str, Any] | None = None):
    """Dynamo's backend: validates the options (on all ranks together, but at a recompile of a
    model compiled before: `_compiled_before`) and the compiled arguments, starts the code
    generator's warm-up, and returns the step, which plans and compiles itself on its first
    call (`DeferredStep`).

    A graph that reads no parameter or buffer (`reads_state`: batch preprocessing that a graph
    break cut off the model, as ProphetNet's decoder inputs, shifted and asserted on with
    `.item()`; a loss function compiled alone) has nothing for the strategy to lay out, reduce
    or pipeline: every rank runs it whole, as the code around torch.distributed.pipelining's
    stages runs, with the options' code generator (Inductor, as `torch.compile` compiles it)."""
    stats = CompileStats(dynamo_trace_s=dynamo_trace_seconds())
    keep_input_sources(gm)  # which inputs are buffers: Dynamo forgets once it is done with the frame
    # The compiled call's arguments as the step sees them: the parameters where Dynamo traced
    # their program placeholders (`dtensor_params`; capture and the plan's key read those
    # as such). The step stands them in on every call.
    arguments = [stood_for(t) for t in example_inputs]
    strategy = parse_options_on_all_ranks(options, recompile=_compiled_before(arguments))
    if not reads_state(gm, arguments):
        DebugDump(strategy.debug_dir, strategy.rank).write("00_dynamo_graph.py", gm.print_readable(print_output=False))
        return _whole_on_every_rank(gm, example_inputs, strategy)
    themselves = return_arguments_themselves(gm)  # a buffer an out= op wrote, which Dynamo's code sets again
    check_prepared(strategy, arguments, example_inputs)
    device = check_one_device(arguments)
    dump = DebugDump(strategy.debug_dir, strategy.rank)  # named by Dynamo's compile id, known only now
    warming = warm_up(strategy.codegen, device)  # in the background, while Dynamo ends and the step is planned
    sized = symbolic_inputs(gm, example_inputs)
    parameters = tuple(i for i, t in enumerate(example_inputs) if isinstance(t, nn.Parameter))
    return DeferredStep(_StepBuilder(gm, example_inputs, strategy, device, dump, warming, stats, sized, themselves),
                        sized, parameters, reduces=bool(parameters) and strategy.dp > 1,
                        adds_held=reduces_held_gradients(strategy))


# How many batch shapes a frame compiles steps for before each new one warns (Dynamo's default
# `recompile_limit`, past which it stops compiling a frame anew).
MANY_SHAPES = 8


class DeferredStep:
    """What Dynamo calls for the compiled frame: on the first call, plans and compiles the step
    (`_compile`), then runs it; `step` is the `CompiledStep` from then on.

    Why not in the backend: after a backend returns, Dynamo builds the frame's guards and
    times them once, after flushing the CPU's caches with a 32 MB buffer of its own
    (`profile_guard_manager`). Planned and compiled in the backend, the step's compile was
    held beside that buffer, and the two set the process's peak RSS (ZeRO-3 on 2 CPU ranks,
    the example GPT: 379 MB held, 411 MB peak warm; 404 and 436 MB cold). Compiled here, what
    Dynamo's compile holds is its trace alone. Every rank calls the step as soon as Dynamo
    has compiled its frame, as it did the backend, so the ranks' collectives while planning
    keep their order, and a compile's errors are raised from the same first call.

    A frame whose sizes Dynamo made symbolic (`sized`: the batch's, which `prepare` marks
    dynamic under a pipeline and Dynamo makes so once a call changed it, a last smaller batch
    say) serves every batch shape, where a step runs one: a call of shapes no step was compiled
    for compiles one, kept for the next call of those shapes (as Dynamo keeps a static frame's
    code per shape). All of them draw from the model's one random stream (`philox.stream_of`).

    A step is a model's: compiling it lays out what the rank holds of that model's parameters
    and buffers (under a pipeline, it lets go of those of other stages) and records how. Dynamo
    runs a frame compiled for one instance of a module class for another of the same class
    (it guards the parameters' types and shapes, not which they are), so the step checks its
    call's first parameter (`anchor`, the argument's index) and compiles a step of its own for
    a model it has not seen, as for a shape; each model's steps live as long as the model (the
    steps of the model called last too: `_forget` lets go of them when it dies).

    A training call reading a parameter whose gradient synchronization is off
    (`piper_fx.no_sync`) runs a step planned without gradient reductions instead; the first call
    after a window, which reduces what the window held, a step planned to add those to its own
    gradients before reducing them (where the strategy allows it, `adds_held`; else the one
    without reductions). Each is compiled at the first such call of its batch shape and kept
    beside the others (`_variant`); with one replica (dp = 1) there is nothing to hold back,
    and the parameters' synchronization is not looked up.

    Slotted: Dynamo wraps the step in a function that copies the step's `__dict__` into its
    own (`functools.wraps`), which would keep the build for the life of the compiled frame
    by another reference. The builder keeps Dynamo's graph for the shapes and models to come."""

    __slots__ = ("_build", "_sized", "_parameters", "_anchor", "_reduces", "_adds_held", "_models", "_model",
                 "_steps", "step", "__weakref__")

    def __init__(self, build: Callable[..., CompiledStep], sized: tuple[int, ...],
                 parameters: tuple[int, ...] = (), reduces: bool = False, adds_held: bool = False):
        self._build = build
        self._sized = sized
        self._parameters = parameters  # the arguments that are the model's parameters (their placeholders)
        self._anchor = parameters[0] if parameters else None
        self._reduces = reduces  # whether the step reduces gradients (dp > 1), which `no_sync` holds back
        self._adds_held = adds_held  # whether a step can add a window's held gradients before reducing
        self._models = WeakIdKeyDictionary()  # each model's anchor argument -> its steps
        self._model: Callable[[], Any] | None = None  # the anchor argument of the model of `_steps`, weakly
        self._steps: dict[tuple, CompiledStep] = {}  # by the sizes of the call they were compiled for (() without)
        self.step: CompiledStep | None = None

    @staticmethod
    def _forget(deferred: "weakref.ref[DeferredStep]", model: weakref.ref) -> None:
        """Let go of the steps of the model called last once it has died (the frame, and this,
        live on for the models to come)."""
        self = deferred()
        if self is not None and self._model is model:
            self._model, self._steps, self.step = None, {}, None

    def __call__(self, *args):
        if self._anchor is not None and (self._model is None or self._model() is not args[self._anchor]):
            self._steps = self._models.setdefault(args[self._anchor], {})
            self._model = weakref.ref(args[self._anchor], functools.partial(DeferredStep._forget, weakref.ref(self)))
            self.step = self._steps.get(()) if not self._sized else None
        if self._reduces and torch.is_grad_enabled():
            window = window_state(args[i] for i in self._parameters)
            if window is not None:
                return self._variant(args, "after_no_sync" if window == "held" and self._adds_held else "no_sync")
        if not self._sized:
            if self.step is None:
                self.step = self._steps[()] = self._build(args, ())
            return self.step(*args)
        key = tuple(args[i] if isinstance(args[i], int) else tuple(args[i].shape) for i in self._sized)
        step = self._steps.get(key)
        if step is None:
            if len(self._steps) == MANY_SHAPES:
                warnings.warn(f"piper_fx: this compiled model has compiled a step for each of {MANY_SHAPES} batch "
                              f"shapes, and compiles one for each new shape ({key}): pad batches to a few fixed "
                              "shapes", stacklevel=2)
            step = self._steps[key] = self._build(args, key)
        self.step = step
        return step(*args)

    def _variant(self, args: tuple, variant: str):
        """Run the step of a window's calls, `variant` (`_StepBuilder.VARIANTS`), compiled at
        the model's first call of that variant, per batch shape."""
        key = (variant, tuple(args[i] if isinstance(args[i], int) else tuple(args[i].shape) for i in self._sized))
        step = self._steps.get(key)
        if step is None:
            step = self._steps[key] = self._build(args, key[1], variant)
        return step(*args)


class _StepBuilder:
    """Compiles a frame's steps (`_compile`): the first for the call Dynamo compiled the frame
    for, with what the backend made for it (Dynamo's examples, the compile's stats, the code
    generator's warm-up, the dump named by the frame), then each later one (another batch
    shape, another model) for its own call, whose arguments are its examples, into a dump
    beside the first's.
    Keeps Dynamo's graph for those, not the examples, which are the model's parameters: the
    compiled frame keeps nothing of the model alive."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list, strategy: Strategy, device: torch.device | None,
                 dump: DebugDump, warming, stats: CompileStats, sized: tuple[int, ...],
                 themselves: list[tuple[int, int]]):
        self.gm, self.strategy, self.device, self.dump, self.sized = gm, strategy, device, dump, sized
        self.themselves = themselves  # the outputs that are arguments (`return_arguments_themselves`)
        self.first: tuple | None = (example_inputs, warming, stats)
        self.later = 0  # steps compiled since the first

    # A window's steps: its calls' (`piper_fx.no_sync`), without gradient reductions, and its first
    # call's after it, which adds what the window held to its gradients before reducing them.
    VARIANTS = {"no_sync": unsynced, "after_no_sync": after_window}

    def __call__(self, args: tuple, sizes: tuple, variant: str | None = None) -> CompiledStep:
        """The step for the call of `args`, whose `sizes` (those of its `sized` arguments) name a
        later step's dump, numbered; the window's `variant` of it, if named (`VARIANTS`)."""
        strategy = self.strategy if variant is None else self.VARIANTS[variant](self.strategy)
        if self.first is not None:
            (example_inputs, warming, stats), self.first = self.first, None
            return _compile(self.gm, _at_call_sizes(example_inputs, args, self.sized), strategy, self.device,
                            self.dump, warming, stats, self.themselves)
        self.later += 1
        name = "_".join(str(size) if isinstance(size, int) else "x".join(map(str, size)) for size in sizes)
        name = f"step_{self.later}" + (f"_sizes_{name}" if name else "") + (f"_{variant}" if variant else "")
        return _compile(self.gm, list(args), strategy, self.device, self.dump.beside(name),
                        warm_up(self.strategy.codegen, self.device), CompileStats(), self.themselves)


def _at_call_sizes(example_inputs: list, args: tuple, sized: tuple[int, ...]) -> list:
    """`example_inputs` with each of the `sized` ones (`capture.symbolic_inputs`) replaced by
    the call's argument: a size input by the call's size, a batch by the call's batch, so the
    step is planned for the shapes it is called with."""
    examples = list(example_inputs)
    for index in sized:
        examples[index] = args[index]
    return examples


def _compile(gm: fx.GraphModule, example_inputs: list, strategy: Strategy,
             device: torch.device | None, dump: DebugDump, warming, stats: CompileStats,
             themselves: list[tuple[int, int]]) -> CompiledStep:
    """The step, planned and compiled, returning the arguments `themselves` names. Torch's random
    state (the CPU's generator, and the model's device's) is put back after, as Dynamo puts it
    back around a backend: a compile draws the dropout seed from it (`philox.draw_seed`) without
    moving the stream the training loop draws from."""
    accelerator = device is not None and device.type not in ("cpu", "meta")
    random_state_kept = torch.random.fork_rng(devices=[device] if accelerator else [],
                                              device_type=device.type if accelerator else None)
    with random_state_kept, _collecting_only_new_objects() as frozen, stats.collections(frozen):
        return _compile_step(gm, example_inputs, strategy, device, dump, warming, stats, themselves)


def _compile_step(gm: fx.GraphModule, example_inputs: list, strategy: Strategy, device: torch.device | None,
                  dump: DebugDump, warming, stats: CompileStats, themselves: list[tuple[int, int]]) -> CompiledStep:
    """The step planned and compiled for `example_inputs` (static where the call's sizes
    replaced Dynamo's symbols), its random ops drawing from the model's stream: the one an
    earlier compile of the model started (`philox.stream_of`), or a new one."""
    arguments = [stood_for(t) for t in example_inputs]
    # Each program placeholder's argument index, with whether its parameter requires grad now.
    placeholders = {i: argument.requires_grad for i, (t, argument) in enumerate(zip(example_inputs, arguments))
                    if argument is not t}
    # The model's first compile is every rank's at once; a later one checks a batch shape new to
    # this rank (not a recompile for a parameter's `requires_grad`, which may be this rank's alone).
    batches, compiled_for = batch_shapes(gm, example_inputs), _batches_compiled_for(arguments)
    together = compiled_for is None
    if together or batch_key(batches) not in compiled_for:
        check_batches_agree(strategy, batches, together)
    planned = planned_step(gm, example_inputs, strategy, dump, stats)
    # Replicated parameters and buffers the model was compiled with, without
    # `prepare`: start every replica from the first one's values, as DDP does.
    replicated = [i.arg_index for i in planned.inputs if i.role in (InputRole.PARAM, InputRole.BUFFER)]
    broadcast_from_first_replica([arguments[i] for i in replicated], planned.dp_group)
    record_compiled_holdings(planned, arguments, strategy)
    release_other_stages(planned, arguments, strategy)
    program = planned.program
    dump.write("program.txt", program.render())
    dump.write("schedule.txt", text_grid(planned.schedule))
    dump.write("schedule.svg", svg(planned.schedule))
    parameters = [arguments[i.arg_index] for i in planned.inputs if i.role in (InputRole.PARAM, InputRole.PARAM_SHARD)]
    # The executor reads what it needs of the task graphs (the bytes of their collectives, their
    # memory) before code generation: Inductor rewrites a graph it compiles in place, which only
    # the rank compiling a task does (`codegen.shared`), and a cache hit does not.
    executor = ProgramExecutor(program, {}, device)
    executor.compiled = compile_program(program, strategy.codegen, dump, stats, time_waits=strategy.profile,
                                        warmed=warming, fewest=fewest_regions(strategy.regions, device),
                                        together=together)
    compiled_for = compiled_for or set()
    compiled_for.add(batch_key(batches))
    _COMPILED.update((p, compiled_for) for p in parameters)
    dump.write("compile_stats.txt", stats.render())
    record(stats)

    randomness = step_randomness(planned.randomness, strategy, stream_of(parameters))
    if randomness is not None:  # the model's dropout stream, which checkpoints save and restore
        attach_stream(parameters, randomness)
    seed_shape, seed_dtype, seed_device = planned.seed or (None, None, None)
    num_user_outputs = len(gm.graph.find_nodes(op="output")[0].args[0])
    # The step checks the placements of the DTensor parameters and buffers itself, by identity:
    # Dynamo traced and guards their placeholders, plain tensors.
    specs = {i.arg_index: arguments[i.arg_index]._spec for i in planned.inputs
             if i.role in HELD_ROLES and isinstance(arguments[i.arg_index], DTensor)}
    # How the window's steps reduce what it held: after the program, or in it (`takes_held`) and
    # only then for a gradient the program's cannot stand for (`held_gradients.given_back`).
    reduction = GradientReduction(strategy.zero, planned.dp_group, strategy.mixed_precision.reduction_dtype,
                                  int(strategy.bucket_mb * 2**20), strategy.ep > 1,
                                  expert_replica_group_name(strategy))
    return CompiledStep(
        executor, planned.inputs, planned.outputs,
        seed_shape, seed_dtype, seed_device,
        num_user_outputs,
        {i.arg_index: tuple(arguments[i.arg_index].shape) for i in planned.inputs
         if i.role is InputRole.INPUT},
        dump,
        randomness=randomness,
        specs=specs,
        placeholders=placeholders,
        themselves=themselves,
        numbers=returned_numbers(gm, call_sizes(gm, example_inputs)),
        holds=None if strategy.gradient_sync or strategy.dp == 1 else reduction,
        takes_held=reduction if strategy.adds_held_gradients else None,
        broadcasts=planned.dp_group if strategy.broadcast_buffers and strategy.dp > 1 and any(
            i.role is InputRole.BUFFER for i in planned.inputs) and any(
            i.role in (InputRole.PARAM, InputRole.PARAM_SHARD) for i in planned.inputs) else None,
    )


def register() -> None:
    """Register `backend="piper"` on import.

    When Dynamo found the `torch_dynamo_backends` entry point first, it registers
    the backend itself right after importing us, so we must not do it twice.
    """
    from .compat import _BACKENDS, _COMPILER_FNS, register_backend
    if "piper" not in _BACKENDS and "piper" not in _COMPILER_FNS:
        register_backend(compiler_fn=piper_backend, name="piper")
