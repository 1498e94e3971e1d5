"""Runs a `RankProgram`: instructions in order over the program's values, held in slots
(`values.Values`; counted by memory part until the runs measure alike).

If the program fails, the rank's error says where it stopped, and every other
rank's names the rank that failed first (`failures`).
"""
from __future__ import annotations

import collections
import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch

from ..ir import REDUCTIONS, Instruction, RankProgram, Recv, Run, Send
from . import failures
from .memory import TaskPeak, storage_key, task_peak
from .p2p import P2PBatch, Receiving, Sending, wire_tensor
from .timing import COMM_WAIT, COMPUTE, StepTimeline, clock_for, recording
from .values import CountedValues, HeldBytes, Key, MemoryProfile, Values

# Context managers entered around every task run, e.g. a dispatch mode that
# measures memory. Entered here, inside the compiled step, because Dynamo runs
# a frame eagerly when a dispatch mode is active around `step(...)` itself.
_TASK_CONTEXTS: contextvars.ContextVar[tuple] = contextvars.ContextVar("piper_task_contexts", default=())


@contextlib.contextmanager
def around_tasks(*contexts) -> Iterator[None]:
    """Enter `contexts` around each task the runtime runs while this is active."""
    token = _TASK_CONTEXTS.set(_TASK_CONTEXTS.get() + contexts)
    try:
        yield
    finally:
        _TASK_CONTEXTS.reset(token)


def _value(name: str, microbatch: int | None) -> str:
    return name if microbatch is None else f"{name} (microbatch {microbatch})"


def _release_completed(sends: collections.deque[Sending], memory: HeldBytes | None) -> None:
    """Let go of the sends that completed, oldest first, up to the first still in flight:
    their tensors are no longer held (nor counted in `memory`, if the run counts). Sends
    complete about in the order they were issued; asking every one in flight after every
    instruction cost more than the rest of the instructions' bookkeeping (0.15-0.3 ms of
    a 4-rank 1F1B step here), and one completed behind one in flight waits for it. The
    runtime asks after each task, not after each send or receive."""
    while sends and sends[0].batch.completed(sends[0].message):
        send = sends.popleft()
        if memory is not None:
            memory.release(send.wire)


def _release_acknowledged(sends: collections.deque[Sending], peer: int, tags: frozenset[int],
                          memory: HeldBytes | None) -> None:
    """Let go of the sends to `peer` tagged `tags`, which it has received (`RankProgram.acknowledged_by`;
    a value sent to several peers has one tag, and another peer may not have received it yet):
    their works are waited for, which returns at once, and their tensors no longer held.
    Only a send with a work of its own (gloo's): one work for a whole batch (NCCL's group)
    also waits for the batch's receives, which the peer may send only later; NCCL's works
    report completion themselves (`_release_completed`)."""
    for send in [send for send in sends if send.peer == peer and send.tag in tags and send.batch.per_message]:
        send.batch.wait(send.message)
        sends.remove(send)
        if memory is not None:
            memory.release(send.wire)


class _Position:
    """Where the program is, kept up to date as it runs, so a failure can say where it stopped."""

    def __init__(self):
        self.instruction: Instruction | None = None
        self.receiving: Recv | None = None  # a receive being waited for, before `instruction` reads it
        self.draining_sends = False

    def describe(self) -> str:
        if self.receiving is not None:
            recv = self.receiving
            return f"while receiving {_value(recv.value, recv.microbatch)} from rank {recv.peer}"
        if self.draining_sends:
            return "while waiting for its sends to complete"
        instruction = self.instruction
        if isinstance(instruction, Run):
            return f"in task {instruction.label}"
        if isinstance(instruction, Send):
            return f"while sending {_value(instruction.value, instruction.microbatch)} to rank {instruction.peer}"
        if isinstance(instruction, Recv):
            return f"while posting the receive of {_value(instruction.value, instruction.microbatch)} " \
                   f"from rank {instruction.peer}"
        return "before its first instruction"


