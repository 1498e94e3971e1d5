"""Where one rank's step time goes: computing, or waiting on communication.

The executor records a `StepTimeline` of spans while it runs a program: each
task run on the "compute" lane, and every time the rank blocks on a transfer
on the "comm wait" lane: a receive's arrival, the sends still in flight at the
end, and the waits of collectives inside compiled tasks. Time blocked waiting
is the exposed communication: what overlapping failed to hide. Compute is the
tasks' time minus the waits inside them.

In-task waits are timed only with the option `profile` (otherwise they count
as the task's compute): eager task graphs then call `timed_wait` in place of
`wait_tensor`, and Inductor-compiled tasks run under `WaitTimer`, a dispatch
mode that times `wait_tensor` and passes every other op through (the compiled
C++ kernels never reach it, but each extern call pays a Python call).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

COMPUTE, COMM_WAIT = "compute", "comm wait"
_LANES = {COMPUTE: 0, COMM_WAIT: 1}
_WAIT = torch.ops._c10d_functional.wait_tensor.default


@dataclass
class Span:
    name: str
    lane: str
    start_ns: int
    end_ns: int
    inside_task: bool = False


@dataclass
class StepTimeline:
    rank: int
    start_ns: int = field(default_factory=time.time_ns)
    end_ns: int = 0
    spans: list[Span] = field(default_factory=list)
    _task_depth: int = 0

    @contextlib.contextmanager
    def span(self, name: str, lane: str) -> Iterator[None]:
        start = time.time_ns()
        if lane == COMPUTE:
            self._task_depth += 1
        try:
            yield
        finally:
            if lane == COMPUTE:
                self._task_depth -= 1
            self.spans.append(Span(name, lane, start, time.time_ns(), inside_task=self._task_depth > 0))

    def stats(self) -> dict[str, float]:
        tasks = sum(s.end_ns - s.start_ns for s in self.spans if s.lane == COMPUTE)
        waits = sum(s.end_ns - s.start_ns for s in self.spans if s.lane == COMM_WAIT)
        waits_in_tasks = sum(s.end_ns - s.start_ns for s in self.spans if s.lane == COMM_WAIT and s.inside_task)
        step = (self.end_ns or time.time_ns()) - self.start_ns
        return {"step_s": step / 1e9, "compute_s": (tasks - waits_in_tasks) / 1e9, "comm_wait_s": waits / 1e9,
                "exposed_comm_fraction": waits / step if step else 0.0}

    def chrome_trace(self) -> dict:
        """The step as a Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing)."""
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        events += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": lane}}
                   for lane, tid in _LANES.items()]
        events += [{"name": s.name, "cat": s.lane, "ph": "X", "pid": self.rank, "tid": _LANES[s.lane],
                    "ts": s.start_ns / 1e3, "dur": (s.end_ns - s.start_ns) / 1e3} for s in self.spans]
        return {"traceEvents": events, "displayTimeUnit": "ms"}


_current: list[StepTimeline | None] = [None]


@contextlib.contextmanager
def recording(timeline: StepTimeline) -> Iterator[StepTimeline]:
    previous, _current[0] = _current[0], timeline
    try:
        yield timeline
    finally:
        timeline.end_ns = time.time_ns()
        _current[0] = previous


def timed_wait(tensor: torch.Tensor) -> torch.Tensor:
    """`wait_tensor`, timed on the current step's timeline (eager task graphs call this)."""
    timeline = _current[0]
    if timeline is None:
        return _WAIT(tensor)
    with timeline.span("wait_tensor", COMM_WAIT):
        return _WAIT(tensor)


class WaitTimer(TorchDispatchMode):
    """Times the collective waits of a compiled task; every other op passes straight through."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _WAIT:
            return timed_wait(*args)
        return func(*args, **(kwargs or {}))
