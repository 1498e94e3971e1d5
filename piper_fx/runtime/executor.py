"""Runs a `RankProgram`: instructions in order over a store of named values.

If the program fails, the rank's error says where it stopped, and every other
rank's names the rank that failed first (`failures`).
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from ..ir import Instruction, RankProgram, Recv, Run, Send
from . import failures
from .memory import storage_key
from .timing import COMM_WAIT, COMPUTE, StepTimeline, recording

# Context managers entered around every task run, e.g. a dispatch mode that
# measures memory. Entered here, inside the compiled step, because Dynamo runs
# a frame eagerly when a dispatch mode is active around `step(...)` itself.
_TASK_CONTEXTS: contextvars.ContextVar[tuple] = contextvars.ContextVar("piper_task_contexts", default=())

Key = tuple[str, "int | None"]


@contextlib.contextmanager
def around_tasks(*contexts) -> Iterator[None]:
    """Enter `contexts` around each task the runtime runs while this is active."""
    token = _TASK_CONTEXTS.set(_TASK_CONTEXTS.get() + contexts)
    try:
        yield
    finally:
        _TASK_CONTEXTS.reset(token)


class _ActivationBytes:
    """Bytes of the per-microbatch values the program made or is receiving, kept
    up to date as values come and go (a scan of every value after every
    instruction cost a tenth of a pipeline step). The step's inputs (batch,
    parameters) and views of them, such as a transposed weight, do not count;
    a storage shared by several values counts once."""

    def __init__(self, input_storages: set[int]):
        self.input_storages = input_storages
        self.live: dict[int, list[int]] = {}  # storage (`storage_key`) -> [bytes, values on it]
        self.current = 0

    def add(self, key: Key, value) -> None:
        if key[1] is None or not isinstance(value, torch.Tensor):
            return
        storage = storage_key(value)
        if storage in self.input_storages:
            return
        entry = self.live.setdefault(storage, [value.untyped_storage().nbytes(), 0])
        if entry[1] == 0:
            self.current += entry[0]
        entry[1] += 1

    def remove(self, key: Key, value) -> None:
        if key[1] is None or not isinstance(value, torch.Tensor):
            return
        storage = storage_key(value)
        entry = self.live.get(storage)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.live[storage]


class _Values(dict):
    """The program's values by key, reporting every value set or dropped to an `_ActivationBytes`."""

    def __init__(self, values: dict, tracked: _ActivationBytes):
        super().__init__(values)
        self.tracked = tracked

    def __setitem__(self, key: Key, value) -> None:
        if key in self:
            self.tracked.remove(key, dict.__getitem__(self, key))
        super().__setitem__(key, value)
        self.tracked.add(key, value)

    def pop(self, key: Key, *default):
        if key in self:
            self.tracked.remove(key, dict.__getitem__(self, key))
        return super().pop(key, *default)


def _value(name: str, microbatch: int | None) -> str:
    return name if microbatch is None else f"{name} (microbatch {microbatch})"


class _Receiving:
    """A posted receive: the buffer it fills and the work to wait for."""

    def __init__(self, instruction: Recv):
        self.instruction = instruction
        self.buffer = torch.empty(instruction.shape, dtype=instruction.dtype, device=instruction.device)
        self.work = dist.irecv(self.buffer, src=instruction.peer, tag=instruction.tag)

    def wait(self, timeline: StepTimeline) -> torch.Tensor:
        with timeline.span(f"recv {self.instruction.value}", COMM_WAIT, "recv"):
            self.work.wait()
        return self.buffer


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


@dataclass(frozen=True)
class StepRun:
    """What one run of a program measured: its stats (`piper_fx.last_step_stats`
    lists the keys) and its timeline."""

    stats: dict
    timeline: StepTimeline

    def trace(self) -> dict:
        """The run as a Chrome / Perfetto trace (a JSON-able dict)."""
        return self.timeline.chrome_trace()


