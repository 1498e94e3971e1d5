"""Where a compile's time goes: capture, each pass, each task's code generation.

The backend fills one `CompileStats` per compile (`piper_fx.last_compile_stats()`),
writes it to the dumps (`compile_stats.txt`),
and counts how each task's code was obtained: compiled by Inductor, loaded from
its FX graph cache (TORCHINDUCTOR_CACHE_DIR, shared by ranks, runs and
processes), or built eagerly. Dynamo's own tracing of the frame runs before the
backend: its seconds are reported beside the compile's, not in them.
"""
from __future__ import annotations

import gc
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from .compat import dynamo_counters

# The stats of the latest compile on this process, whichever step it made.
_latest: CompileStats | None = None


def last_compile_stats() -> dict:
    """Where the latest compile on this rank went (`CompileStats.as_dict`); empty before any."""
    return _latest.as_dict() if _latest is not None else {}


def record(stats: CompileStats) -> None:
    global _latest
    _latest = stats


# Inductor's counters of its FX graph cache, and the names this module gives them.
_CACHE_COUNTERS = {"fxgraph_cache_hit": "cache_hit", "fxgraph_cache_miss": "compiled",
                   "fxgraph_cache_bypass": "cache_bypass"}


@dataclass
class CompileStats:
    """Seconds per phase of one compile, in order: `plan cache` (looking the plan up, and
    storing it), `capture`, `pass:<name>` per pass (with verification, when on), `dumps`
    (writing them, when on), `codegen prepare` (what code generation does to a plan's graphs
    when it is made: `codegen.prepare`), `codegen regions` (cutting tasks into regions),
    `codegen:<task>` per task or region (`F0.r3`); `plan`: where the plan came from
    (`planned`; `planned, cached`; `cache hit`: `plan_cache`); `tasks`: how many tasks'
    (or regions') code came each way (`compiled`, `cache_hit`, `cache_bypass` under
    Inductor, `repeated` for a task or region whose code another of the program has,
    compiled once; `eager`); `dynamo_trace_s`: Dynamo's tracing of the frame before the compile
    (not in its total; None where Dynamo kept no timing); `gc_s`: the cyclic garbage
    collector's seconds during the compile (inside its phases' times, not beside them), and
    `frozen_objects`: how many older objects its collections did not scan (the backend's
    `_collecting_only_new_objects`)."""

    seconds: dict[str, float] = field(default_factory=dict)
    tasks: Counter = field(default_factory=Counter)
    plan: str = "planned"
    dynamo_trace_s: float | None = None
    gc_s: float = 0.0
    frozen_objects: int = 0
    _lap_start: float = field(default_factory=time.perf_counter, repr=False)

    def _add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._add(name, time.perf_counter() - start)
            self._lap_start = time.perf_counter()

    @contextmanager
    def collections(self, frozen_objects: int):
        """Count the garbage collector's time while inside (`gc_s`), `frozen_objects` objects
        left out of its scans."""
        self.frozen_objects = frozen_objects
        started = [0.0]

        def timed(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                self.gc_s += time.perf_counter() - started[0]
        gc.callbacks.append(timed)
        try:
            yield
        finally:
            gc.callbacks.remove(timed)

    def lap(self, name: str) -> None:
        """Count the time since the last phase or lap ended as phase `name` (for phases
        that a callback sees only the end of, like each pass of `run_passes`)."""
        now = time.perf_counter()
        self._add(name, now - self._lap_start)
        self._lap_start = now

    @contextmanager
    def task(self, name: str, codegen: str):
        """Time the code generation of task `name` and count how its code was obtained."""
        before = Counter(dynamo_counters["inductor"])
        with self.phase(f"codegen:{name}"):
            yield
        if codegen != "inductor":
            self.tasks["eager"] += 1
            return
        after = dynamo_counters["inductor"]
        for counter, kind in _CACHE_COUNTERS.items():
            self.tasks[kind] += after[counter] - before[counter]

    @property
    def total_s(self) -> float:
        return sum(self.seconds.values())

    def by_kind(self) -> dict[str, float]:
        """Seconds per kind of phase: `capture`, `passes`, `dumps`, `codegen`."""
        kinds: dict[str, float] = {}
        for name, seconds in self.seconds.items():
            kind = {"pass": "passes"}.get(name.split(":")[0], name.split(":")[0])
            kinds[kind] = kinds.get(kind, 0.0) + seconds
        return kinds

    def as_dict(self) -> dict:
        return {"summary": self.summary(), "total_s": self.total_s, "by_kind": self.by_kind(),
                "seconds": dict(self.seconds), "plan": self.plan, "dynamo_trace_s": self.dynamo_trace_s,
                "gc_s": self.gc_s, "frozen_objects": self.frozen_objects,
                "tasks": {kind: count for kind, count in self.tasks.items() if count}}

    def summary(self) -> str:
        """One line: Dynamo's trace before the compile, the compile's total, each kind of phase,
        and how the tasks' code was obtained."""
        kinds = ", ".join(f"{kind} {seconds:.2f} s" for kind, seconds in self.by_kind().items())
        tasks = ", ".join(f"{count} {kind.replace('_', ' ')}" for kind, count in sorted(self.tasks.items()) if count)
        traced = f"Dynamo trace {self.dynamo_trace_s:.2f} s, then " if self.dynamo_trace_s is not None else ""
        return (f"{traced}compile {self.total_s:.2f} s ({kinds}; garbage collection {self.gc_s:.2f} s within "
                f"them); plan: {self.plan}; tasks: {tasks or 'none'}")

    def render(self) -> str:
        """The summary, then every phase, slowest first."""
        width = max((len(name) for name in self.seconds), default=0)
        lines = [self.summary(), ""]
        lines += [f"{name:<{width}}  {seconds:8.3f} s"
                  for name, seconds in sorted(self.seconds.items(), key=lambda kv: -kv[1])]
        return "\n".join(lines) + "\n"