@dataclass
class StepRun:
    """What one run of a program measured: its timeline, whose times are read when the stats
    are first asked for (on a GPU, once the step's work has run), what the program made at
    its peak (`memory`) with the memory parts the step held throughout (`held`), its counts,
    and the host seconds of the compiled step's own work around the program, which the step
    sets: in the call (`call_s`) and in `loss.backward()` (`hand_over_s`, once it ran), with the
    bytes of the collectives it ran there (`eager_bytes`: the last call of a
    `piper_fx.no_sync` window reduces what the window held; with `broadcast_buffers` the call
    broadcasts the buffers). The stats are put together when
    asked for, not in every step."""

    timeline: StepTimeline
    memory: MemoryProfile
    held: dict[str, int]
    comm_bytes: dict[str, int]
    instructions: int
    p2p_batches: int
    call_s: float = 0.0
    hand_over_s: float = 0.0
    eager_bytes: dict[str, int] = field(default_factory=dict)

    @functools.cached_property
    def _program_stats(self) -> dict:
        return {**self.timeline.stats(), "comm_bytes": dict(self.comm_bytes),
                "peak_activation_bytes": self.memory.activation_peak, "memory": self.memory.with_held(self.held),
                "instructions": self.instructions, "p2p_batches": self.p2p_batches}

    @property
    def stats(self) -> dict:
        """Its stats (`piper_fx.last_step_stats` lists the keys)."""
        stats = dict(self._program_stats)
        for kind, nbytes in self.eager_bytes.items():
            stats["comm_bytes"] = {**stats["comm_bytes"], kind: stats["comm_bytes"].get(kind, 0) + nbytes}
        stats["step_call_s"] = call = self.call_s + self.hand_over_s
        total = stats["step_s"] + call
        stats["overhead_fraction"] = (stats["runtime_s"] + call) / total if total else 0.0
        return stats

    def trace(self) -> dict:
        """The run as a Chrome / Perfetto trace (a JSON-able dict)."""
        return self.timeline.chrome_trace()


def _compiled_tensors(program: RankProgram) -> dict[str, tuple[torch.dtype, torch.device]]:
    """The dtype and device each value read by the program's tasks was compiled for, from the
    (fake) tensors their placeholders were traced with: the model's device as the example
    inputs had it, whatever it is."""
    compiled: dict[str, tuple[torch.dtype, torch.device]] = {}
    for task in program.tasks.values():
        placeholders = task.graph.graph.find_nodes(op="placeholder")
        for name, node in zip(task.inputs, placeholders):  # a task is called with its inputs in this order
            val = node.meta.get("val")
            if isinstance(val, torch.Tensor):
                compiled.setdefault(name, (val.dtype, val.device))
    return compiled


