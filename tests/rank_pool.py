"""A set of rank processes over gloo, started once, that run many trainings in turn.

A property test that trains tens of generated strategies reuses one pool per
world size rather than starting ranks for each (a rendezvous, and in
each process the work a first compile does once: Inductor's probe of the CPU,
loading its libraries). Every run has a hard deadline: a pool whose ranks do not
all answer in time, or where a rank failed (its peers may be left in a broken
collective), is torn down, and the next run starts a fresh one; the ranks that missed the
deadline say where they were (every thread's Python stack), and a rank that crashed says where it
crashed (faulthandler's report: the signal and every thread's stack), in the run's error itself: a
rank's stderr may be cut from a long log.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os
import queue
import signal
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from ranks import processes


def _stacks_file(init_file: str, rank: int) -> str:
    return f"{init_file}.stacks{rank}"


def _serve(rank, world_size, init_file, tasks, results, collective_timeout_s):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # A rank that misses its deadline is asked for its threads' stacks (SIGUSR1) before it is killed;
    # one that crashes writes them there too, with the signal (a C library's own message, such as
    # glibc's on a corrupted heap, still goes to stderr).
    stacks = open(_stacks_file(init_file, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)
    torch.set_num_threads(1)  # up to 4 ranks share 2 cores
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # not a silent eager run (conftest)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=collective_timeout_s))
    try:
        while (task := tasks.get()) is not None:
            fn, args = task
            try:
                results.put((rank, "ok", fn(rank, world_size, *args)))
            except BaseException:  # noqa: BLE001 - everything a rank raises goes back to the caller
                results.put((rank, "error", traceback.format_exc()))
            torch._dynamo.reset()  # each run compiles its own model; drop the last one's code
    finally:
        dist.destroy_process_group()


class RankPool:
    """`world_size` ranks in a gloo process group; `run(fn, *args)` calls
    `fn(rank, world_size, *args)` on every rank and returns each rank's outcome."""

    def __init__(self, world_size: int, collective_timeout_s: float = 60):
        self.world_size = world_size
        self.collective_timeout_s = collective_timeout_s
        self._procs: list = []

    def _start(self) -> None:
        ctx = processes()
        self._tmp = tempfile.TemporaryDirectory()
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(self.world_size)]
        init_file = self._init_file = os.path.join(self._tmp.name, "rendezvous")
        self._procs = [ctx.Process(target=_serve, args=(r, self.world_size, init_file, self._tasks[r], self._results,
                                                        self.collective_timeout_s), daemon=True)
                       for r in range(self.world_size)]
        for proc in self._procs:
            proc.start()

    def run(self, fn, *args, deadline_s: float = 300) -> list[dict]:
        """[{"value": ...} or {"error": traceback}] by rank; raises if a rank dies, or does not answer
        within `deadline_s` of the start or of the last answer."""
        if not self._procs:
            self._start()
        for tasks in self._tasks:
            tasks.put((fn, args))
        outcomes: dict[int, dict] = {}

        def record(answer: tuple) -> float:
            """Keep a rank's answer; the next is due within `deadline_s` of it."""
            rank, status, value = answer
            outcomes[rank] = {"value": value} if status == "ok" else {"error": value}
            return time.monotonic() + deadline_s

        deadline = time.monotonic() + deadline_s
        try:
            while len(outcomes) < self.world_size:
                missing = sorted(set(range(self.world_size)) - set(outcomes))
                try:  # polled, so a rank that dies (a crash, a kill) ends the run at once
                    answer = self._results.get(timeout=1.0)
                except queue.Empty:
                    dead = [r for r in missing if self._procs[r].exitcode is not None]
                    if dead:
                        with contextlib.suppress(queue.Empty):  # it may have answered just before
                            answer = self._results.get(timeout=1.0)
                            deadline = record(answer)
                            continue
                        raise AssertionError(f"rank {dead[0]} exited with code {self._procs[dead[0]].exitcode} "
                                             f"without answering; {self._crash(dead[0])}") from None
                    if time.monotonic() > deadline:
                        raise AssertionError(f"ranks {missing} did not finish within {deadline_s}s; where they "
                                             f"were:\n{self._stacks(missing)}") from None
                    continue
                deadline = record(answer)
        finally:
            if len(outcomes) < self.world_size or any("error" in o for o in outcomes.values()):
                # A rank that has not answered is stuck (or dead): it would not take the pool's end.
                self.close(unanswered=set(range(self.world_size)) - set(outcomes))
        return [outcomes[r] for r in range(self.world_size)]

    def _stacks(self, ranks: list[int]) -> str:
        """The Python stacks of every thread of `ranks` (faulthandler's dump, on SIGUSR1)."""
        for rank in ranks:
            os.kill(self._procs[rank].pid, signal.SIGUSR1)
        time.sleep(2)
        dumps = []
        for rank in ranks:
            with open(_stacks_file(self._init_file, rank)) as f:
                dumps.append(f"rank {rank}:\n{f.read()}")
        return "\n".join(dumps)

    def _crash(self, rank: int) -> str:
        """What faulthandler wrote of `rank`'s crash, without its list of the process's extension
        modules (hundreds of compiled kernels' names), or where else to look."""
        report = []
        with contextlib.suppress(FileNotFoundError):  # a rank that died before it opened the file
            with open(_stacks_file(self._init_file, rank)) as f:
                report = [line for line in f.read().splitlines() if not line.startswith("Extension modules:")]
        if not report:
            return "its stderr, above, says why"
        return "its stacks:\n" + "\n".join(report) + "\n(a C library's own message is in its stderr, above)"

    def close(self, unanswered: set[int] = frozenset()) -> None:
        """End the ranks: those in `unanswered` at once, the others when they take the pool's end
        (within 10 s)."""
        for rank in unanswered:
            self._procs[rank].kill()
        for tasks in self._tasks if self._procs else ():
            tasks.put(None)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if self._procs:
            self._tmp.cleanup()
        self._procs = []
