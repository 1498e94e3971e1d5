"""Where one rank's step time goes: computing, or waiting on communication.

The executor records a `StepTimeline` of spans while it runs a program: each
task run on the "compute" lane, and every time the rank blocks on a transfer
on the "comm wait" lane: a receive's arrival, the sends still in flight at the
end, issuing sends and receives (under gloo the issuing thread writes their
bytes), and the waits of collectives inside compiled tasks. Time blocked waiting
is the exposed communication: what overlapping failed to hide. Compute is the
tasks' time minus the waits inside them. The "comm" lane shows each
collective of a task in flight, from its issue to the end of its wait, so
the trace shows what it overlapped (e.g. a DualPipe pair's all-to-all under
the other half's compute).

On a device with streams (a GPU) the host only enqueues work, so its clock
would time the issuing. There the timeline stamps are events recorded on the
device's current stream (`StreamClock`): a task's span is its kernels' time, a
wait's span the time the stream stood still for the transfer (a wait on a
stream issues no host synchronisation). They are read, once, when the stats or
the trace are asked for (`last_step_stats()`), not at the end of every step.
Where the step waits on the host (small, fast kernels), each stamp's host cost
is the step's: an executor keeps one clock, which reuses the events of
timelines no longer kept or already read, and records them on the stream it
looked up once at the step's start (on an H200's machine, a new event recorded
on the current stream cost the host 8-14 microseconds, a kept one recorded on a
given stream 2).

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
from typing import Any, Callable, Iterable, Iterator

import torch

from ..compat import TorchDispatchMode
from ..ops import WAIT, collective_op_kind
from .memory import storage_key

COMPUTE, COMM, COMM_WAIT = "compute", "comm", "comm wait"
_LANES = {COMPUTE: 0, COMM: 1, COMM_WAIT: 2}


class HostClock:
    """Stamps in the host's nanoseconds: where work runs as the host issues it (the CPU)."""

    def begin(self) -> None:
        pass

    def stamp(self) -> Any:
        return time.time_ns()

    def reader(self, origin: Any, origin_ns: int) -> Callable[[Any], int]:
        return lambda stamp: stamp

    def release(self, stamps: Iterable[Any]) -> None:
        pass


class StreamClock:
    """Stamps as timing events recorded on the device's current stream (`device_module`:
    `torch.cuda` and the like), read as nanoseconds once the work before each has run: a
    step's first event's host time plus the device time elapsed since it.

    One clock serves the steps of one executor, one at a time: `begin` looks up the
    stream the step's work goes to; the events of a step's timeline come back to the
    clock (`release`) once it was read or is no longer kept, and are recorded again by
    a later step."""

    def __init__(self, device_module: Any):
        self.events = device_module
        self.stream = None
        self._free: list = []
        self.synchronized = 0  # how many stamps were read (each waits for its event once)

    def begin(self) -> None:
        self.stream = self.events.current_stream()

    def stamp(self) -> Any:
        event = self._free.pop() if self._free else self.events.Event(enable_timing=True)
        event.record(self.stream)
        return event

    def reader(self, origin: Any, origin_ns: int) -> Callable[[Any], int]:
        """Nanoseconds of a stamp, from the step's first stamp `origin`, made at host time
        `origin_ns`: the device's elapsed time is single precision milliseconds, so it is
        read from a stamp of the same step, not from one made long before."""
        def ns(stamp: Any) -> int:
            stamp.synchronize()
            self.synchronized += 1
            return origin_ns + round(origin.elapsed_time(stamp) * 1e6)
        return ns

    def release(self, stamps: Iterable[Any]) -> None:
        self._free.extend({id(event): event for event in stamps}.values())


def clock_for(device: torch.device | None) -> HostClock | StreamClock:
    """The clock of work on `device`: its stream's events where it has streams with timing
    events (an accelerator), else the host's."""
    if device is None or device.type in ("cpu", "meta"):
        return HostClock()
    module = torch.get_device_module(device.type)
    return StreamClock(module) if hasattr(module, "Event") else HostClock()


@dataclass
class Span:
    """A span of a lane. Its ends are the clock's stamps until the timeline is read
    (`StepTimeline.resolve`), then nanoseconds."""

    name: str
    lane: str
    start_ns: Any
    end_ns: Any
    inside_task: bool = False
    kind: str | None = None  # what was waited for: a collective kind, "recv" or "send"


