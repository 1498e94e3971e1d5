"""The callable handed back to Dynamo: one whole training step per call.

A training call splits every batch argument into the program's microbatches
(along dim 0), runs the rank's whole program (all forwards, backwards, sends,
receives and collectives), each microbatch seeded with d(loss)/d(loss_m) = 1/M,
and returns the replica's loss (the mean over microbatches) attached to
autograd through `_StepFunction`. `loss.backward()` then hands each input its
gradient scaled by the incoming seed (gradients are linear in it), so
`(2 * loss).backward()` and accumulation over several calls behave as in
PyTorch: a DTensor parameter's is added into its `.grad` by the step itself, as
FSDP2 does, unless autograd must deliver it (`torch.autograd.grad`,
`backward(inputs=...)`, gradient hooks; `_hand_over`). The model's other
outputs come back as it made them, the rank's microbatches' concatenated along
dim 0 (a pipeline's on the rank whose stage makes them); one the model made
with a gradient (logits beside a Hugging Face model's loss, say) is returned
attached, and a gradient flowing back into it is a `PiperError`: the step
differentiates the loss alone. Inputs without a gradient
on this rank (parameters of stages it does not hold, non-differentiable inputs)
keep `grad is None`.

A call whose batch arguments differ from those the step was compiled for (type,
device, dtype, shape) is a `PiperError` saying what was expected, raised
before anything runs. It is recorded for the other ranks like any failure of
the step (`failures`), so peers already running name this rank.
"""
from __future__ import annotations

import json
import time
import weakref
from typing import Callable, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor

from ..compat import DTensorSpec, has_grad_hooks, leaf_use, local_tensor
from ..debug import DebugDump
from ..errors import PiperError
from ..gradient_sync import held_gradients, requires_sync
from ..ir import HELD_ROLES, GraphInput, GraphOutput, InputRole, OutputRole
from ..philox import StepRandomness
from ..sharding.dtensor_params import accumulate_grad, parameter_grad, parameter_records, program_tensor, stood_for
from ..sharding.holdings import is_stored
from ..sharding.replicas import broadcast_buffers
from . import failures
from .executor import ProgramExecutor, StepRun
from .held_gradients import GradientReduction, Taken, given_back, held_until_synced, is_one_on_host, take_into_program
from .memory import (optimizer_state_bytes, optimizer_state_version, record_optimizer_state, storage_bytes,
                     storage_key)

TRACED_STEPS = 2  # the first steps' traces go to the dumps; the second (warm) one stays

# The run of whichever compiled step ran last in this process: what
# `last_step_stats()` describes. Each step keeps its own (`CompiledStep.last_run`);
# this only points at the latest, so the functions need no step object.
_latest_run: StepRun | None = None