class ProgramExecutor:
    """Runs one rank's program; each value is dropped after the last instruction that reads it."""

    def __init__(self, program: RankProgram, compiled: dict[str, Callable[[list], Sequence[torch.Tensor]]]):
        self.program = program
        self.compiled = compiled
        self.comm_bytes = program.communication_bytes()  # fixed by the program: counted once
        # Each value dropped after its last reader: the schedule the program-level verifier checks.
        self.drop_after: list[list[Key]] = program.frees_after()

    def run(self, values: dict[Key, torch.Tensor], call: int) -> tuple[dict[str, torch.Tensor], StepRun]:
        """Run every instruction; `values` holds the program inputs and is consumed.
        Returns the program's outputs and what the run measured.

        `call` numbers this step call alike on every rank (`failures.next_call`).
        If the program fails, this raises what `failures.raise_failure` makes of
        the error: on the first rank to fail, its own error (type and traceback
        kept) with a note naming the rank and where it stopped, e.g. "piper_fx
        rank 1: failed in task B0.2"; on every other rank, `PeerFailedError`
        naming that rank, raised from this rank's own error.
        """
        timeline = StepTimeline(self.program.rank)
        position = _Position()
        try:
            with recording(timeline):
                results, peak = self._run(values, timeline, position)
        except Exception as error:
            failures.raise_failure(error, self.program.rank, call, position.describe())
        stats = {**timeline.stats(), "comm_bytes": dict(self.comm_bytes), "peak_activation_bytes": peak,
                 "instructions": len(self.program.instructions)}
        return results, StepRun(stats, timeline)

    def _run(self, values: dict[Key, torch.Tensor], timeline: StepTimeline, position: _Position):
        program = self.program
        pending_sends: list[dist.Work] = []
        receiving: dict[Key, list[_Receiving]] = {}  # posted receives, completed by the value's first reader

        def arrive(key: Key) -> None:
            for posted in receiving.pop(key, ()):
                position.receiving = posted.instruction
                buffer = posted.wait(timeline)
                position.receiving = None
                activations.remove(key, buffer)  # no longer in flight: counted as a value below
                held = values.get(key) if posted.instruction.accumulate else None
                values[key] = buffer if held is None else held + buffer

        input_storages = {storage_key(v) for v in values.values() if isinstance(v, torch.Tensor)}
        activations = _ActivationBytes(input_storages)
        tracked = _Values(values, activations)
        values.clear()  # consumed: the runtime holds the only references, so values die at their last use
        values = tracked
        peak = 0
        for index, instruction in enumerate(program.instructions):
            position.instruction = instruction
            if not isinstance(instruction, Recv):
                for key in program.reads(instruction):
                    arrive(key)
            if isinstance(instruction, Run):
                with timeline.span(instruction.label, COMPUTE):
                    self._run_task(instruction, values, index)
            elif isinstance(instruction, Send):
                tensor = values[program.key(instruction.value, instruction.microbatch)]
                pending_sends.append(dist.isend(tensor.contiguous(), dst=instruction.peer, tag=instruction.tag))
            elif isinstance(instruction, Recv):
                key = program.key(instruction.value, instruction.microbatch)
                posted = _Receiving(instruction)
                receiving.setdefault(key, []).append(posted)
                activations.add(key, posted.buffer)
            if not isinstance(instruction, Send):  # only runs and receives add values
                peak = max(peak, activations.current)
            pending_sends = [work for work in pending_sends if not work.is_completed()]
            for key in self.drop_after[index]:
                values.pop(key, None)
        for key in list(receiving):
            arrive(key)
        position.draining_sends = True
        with timeline.span("sends in flight", COMM_WAIT, "send"):
            for work in pending_sends:
                work.wait()
        return {name: values[(name, None)] for name in program.outputs if (name, None) in values}, peak

    def _run_task(self, instruction: Run, values: dict[Key, torch.Tensor], index: int) -> None:
        program = self.program
        args = [values[program.key(name, run.microbatch)] for run in instruction.runs
                for name in program.tasks[run.task].inputs]
        # Drop our references first, so the boxed task frees each input at its last use.
        for key in self.drop_after[index]:
            values.pop(key, None)
        with contextlib.ExitStack() as stack:
            for context in _TASK_CONTEXTS.get():
                stack.enter_context(context)
            results = self.compiled[instruction.task](args)
        del args
        results = iter(results)
        for run in instruction.runs:  # a fused pair returns its first half's outputs, then its second's
            for name in program.tasks[run.task].outputs:
                value = next(results)
                if name in program.accumulated:
                    previous = values.get((name, None))
                    values[(name, None)] = value if previous is None else previous + value
                else:
                    values[program.key(name, run.microbatch)] = value