@dataclass
class StepTimeline:
    rank: int
    clock: HostClock | StreamClock = field(default_factory=HostClock)
    start_ns: Any = None
    end_ns: Any = None
    spans: list[Span] = field(default_factory=list)
    # Collectives in flight: the storage of each one's result -> (kind, issue stamp).
    in_flight: dict[int, tuple[str, Any]] = field(default_factory=dict)
    _task_depth: int = 0
    _resolved: bool = False

    def __post_init__(self):
        self.clock.begin()
        self.start_ns, self._start_host_ns = self.clock.stamp(), time.time_ns()

    def stamp(self) -> Any:
        return self.clock.stamp()

    def span(self, name: str, lane: str, kind: str | None = None) -> "_Spanning":
        """A context timing what runs inside it as a span of `lane` (a task, if `lane` is
        compute: spans begun inside it are inside the task)."""
        return _Spanning(self, name, lane, kind)

    def end(self) -> None:
        self.end_ns = self.clock.stamp()

    def _stamps(self) -> list[Any]:
        stamps = [self.start_ns, *(stamp for s in self.spans for stamp in (s.start_ns, s.end_ns))]
        return stamps if self.end_ns is None else [*stamps, self.end_ns]

    def resolve(self) -> "StepTimeline":
        """Read every stamp as nanoseconds (on a stream clock, once the step's work has run)."""
        if not self._resolved:
            stamps = self._stamps()
            ns = self.clock.reader(self.start_ns, self._start_host_ns)
            self.start_ns, end = ns(self.start_ns), self.end_ns
            self.end_ns = ns(end) if end is not None else time.time_ns()
            for s in self.spans:
                s.start_ns, s.end_ns = ns(s.start_ns), ns(s.end_ns)
            self._resolved = True
            self.clock.release(stamps)
        return self

    def __del__(self):
        if not self._resolved:  # never read: a later step records them again
            self.clock.release(self._stamps())

    def stats(self) -> dict:
        self.resolve()
        tasks = sum(s.end_ns - s.start_ns for s in self.spans if s.lane == COMPUTE)
        waits = [s for s in self.spans if s.lane == COMM_WAIT]
        waited = sum(s.end_ns - s.start_ns for s in waits)
        waits_in_tasks = sum(s.end_ns - s.start_ns for s in waits if s.inside_task)
        by_kind: dict[str, float] = {}
        for s in waits:
            by_kind[s.kind or "other"] = by_kind.get(s.kind or "other", 0.0) + (s.end_ns - s.start_ns) / 1e9
        step = self.end_ns - self.start_ns
        # What is neither in a task nor communicating: the runtime's own work (its instruction
        # loop, freeing values, memory accounting).
        runtime = max(0, step - (tasks - waits_in_tasks) - waited)
        return {"step_s": step / 1e9, "compute_s": (tasks - waits_in_tasks) / 1e9, "comm_wait_s": waited / 1e9,
                "exposed_comm_fraction": waited / step if step else 0.0, "comm_wait_s_by_kind": by_kind,
                "runtime_s": runtime / 1e9, "runtime_fraction": runtime / step if step else 0.0}

    def chrome_trace(self) -> dict:
        """The step as a Chrome / Perfetto trace (open in ui.perfetto.dev or chrome://tracing)."""
        self.resolve()
        events = [{"name": "process_name", "ph": "M", "pid": self.rank, "args": {"name": f"rank {self.rank}"}}]
        events += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid, "args": {"name": lane}}
                   for lane, tid in _LANES.items()]
        events += [{"name": s.name, "cat": s.lane, "ph": "X", "pid": self.rank, "tid": _LANES[s.lane],
                    "ts": s.start_ns / 1e3, "dur": (s.end_ns - s.start_ns) / 1e3} for s in self.spans]
        return {"traceEvents": events, "displayTimeUnit": "ms"}


class _Spanning:
    """`StepTimeline.span`'s context: a class, not a generator, as it is entered around every
    instruction of a step."""

    __slots__ = ("timeline", "name", "lane", "kind", "start")

    def __init__(self, timeline: StepTimeline, name: str, lane: str, kind: str | None):
        self.timeline, self.name, self.lane, self.kind = timeline, name, lane, kind

    def __enter__(self) -> None:
        timeline = self.timeline
        self.start = timeline.clock.stamp()
        if self.lane == COMPUTE:
            timeline._task_depth += 1

    def __exit__(self, *exc) -> None:
        timeline = self.timeline
        end = timeline.clock.stamp()
        if self.lane == COMPUTE:
            timeline._task_depth -= 1
        timeline.spans.append(Span(self.name, self.lane, self.start, end, timeline._task_depth > 0, self.kind))


# The timeline of the step running in this context, if any: the timed collectives record on it.
_recording: contextvars.ContextVar[StepTimeline | None] = contextvars.ContextVar("piper_recording", default=None)


@contextlib.contextmanager
def recording(timeline: StepTimeline) -> Iterator[StepTimeline]:
    token = _recording.set(timeline)
    try:
        yield timeline
    finally:
        timeline.end()
        _recording.reset(token)


def _issue(kind: str, op, args: tuple, kwargs: dict) -> torch.Tensor:
    """Run the collective `op`, noting when it was issued."""
    result = op(*args, **kwargs)
    timeline = _recording.get()
    if timeline is not None:
        timeline.in_flight[storage_key(result)] = (kind, timeline.stamp())
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
        timeline.spans.append(Span(kind, COMM, issued, timeline.stamp(), True, kind))
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