def last_step_stats() -> dict:
    """Stats of the last step (program run) on this rank, whichever compiled step ran it:

    - `step_s`: wall time of the program; `compute_s`: time in tasks, less the
      collective waits inside them; `comm_wait_s`: time blocked on
      communication (receives, collectives' waits, sends at the end, and
      issuing sends and receives, which under gloo writes their bytes), i.e.
      the exposed communication, and `exposed_comm_fraction` = comm_wait_s / step_s;
      `comm_wait_s_by_kind` splits comm_wait_s by what was waited for
      (`all_to_all`, `all_gather`, ..., `recv`, `send`, `p2p issue`).
      `runtime_s` = step_s - compute_s - comm_wait_s, the runtime's own work
      (its instruction loop, freeing values, memory accounting), and
      `runtime_fraction` = runtime_s / step_s;
    - `step_call_s`: host seconds of the compiled step's own work around its
      program: in the call (checking the arguments and the parameters'
      placements, splitting the batch, the memory parts held, the outputs) and
      in `loss.backward()` (scaling the gradients and handing them over; none
      before it ran), and `overhead_fraction` = (runtime_s + step_call_s) /
      (step_s + step_call_s), all of piper_fx's own share of the step (on a GPU
      the host's work overlaps the device's, and this overstates it).
      Waits inside tasks are timed only with the option `profile`; without
      it they count as compute;
    - `comm_bytes`: bytes this rank contributes per collective kind
      (`all_gather`, `reduce_scatter`, `all_reduce`, `all_to_all`) and sent
      point to point (`send`), with, at the last call of a `piper_fx.no_sync`
      window, those of the window's reduction (once its backward ran), and with
      the option `broadcast_buffers`, the buffers broadcast before the call
      (`broadcast`: the first replica's sent, the others' received);
    - `peak_activation_bytes`: the most bytes of per-microbatch values the
      program made (activations saved for backward, received tensors) held at once;
    - `memory`: where this rank's memory went at the step's peak, in bytes: its
      `peak` and the parts that add up to it (`runtime.memory.MEMORY_PARTS`):
      `parameters`, `optimizer_state`, `gradients`, `activations`,
      `communication_buffers`, `task_temporaries`. Counted value by value as the
      program runs, on its runs until two in a row count the same (a program makes
      the same values every step), and from then on that count with what the step
      holds now (parameters, optimizer state, earlier gradients, with those a
      `piper_fx.no_sync` window holds); what a task holds
      inside itself is estimated from its graph;
    - `instructions`: the program's length; `p2p_batches`: how many
      `dist.batch_isend_irecv` calls its sends and receives went out in (each
      run of them back to back in the program is one).

    Empty before any step ran. A step's own last run is `CompiledStep.last_run`.
    """
    return dict(_latest_run.stats) if _latest_run is not None else {}


def last_step_trace() -> dict:
    """The last step on this rank as a Chrome / Perfetto trace (a JSON-able dict)."""
    return _latest_run.trace() if _latest_run is not None else {"traceEvents": []}