class ProgramExecutor:
    """Runs one rank's program; each value is dropped after the last instruction that reads it.

    What it needs of the tasks' graphs (the bytes each collective moves, each task's memory
    peak, the dtype and device each value was compiled for) it reads when it is made, which
    may be before its tasks are compiled (`compiled` set then: Inductor rewrites the graphs it
    compiles); it then keeps the program without them (`RankProgram.without_graphs`): the
    compiled tasks run."""

    def __init__(self, program: RankProgram, compiled: dict[str, Callable[[list], Sequence[torch.Tensor]]],
                 device: torch.device | None = None):
        self.program = program
        self.compiled = compiled
        self.compiled_tensors = _compiled_tensors(program)
        self.device = device  # where the rank computes (the model's device)
        self.clock = clock_for(device)  # times the steps, one at a time, reusing its stamps
        self.comm_bytes = program.communication_bytes()  # fixed by the program: counted once
        # The user's outputs beside the loss, one a microbatch, are activations the step hands back.
        self.part_of: dict[str, str | None] = {name: "gradients" for name in program.accumulated
                                               | (set(program.outputs) & program.per_step)}
        self.part_of.update(dict.fromkeys(program.inputs))
        # Each value dropped after its last reader: the schedule the program-level verifier checks.
        drop_after: list[list[Key]] = program.frees_after()
        # Per instruction: the values it reads (a run's: its task's arguments, in order), and per
        # run the values its task's outputs are stored as, each with whether it is summed into.
        reads: list[list[Key]] = [program.reads(instruction) for instruction in program.instructions]
        results: dict[int, list[tuple[Key, bool]]] = {
            index: [(program.key(name, run.microbatch), name in program.accumulated)
                    for run in instruction.runs for name in program.tasks[run.task].outputs]
            for index, instruction in enumerate(program.instructions) if isinstance(instruction, Run)}
        # A slot for each value the program reads, makes or hands back (`Values`); the
        # instructions' lists of keys become lists of slots.
        output_keys = {name: program.output_keys(name) for name in program.outputs}
        keys = [key for listed in output_keys.values() for key in listed]
        keys += [key for keys_read in reads for key in keys_read]
        keys += [key for stored in results.values() for key, _ in stored]
        moved = {index: program.key(i.value, i.microbatch) for index, i in enumerate(program.instructions)
                 if isinstance(i, (Send, Recv))}
        keys += moved.values()
        self.keys: list[Key] = list(dict.fromkeys(keys))
        self.slot_of: dict[Key, int] = {key: slot for slot, key in enumerate(self.keys)}
        slots = self.slot_of
        # Each output's slot: one a step, or for the user's outputs beside the loss, one a
        # microbatch (concatenated along dim 0, or stacked and reduced: `ir.REDUCTIONS`).
        self.output_slots: list[tuple[str, int]] = [
            (name, slots[listed[0]]) for name, listed in output_keys.items() if name in program.per_step]
        self.microbatch_output_slots: list[tuple[str, list[int], Callable | None]] = [
            (name, [slots[key] for key in listed], REDUCTIONS[program.reduced[name]] if name in program.reduced
             else None) for name, listed in output_keys.items() if name not in program.per_step]
        self.drop_after: list[list[int]] = [[slots[key] for key in listed] for listed in drop_after]
        self.reads: list[list[int]] = [[slots[key] for key in listed] for listed in reads]
        self.results: dict[int, list[tuple[int, bool]]] = {
            index: [(slots[key], summed) for key, summed in stored] for index, stored in results.items()}
        self.moved: dict[int, int] = {index: slots[key] for index, key in moved.items()}  # a send's or receive's value
        # (peer, receive tag) -> the tags of the sends to that peer whose tensors it has once it arrived.
        acknowledges: dict[tuple[int, int], set[int]] = {}
        for (peer, send), receive in program.acknowledged_by.items():
            acknowledges.setdefault((peer, receive), set()).add(send)
        self.acknowledges = {tag: frozenset(sends) for tag, sends in acknowledges.items()}
        self.labels = {index: program.instructions[index].label for index in self.results}  # the runs' spans
        self.task_peaks = self._task_peaks(reads, drop_after)
        self.program = program.without_graphs()
        # The memory the program makes: counted value by value on its runs until two in a
        # row measure the same (its values are the same every step), then this.
        self.profile: MemoryProfile | None = None
        self._measured: MemoryProfile | None = None  # the last run's, while counting

    def _task_peaks(self, reads: list[list[Key]], drop_after: list[list[Key]]) -> dict[int, tuple[TaskPeak, list[int]]]:
        """Per run instruction: its task's peak (`task_peak`) and the slots of the values it has
        freed by then. An argument is freed inside the task if the runtime drops it for the run
        and it is not the step's input (parameters, buffers and the batch live on, in the model
        and the caller)."""
        peaks: dict[int, tuple[TaskPeak, list[int]]] = {}
        by_task: dict[tuple[str, tuple[int, ...]], TaskPeak] = {}  # runs of one task free alike
        step_inputs = set(self.program.inputs)
        for index, instruction in enumerate(self.program.instructions):
            if isinstance(instruction, Run):
                arguments = reads[index]
                dropped = set(drop_after[index])
                releasable = tuple(i for i, key in enumerate(arguments) if key in dropped and key[0] not in step_inputs)
                cache = (instruction.task, releasable)
                if cache not in by_task:
                    by_task[cache] = task_peak(self.program.tasks[instruction.task].graph.graph, releasable)
                peak = by_task[cache]
                peaks[index] = (peak, [self.slot_of[arguments[i]] for i in peak.released])
        return peaks

    def run(self, values: dict[Key, torch.Tensor], call: int,
            held: dict[str, int] | None = None) -> tuple[dict[str, torch.Tensor], StepRun]:
        """Run every instruction; `values` holds the program inputs and is consumed.
        `held` gives the memory parts the step holds throughout (its parameters,
        their optimizer state, gradients from before). Returns the program's
        outputs and what the run measured. What the program itself makes (its
        values, by memory part) is counted on its runs until two in a row count the
        same (`profile`); later runs count nothing and report that.

        `call` numbers this step call alike on every rank (`failures.next_call`).
        If the program fails, this raises what `failures.raise_failure` makes of
        the error: on the first rank to fail, its own error (type and traceback
        kept) with a note naming the rank and where it stopped, e.g. "piper_fx
        rank 1: failed in task B0.2"; on every other rank, `PeerFailedError`
        naming that rank, raised from this rank's own error.
        """
        timeline = StepTimeline(self.program.rank, self.clock)
        position = _Position()
        batch = P2PBatch(timeline)
        counting = self.profile is None
        try:
            with recording(timeline):
                results, memory = self._run(values, timeline, position, batch, counting)
        except Exception as error:
            failures.raise_failure(error, self.program.rank, call, position.describe())
        profile = self.profile
        if counting:
            profile = memory.profile()
            if profile == self._measured:
                self.profile = profile
            self._measured = profile
        return results, StepRun(timeline, profile, held or {}, self.comm_bytes, len(self.program.instructions),
                                batch.issued)

    def _run(self, inputs: dict[Key, torch.Tensor], timeline: StepTimeline, position: _Position,
             batch: P2PBatch, counting: bool) -> tuple[dict[str, torch.Tensor], HeldBytes | None]:
        """Run the instructions; the outputs, and the bytes the run made if `counting`."""
        program, acknowledges = self.program, self.acknowledges
        pending_sends: collections.deque[Sending] = collections.deque()
        receiving: dict[int, list[Receiving]] = {}  # receives by slot, completed by the value's first reader
        # `batch`: the sends and receives not issued yet, those since the last other instruction.

        def arrive(slot: int) -> None:
            if any(posted.issued is None for posted in receiving.get(slot, ())):
                pending_sends.extend(batch.issue())  # a value forwarded in the step it arrives
            for posted in receiving.pop(slot, ()):
                position.receiving = posted.instruction
                buffer = posted.wait(timeline)
                position.receiving = None
                if counting:  # no longer in flight: counted as a value below (or its copy, `Receiving.wait`)
                    memory.release(posted.buffer)
                if posted.instruction.accumulate:
                    values.accumulate(slot, buffer)
                else:
                    values.set(slot, buffer)
                peer = posted.instruction.peer
                acknowledged = acknowledges.get((peer, posted.instruction.tag))
                if acknowledged and pending_sends:
                    _release_acknowledged(pending_sends, peer, acknowledged, memory)

        memory: HeldBytes | None = None
        if counting:
            input_storages = {storage_key(v) for v in inputs.values() if isinstance(v, torch.Tensor)}
            memory = HeldBytes(self.part_of, input_storages)
            values = CountedValues(len(self.keys), memory, self.keys)
        else:
            values = Values(len(self.keys))
        slot_of = self.slot_of
        for key, value in inputs.items():  # not counted: the step's inputs are not what it makes
            slot = slot_of.get(key)
            if slot is not None:  # else no instruction reads it
                values.held[slot] = value
        inputs.clear()  # consumed: the runtime holds the only references, so values die at their last use
        for index, instruction in enumerate(program.instructions):
            if not isinstance(instruction, (Send, Recv)):
                pending_sends.extend(batch.issue())
            position.instruction = instruction
            if not isinstance(instruction, Recv):
                reads = self.reads[index]
                if receiving:
                    for slot in reads:
                        if slot in receiving:
                            arrive(slot)
                if values.sums:  # read (sent, or passed to a task): a later sum is a new tensor
                    values.sums.difference_update(reads)
            if isinstance(instruction, Run):
                if counting:
                    peak, released = self.task_peaks[index]
                    memory.observe_task(peak, [values.counted.get(slot) for slot in released])
                with timeline.span(self.labels[index], COMPUTE):
                    self._run_task(instruction, values, index)  # drops what it last reads
            elif isinstance(instruction, Send):
                tensor = values.held[self.moved[index]]
                wire = wire_tensor(tensor, instruction)
                batch.send(wire, instruction)
                if counting:
                    memory.hold(wire, "communication_buffers")  # held by the transfer until it completes
            elif isinstance(instruction, Recv):
                slot = self.moved[index]
                posted = Receiving(instruction)
                batch.receive(posted)
                receiving.setdefault(slot, []).append(posted)
                if counting:
                    memory.hold(posted.buffer, "communication_buffers")
            if counting and not isinstance(instruction, Send):  # only runs and receives add values
                memory.observe()
            if pending_sends and isinstance(instruction, Run):  # time passed: sends may have completed
                _release_completed(pending_sends, memory)
            if not isinstance(instruction, Run):
                values.drop(self.drop_after[index])
        pending_sends.extend(batch.issue())
        for slot in list(receiving):
            arrive(slot)
        if pending_sends:
            position.draining_sends = True
            with timeline.span("sends in flight", COMM_WAIT, "send"):
                for send in pending_sends:
                    send.batch.wait(send.message)
        held = values.held
        outputs = {name: held[slot] for name, slot in self.output_slots if held[slot] is not None}
        for name, slots, reduce in self.microbatch_output_slots:  # a rank holds all of one's microbatches, or none
            made = [held[slot] for slot in slots if held[slot] is not None]
            if made:
                outputs[name] = made[0] if len(made) == 1 else reduce(torch.stack(made)) if reduce else torch.cat(made)
        return outputs, memory

    def _run_task(self, instruction: Run, values: Values, index: int) -> None:
        held = values.held
        args = [held[slot] for slot in self.reads[index]]
        # Drop our references first, so the boxed task frees each input at its last use.
        values.drop(self.drop_after[index])
        contexts = _TASK_CONTEXTS.get()
        if contexts:
            with contextlib.ExitStack() as stack:
                for context in contexts:
                    stack.enter_context(context)
                results = self.compiled[instruction.task](args)
        else:
            results = self.compiled[instruction.task](args)
        del args
        values.store(self.results[index], results)  # a fused pair's: its first half's outputs, then its second's
