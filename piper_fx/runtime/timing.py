"""Where one rank's step time goes: computing, or waiting on communication.

The executor records a `StepTimeline` of spans while it runs a program: each
task run on the "compute" lane, and every time the rank blocks on a transfer
on the "comm wait" lane: a receive's arrival, the sends still in flight at the
end, and the waits of collectives inside compiled tasks. Time blocked waiting
is the exposed communication: what overlapping failed to hide. Compute is the
tasks' time minus the waits inside them. The "comm" lane shows each
collective of a task in flight, from its issue to the end of its wait, so
the trace shows what it overlapped (e.g. a DualPipe pair's all-to-all under
the other half's compute).

In-task collectives are timed only with the option `profile` (otherwise their
waits count as the task's compute): eager task graphs then call
`timed_collective` and `timed_wait` in place of the collectives and
`wait_tensor`, and Inductor-compiled tasks run under `WaitTimer`, a dispatch
mode that does the same and passes every other op through (the compiled C++
kernels never reach it, but each extern call pays a Python call).
"""
from __future__ import annotations

import contextlib
import contextvars
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..compat import TorchDispatchMode
from ..ops import WAIT, collective_op_kind
from .memory import storage_key

COMPUTE, COMM, COMM_WAIT = "compute", "comm", "comm wait"
_LANES = {COMPUTE: 0, COMM: 1, COMM_WAIT: 2}


@dataclass
class Span:
    name: str
    lane: str
    start_ns: int
    end_ns: int
    inside_task: bool = False
    kind: str | None = None  # what was waited for: a collective kind, "recv" or "send"


@dataclass
class StepTimeline:
    rank: int
    start_ns: int = field(default_factory=time.time_ns)
    end_ns: int = 0
    spans: list[Span] = field(default_factory=list)
    # Collectives in flight: the storage of each one's result -> (kind, issue time).
    in_flight: dict[int, tuple[str, int]] = field(default_factory=dict)
    _task_depth: int = 0

    @contextlib.contextmanager
    def span(self, name: str, lane: str, kind: str | None = None) -> Iterator[None]:
        start = time.time_ns()
        if lane == COMPUTE:
            self._task_depth += 1
        try:
            yield
        finally:
            if lane == COMPUTE:
                self._task_depth -= 1
            self.spans.append(Span(name, lane, start, time.time_ns(), self._task_depth > 0, kind))

    def stats(self) -> dict:
        tasks = sum(s.end_ns - s.start_ns for s in self.spans if s.lane == COMPUTE)
        waits = [s for s in self.spans if s.lane == COMM_WAIT]
        waited = sum(s.end_ns - s.start_ns for s in waits)
        waits_in_tasks = sum(s.end_ns - s.start_ns for s in waits if s.inside_task)
        by_kind: dict[str, float] = {}
        for s in waits:
            by_kind[s.kind or "other"] = by_kind.get(s.kind or "other", 0.0) + (s.end_ns - s.start_ns) / 1e9
        step = (self.end_ns or time.time_ns()) - self.start_ns
        # What is neither in a task nor waiting: the runtime's own work (its instruction loop,
        # freeing values, issuing sends, these stats).
        runtime = max(0, step - (tasks - waits_in_tasks) - waited)
        return {"step_s": step / 1e9, "compute_s": (tasks - waits_in_tasks) / 1e9, "comm_wait_s": waited / 1e9,
                "exposed_comm_fraction": waited / step if step else 0.0, "comm_wait_s_by_kind": by_kind,
                "runtime_s": runtime / 1e9, "runtime_fraction": runtime / step if step else 0.0}

    def chrome_trace(self) -> dict:
        """The step as a Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing)."""
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        events += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": lane}}
                   for lane, tid in _LANES.items()]
        events += [{"name": s.name, "cat": s.lane, "ph": "X", "pid": self.rank, "tid": _LANES[s.lane],
                    "ts": s.start_ns / 1e3, "dur": (s.end_ns - s.start_ns) / 1e3} for s in self.spans]
        return {"traceEvents": events, "displayTimeUnit": "ms"}


# The timeline of the step running in this context, if any: the timed collectives record on it.
_recording: contextvars.ContextVar[StepTimeline | None] = contextvars.ContextVar("piper_recording", default=None)


@contextlib.contextmanager
def recording(timeline: StepTimeline) -> Iterator[StepTimeline]:
    token = _recording.set(timeline)
    try:
        yield timeline
    finally:
        timeline.end_ns = time.time_ns()
        _recording.reset(token)


def _issue(kind: str, op, args: tuple, kwargs: dict) -> torch.Tensor:
    """Run the collective `op`, noting when it was issued."""
    result = op(*args, **kwargs)
    timeline = _recording.get()
    if timeline is not None:
        timeline.in_flight[storage_key(result)] = (kind, time.time_ns())
    return result


def timed_collective(op):
    """`op` (a functional collective), noting when it was issued (eager task graphs call this)."""
    kind = collective_op_kind(op)

    def issue(*args, **kwargs):
        return _issue(kind, op, args, kwargs)
    issue.__name__ = issue.__qualname__ = f"timed_{op.__name__.split('.')[0]}"
    return issue


def timed_wait(tensor: torch.Tensor) -> torch.Tensor:
    """`wait_tensor`, timed on the current step's timeline (eager task graphs call this);
    the collective it ends goes on the comm lane, from its issue to now."""
    timeline = _recording.get()
    if timeline is None:
        return WAIT(tensor)
    kind, issued = timeline.in_flight.pop(storage_key(tensor), (None, None))
    with timeline.span(f"wait {kind or 'collective'}", COMM_WAIT, kind):
        result = WAIT(tensor)
    if issued is not None:
        timeline.spans.append(Span(kind, COMM, issued, time.time_ns(), True, kind))
    return result


class WaitTimer(TorchDispatchMode):
    """Times the collectives of a compiled task; every other op passes straight through."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is WAIT:
            return timed_wait(*args)
        kind = collective_op_kind(func)
        if kind is not None:
            return _issue(kind, func, args, kwargs or {})
        return func(*args, **(kwargs or {}))