class _ProgramReads:
    """What the program reads for a step's parameters and buffers (`program_tensor`: a
    DTensor's local tensor or its padded rows, a plain tensor itself), remembered from one
    call to the next, where reading them anew cost 2.5 microseconds a ZeRO-3 parameter (a
    weak dictionary's lookup and a storage comparison: 0.7 ms a step on a GPT of 24 blocks).
    A read stands while its argument is the same object and, for a DTensor, holds the same
    local tensor at the same address; a padded copy (the parameter's memory was replaced
    since `prepare`) is copied anew on every call. The step keeps nothing of the model
    alive, and no weak reference to a parameter either (`Module._apply`'s swap of a DTensor
    parameter refuses one): a parameter by its `id`, tensors weakly. `version` changes
    whenever the reads do."""

    def __init__(self):
        self.entries: list[tuple] | None = None  # per argument: (its id, its local tensor, address, its read)
        self.version = 0

    def __call__(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        entries = self.entries
        if entries is not None and len(entries) == len(parameters):
            tensors = []
            for parameter, (owner, local, address, read) in zip(parameters, entries):
                if id(parameter) != owner:
                    break
                if local is not None:
                    now = local_tensor(parameter)
                    if now is not local() or now.data_ptr() != address:
                        break
                    tensors.append(read())
                else:
                    tensors.append(parameter)
            else:
                return tensors
        return self._read_anew(parameters)

    def _read_anew(self, parameters: list[torch.Tensor]) -> list[torch.Tensor]:
        self.version += 1
        tensors = [program_tensor(p) for p in parameters]
        entries = []
        for parameter, tensor in zip(parameters, tensors):
            if not isinstance(parameter, DTensor):  # read as it is
                entries.append((id(parameter), None, 0, None))
                continue
            local = local_tensor(parameter)
            try:
                address = local.data_ptr()
                copied = tensor is not local and storage_key(tensor) != storage_key(local)
            except RuntimeError:  # a tensor without storage (a tensor subclass): read at every call
                copied = True
            if copied:  # (a padded copy is made anew at every call)
                self.entries = None
                return tensors
            entries.append((id(parameter), weakref.ref(local), address, weakref.ref(tensor)))
        self.entries = entries
        return tensors


# Each model whose buffers its calls broadcast (`broadcast_buffers`), by its first parameter:
# whether its next call broadcasts them (`CompiledStep._broadcast_buffers`).
_BROADCAST_NEXT = parameter_records()


class CompiledStep:
    def __init__(self, executor: ProgramExecutor, inputs: Sequence[GraphInput], outputs: Sequence[GraphOutput],
                 seed_shape: torch.Size | None, seed_dtype: torch.dtype | None, seed_device: torch.device | None,
                 num_user_outputs: int,
                 batch_shapes: dict[int, tuple[int, ...]], dump: DebugDump | None = None,
                 randomness: StepRandomness | None = None, specs: dict[int, DTensorSpec] | None = None,
                 placeholders: Mapping[int, bool] | None = None, themselves: Sequence[tuple[int, int]] = (),
                 numbers: Sequence[tuple[int, object]] = (), holds: GradientReduction | None = None,
                 takes_held: GradientReduction | None = None, broadcasts: str | None = None):
        self.executor = executor
        # Given for the program without gradient reductions (`piper_fx.no_sync`): its gradients
        # are held in the model's window, and reduced so at the window's last call.
        self.holds = holds
        # Given for the program of a window's first call after it, which reduces what the window
        # held with its own gradients (`InputRole.HELD_GRAD`): each held gradient's program key,
        # its parameter's argument index, and the (dtype, device) it is read in.
        self.takes_held = takes_held
        self.held_inputs = [((i.name, None), i.held_for, *executor.compiled_tensors[i.name])
                            for i in inputs if i.role is InputRole.HELD_GRAD]
        # DDP's `broadcast_buffers=True`: the dp group (its name) whose first rank's buffers every
        # replica takes before a call (`_broadcast_buffers`).
        self.broadcasts = broadcasts
        self.randomness = randomness  # feeds the graph's random ops (`InputRole.RNG`), if it has any
        self.dump = dump
        self.steps_run = 0
        self.last_run: StepRun | None = None  # this step's latest run: its stats and timeline
        # The program is compiled for these argument shapes; with a pipeline
        # Dynamo sees the batch size as symbolic and would not recompile for another.
        self.batch_shapes = batch_shapes
        self.inputs = list(inputs)
        # The argument that is the model's first parameter, which stands for the model in
        # `_BROADCAST_NEXT`, and those that are its buffers.
        self.model_key = next((i.arg_index for i in self.inputs if i.role in (InputRole.PARAM, InputRole.PARAM_SHARD)),
                              None)
        self.buffer_indices = [i.arg_index for i in self.inputs if i.role is InputRole.BUFFER]
        self.outputs = list(outputs)
        # The incoming gradient of each microbatch's loss, made where the loss is (the model's device).
        self.seed_shape, self.seed_dtype, self.seed_device = seed_shape, seed_dtype, seed_device
        self.num_user_outputs = num_user_outputs
        self.training = seed_shape is not None
        if self.training:
            record_optimizer_state()  # for the optimizer state part of the step's memory stats
        self.microbatches = executor.program.num_microbatches
        # Per batch argument that this rank's program reads: the (dtype, device) it was compiled for.
        tensors = executor.compiled_tensors
        self.batch_tensors = {i.arg_index: tensors[i.name] for i in self.inputs
                              if i.role is InputRole.INPUT and i.name in tensors}
        # The parameters and buffers (their program value's key, their argument's index): held throughout.
        held = [i for i in self.inputs if i.role in HELD_ROLES]
        self.held_keys, self.held_indices = [(i.name, None) for i in held], [i.arg_index for i in held]
        # Each per-microbatch input's program keys, one per microbatch, made once: the seeds
        # of the loss, the batch arguments' chunks (with the argument's index) and random words.
        by_microbatch = range(self.microbatches)
        self.seed_keys = [(i.name, m) for i in self.inputs if i.role is InputRole.TANGENT for m in by_microbatch]
        self.batch_keys = [(i.arg_index, [(i.name, m) for m in by_microbatch])
                           for i in self.inputs if i.role is InputRole.INPUT]
        self.rng_keys = [[(i.name, m) for m in by_microbatch] for i in self.inputs if i.role is InputRole.RNG]
        # The program's outputs by what the step does with them: the user's outputs (their
        # position) and the gradients (their argument's index). The buffers the forward
        # mutates are updated by the tasks themselves (`passes.update_buffers`).
        self.user_outputs = [(o.name, o.index, o.role is OutputRole.LOSS) for o in self.outputs
                             if o.role in (OutputRole.LOSS, OutputRole.OUTPUT)]
        # The outputs that are an argument itself, (output index, argument index): Dynamo's graph
        # returns None there (`outputs.return_arguments_themselves`), and the step the argument.
        self.themselves = list(themselves)
        # The outputs that are numbers, (output index, value) at this step's sizes: the program
        # returns none (`outputs.returned_numbers`).
        self.numbers = list(numbers)
        # Which output is the loss (`outputs.loss_index`; None in inference without one).
        self.loss_index = next((o.index for o in self.outputs if o.role is OutputRole.LOSS), None)
        # The outputs beside the loss that the model made with a gradient: (index, where made).
        self.attached = {o.index: o.made_at for o in self.outputs if o.role is OutputRole.OUTPUT and o.made_at}
        self.grad_outputs = [(o.name, o.index) for o in self.outputs if o.role is OutputRole.GRAD]
        # The DTensor spec each DTensor parameter or buffer was compiled with, by argument index:
        # checked on every call (Dynamo guards their plain program placeholders), by identity
        # while the argument keeps its spec object, by value when it has a new one.
        names = {i.arg_index: i.fqn or i.name for i in self.inputs}
        self.specs = [(index, names[index], spec) for index, spec in (specs or {}).items()]
        # The arguments Dynamo passes as program placeholders (`dtensor_params`), for which the
        # step takes the parameters they stand for: their name, and whether each one's parameter
        # required grad when the step was compiled (a parameter the loss does not read, an unused
        # pooler say, requires it and gets no gradient).
        self.placeholders = [(index, names[index], requires_grad)
                             for index, requires_grad in (placeholders or {}).items()]
        self._reads = _ProgramReads()  # what the program reads for the parameters and buffers
        self._held_key: tuple = ()  # what `_held` last counted its first two parts for, and those parts
        self._held_bytes: dict[str, int] = {}

    def _microbatches(self, arg: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # Its shape is the compiled one (`_check_arguments`), whose dim 0 capture checked divides.
        return arg.chunk(self.microbatches) if self.microbatches > 1 else (arg,)

    def _check_arguments(self, args: Sequence[torch.Tensor]) -> None:
        """Raise a `PiperError` for a batch argument unlike the one this step was compiled for,
        a DTensor parameter or buffer placed unlike the one it was compiled with, or a
        parameter whose `requires_grad` changed since."""
        for index, shape in self.batch_shapes.items():
            arg = args[index]
            if not isinstance(arg, torch.Tensor):
                raise PiperError(f"compiled argument {index} is a {type(arg).__name__}, but this step was "
                                 "compiled for a tensor")
            if index in self.batch_tensors:
                dtype, device = self.batch_tensors[index]
                if arg.device != device:
                    raise PiperError(f"compiled argument {index} is on device {arg.device}, but this step was "
                                     f"compiled for {device}: move it there (.to('{device}'))")
                if arg.dtype != dtype:
                    raise PiperError(f"compiled argument {index} has dtype {arg.dtype}, but this step was "
                                     f"compiled for {dtype}: convert it (.to({dtype}))")
            if tuple(arg.shape) != shape:
                raise PiperError(f"compiled argument {index} has shape {tuple(arg.shape)}, but this step "
                                 f"was compiled for {shape} (a step runs the shapes it was compiled for; the "
                                 "compiled model compiles a step for each batch shape Dynamo traced symbolic)")
        for position, (index, name, spec) in enumerate(self.specs):
            now = getattr(args[index], "_spec", None)
            if now is spec:
                continue
            if not isinstance(now, DTensorSpec) or not now._check_equals(spec):
                placed = f"is placed {now} on {now.mesh}" if isinstance(now, DTensorSpec) else "is not a DTensor"
                raise PiperError(f"compiled argument {index} ({name}) {placed}, but this step was compiled "
                                 f"for {spec} on {spec.mesh}: the step's collectives were planned from the "
                                 "placements `prepare` gave; to place it otherwise, prepare the model with "
                                 "other options and compile again")
            self.specs[position] = (index, name, now)  # an equal spec: checked by identity from now on
        for index, name, requires_grad in self.placeholders if self.training else ():
            if args[index].requires_grad != requires_grad:
                raise PiperError(f"compiled argument {index} ({name}) has requires_grad={not requires_grad}, but "
                                 f"this step was compiled for requires_grad={requires_grad}: the compiled model "
                                 "compiles anew for it at its next call")

    def sync_off(self, args: Sequence[torch.Tensor]) -> frozenset[int]:
        """Which of `args` (the call's, parameters stood in) have their gradient synchronization
        off (`piper_fx.no_sync`): of all the model's parameters, whether this rank computes
        their gradients or not, so that every rank records the same ones as held."""
        return frozenset(index for index, arg in enumerate(args) if not requires_sync(arg))

    def _held(self, parameters: list[torch.Tensor], tensors: list[torch.Tensor]) -> dict[str, int]:
        """The memory parts held throughout a step: the storage of the parameters and
        buffers (none for those of pipeline stages this rank does not run, released when
        the step was compiled) as the program reads them (`tensors`), their optimizer
        state, and their gradients from before (with those a `no_sync` window holds)."""
        # The first two parts change only with the parameters, the tensors the program reads of
        # them (`_ProgramReads.version`), or their optimizer state: counted again only then.
        key = (optimizer_state_version(), self._reads.version)
        if key != self._held_key:
            self._held_key = key
            self._held_bytes = {"parameters": storage_bytes(t for p, t in zip(parameters, tensors) if is_stored(p)),
                                "optimizer_state": optimizer_state_bytes(parameters)}
        held = held_gradients(parameters) if self.holds or self.takes_held else ()
        return {**self._held_bytes, "gradients": storage_bytes([*(p.grad for p in parameters), *held])}

    def run_program(self, args: Sequence[torch.Tensor]):
        """Run the program on the call's arguments: (user outputs, {arg index: grad}, {arg index:
        what it took of a window's held gradient}), each gradient as the program computes it (a
        DTensor parameter's: its padded local rows)."""
        global _latest_run
        started = time.perf_counter()
        call = failures.next_call()
        try:
            self._check_arguments(args)
        except PiperError as error:
            failures.raise_failure(error, self.executor.program.rank, call, "before running its step",
                                   started=False)
        values: dict = {}
        if self.seed_keys:
            seed = torch.full(self.seed_shape, 1.0 / self.microbatches, dtype=self.seed_dtype, device=self.seed_device)
            values.update(dict.fromkeys(self.seed_keys, seed))
        for index, keys in self.batch_keys:
            values.update(zip(keys, self._microbatches(args[index])))
        for keys in self.rng_keys:
            values.update(zip(keys, self.randomness.next_inputs(self.microbatches)))
        # The parameters and buffers, as the program reads them (a DTensor's padded local rows).
        parameters = [args[index] for index in self.held_indices]
        tensors = self._reads(parameters)
        values.update(zip(self.held_keys, tensors))
        held = self._held(parameters, tensors) if self.training else {}
        taken: dict[int, Taken] = {}
        for key, index, dtype, device in self.held_inputs:
            values[key], took = take_into_program(args[index], args[index].shape, dtype, device)
            if took is not None:
                taken[index] = took
        broadcast = self._broadcast_buffers(args) if self.broadcasts is not None else 0
        program_started = time.perf_counter()
        results, self.last_run = self.executor.run(values, call, held)
        program_ended = time.perf_counter()
        if broadcast:
            self.last_run.eager_bytes["broadcast"] = broadcast
        _latest_run = self.last_run
        self.steps_run += 1
        if self.dump is not None and self.dump.enabled and self.steps_run <= TRACED_STEPS:
            self.dump.write("trace.json", json.dumps(self.last_run.trace()))
        user_outputs: list[torch.Tensor | None] = [None] * self.num_user_outputs
        for name, index, loss in self.user_outputs:
            value = results.get(name)  # None where another pipeline rank makes it
            if value is not None:
                # The loss is summed over microbatches by the runtime: the replica's loss is their mean.
                user_outputs[index] = value / self.microbatches if loss and self.microbatches > 1 else value
        grads = {index: results[name] for name, index in self.grad_outputs if name in results}
        self.last_run.call_s = program_started - started + time.perf_counter() - program_ended
        return user_outputs, grads, taken

    def _broadcast_buffers(self, args: Sequence[torch.Tensor]) -> int:
        """Give this replica the first one's buffers (those of this rank's stages) where the
        model's previous call trained with gradient synchronization on, or this is its first, as
        DDP with `broadcast_buffers=True` does before a forward (its `require_forward_param_sync`,
        which each forward sets for the next): so the call after a `piper_fx.no_sync` window's
        first does not, and an evaluation after training reads the first replica's buffers on
        every replica. The bytes broadcast."""
        model = args[self.model_key]
        now = _BROADCAST_NEXT.get(model, True)
        _BROADCAST_NEXT[model] = self.training and not (self.holds is not None and self.sync_off(args))
        if not now:
            return 0
        buffers = [args[i] for i in self.buffer_indices if is_stored(args[i])]
        return broadcast_buffers(buffers, self.broadcasts) if buffers else 0

    def _stand_in(self, args: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """`args` with each program placeholder's parameter in its place. A placeholder follows
        its parameter's `requires_grad` (which Dynamo guards on it), so that a change since the
        step was compiled compiles it anew at the next call (this one rejects it,
        `_check_arguments`)."""
        args = list(args)
        for index, _, _ in self.placeholders:
            placeholder = args[index]
            parameter = args[index] = stood_for(placeholder)
            if parameter.requires_grad != placeholder.requires_grad:
                placeholder.requires_grad_(parameter.requires_grad)
        return args

    def __call__(self, *args: torch.Tensor):
        arguments = self._stand_in(args) if self.placeholders else args
        if not self.training:
            with torch.no_grad():
                user_outputs, _, _ = self.run_program(arguments)
        else:
            user_outputs = _StepFunction.apply(self, *arguments)
        if self.themselves or self.numbers:  # what the program does not return
            user_outputs = list(user_outputs)
            for index, argument in self.themselves:  # Dynamo's own: its code sets them on their modules again
                user_outputs[index] = args[argument]
            for index, number in self.numbers:
                user_outputs[index] = number
        return tuple(user_outputs)


class _StepFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, step: CompiledStep, *args: torch.Tensor):
        with torch.no_grad():
            user_outputs, grads, taken = step.run_program(args)
        ctx.grads, ctx.taken = grads, taken
        ctx.args = args
        ctx.run = step.last_run  # where the hand-over's time goes
        ctx.attached, ctx.loss_index = step.attached, step.loss_index
        ctx.holds, ctx.takes_held = step.holds, step.takes_held
        # Which parameters' gradients this call's backward holds rather than reduces: decided at
        # the call, as DDP's `no_sync` is (a forward inside the window whose backward runs after it holds).
        ctx.off = step.sync_off(args) if step.holds else frozenset()
        # Only the loss carries gradient; the others are plain values, but for those the model
        # made with a gradient, attached so that one reached in the backward is refused.
        ctx.mark_non_differentiable(*(value for index, value in enumerate(user_outputs) if index != step.loss_index
                                      and value is not None and index not in step.attached))
        ctx.set_materialize_grads(False)  # an output's gradient is None unless one flows into it
        return tuple(user_outputs)

    @staticmethod
    def backward(ctx, *seeds: torch.Tensor | None):
        reached = [index for index, grad in enumerate(seeds) if grad is not None and index != ctx.loss_index]
        if reached:
            index = reached[0]
            raise PiperError(
                f"a gradient reached the compiled model's output {index} ({ctx.attached.get(index, 'an output')}), "
                f"which piper_fx returns for reading: its step differentiates the loss (output {ctx.loss_index}) "
                "alone. Compute that term inside the model and add it to the loss it returns")
        loss_seed = seeds[ctx.loss_index]
        started = time.perf_counter()
        grads, ctx.grads = ctx.grads, None
        args, ctx.args = ctx.args, None
        if grads is None:
            raise RuntimeError("piper_fx: backward through the same compiled step twice; "
                               "the step's gradients were already delivered")
        # Scaled in place, in one foreach op: the program's gradients are the runtime's own,
        # and a copy of every one would be held beside it. By 1 (`loss.backward()`'s seed) they
        # are not scaled where reading the seed costs nothing (on the host; on a device the read
        # would wait for its queue).
        if grads and not is_one_on_host(loss_seed):
            torch._foreach_mul_(list(grads.values()), loss_seed)
        if ctx.holds is not None or ctx.takes_held is not None:  # a window's step
            nodes = _arg_nodes(args, ctx.next_functions)
            if ctx.holds is not None:
                grads = held_until_synced(ctx.holds, ctx.off, args, grads, nodes, ctx.run.eager_bytes, loss_seed)
            else:
                taken, ctx.taken = ctx.taken, None
                grads = given_back(ctx.takes_held, taken, args, grads, nodes, ctx.run.eager_bytes, loss_seed)
            handed = (None, *_hand_over(args, grads, lambda: nodes))
        else:
            handed = (None, *_hand_over(args, grads, lambda: _arg_nodes(args, ctx.next_functions)))
        ctx.run.hand_over_s += time.perf_counter() - started
        return handed


def _arg_nodes(args: Sequence[torch.Tensor], edges: Sequence[tuple]) -> list[torch.autograd.graph.Node | None]:
    """The autograd node each of `args` hands its gradient to, from the autograd edges of the
    tensor arguments in order (the backward node's `next_functions`); None for a non-tensor.
    Reading `next_functions` makes a Python object of every edge's node."""
    remaining = iter(edges)
    return [next(remaining)[0] if isinstance(arg, torch.Tensor) else None for arg in args]


def _hand_over(args: Sequence[torch.Tensor], grads: dict[int, torch.Tensor],
               arg_nodes: Callable[[], Sequence[torch.autograd.graph.Node | None]]) -> list[torch.Tensor | None]:
    """What `_StepFunction.backward` returns for `args`, given the program's gradients by
    argument index and a function giving the autograd node each argument's gradient goes
    to (`_arg_nodes`).

    A DTensor leaf (a parameter) that this backward accumulates into and that has no
    hooks gets its gradient added into `.grad` here (`accumulate_grad`, as FSDP2 does for
    its sharded parameters) and autograd gets None for it: through autograd, every
    DTensor gradient would pay DTensor's dispatch. Every other argument's gradient goes
    through autograd as PyTorch delivers it: a plain tensor's (autograd's own
    accumulation is cheaper), under `torch.autograd.grad`, for leaves
    `backward(inputs=...)` leaves out, to `register_hook` and
    `register_post_accumulate_grad_hook` hooks, and to non-leaf inputs.

    The nodes are asked for only where a gradient is a DTensor's."""
    if not any(isinstance(args[index], DTensor) for index in grads):  # every one through autograd
        return [grads.get(index) for index in range(len(args))]
    nodes = arg_nodes()
    out: list[torch.Tensor | None] = [None] * len(args)
    for index, grad in grads.items():
        arg, node = args[index], nodes[index]
        if isinstance(arg, DTensor) and leaf_use(node) == "accumulated" and not has_grad_hooks(arg):
            accumulate_grad(arg, grad)
        else:
            out[index] = parameter_grad(arg, grad)
    return out
