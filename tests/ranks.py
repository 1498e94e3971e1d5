"""Run a function on N real processes over gloo, as torchrun would, and collect results.

Every run has a hard deadline, and its processes are killed when it ends, so a
rank stuck in a collective never outlives the test.
"""
from __future__ import annotations

import atexit
import contextlib
import multiprocessing.forkserver
import os
import queue
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from typing import Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


# What the server below imports once for every process the tests start.
PRELOADED = ("training", "transformers")


def processes():
    """The multiprocessing context of every process the tests start (ranks, and the processes
    that plan on a fake process group): each is forked from one server process (`forkserver`)
    that imported torch, piper_fx, the tests' training code and transformers once for the
    session, so it starts in tens of milliseconds where a new interpreter importing them takes
    3-4 s (the suite starts processes tens of times). Each is still a fresh process: the server
    only imported modules, so no process group, compiled code or cache carries over, and torch's
    random state is a new interpreter's.
    Its environment is the session's when the server started (conftest sets what the tests
    need before any test runs), not a later change to `os.environ`."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOADED))
    # Python 3.11's server does not take the caller's `sys.path` (its children do): it finds the
    # tests' modules through PYTHONPATH, set while it starts (a no-op once it runs).
    with mock.patch.dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)):
        multiprocessing.forkserver.ensure_running()
    return ctx


class RankFailed(AssertionError):
    def __init__(self, rank: int, text: str):
        self.rank, self.text = rank, text
        super().__init__(f"rank {rank} failed:\n{text}")


def _worker(rank, world_size, init_file, fn, args, results, collective_timeout_s):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    # Up to 4 ranks share 2 cores: one thread each avoids oversubscription.
    torch.set_num_threads(1)
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # not a silent eager run (conftest)
    try:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=collective_timeout_s))
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", value))
    except BaseException:  # noqa: BLE001 - everything a rank raises goes back to the test
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _spawned(fn, world_size, args, deadline_s, collective_timeout_s) -> Iterator:
    """Start the ranks; yield a function returning the next (rank, status, value)."""
    ctx = processes()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results, collective_timeout_s))
                 for r in range(world_size)]
        for p in procs:
            p.start()

        deadline = time.monotonic() + deadline_s

        def next_result(waiting_for):
            # Polled, so a rank that dies without reporting (killed, or failing to unpickle `fn`
            # because an import fails) ends the run at once rather than at the deadline.
            while time.monotonic() < deadline:
                try:
                    return results.get(timeout=min(1.0, max(0.0, deadline - time.monotonic())))
                except queue.Empty:
                    pass
                dead = [r for r in sorted(waiting_for) if procs[r].exitcode not in (None, 0)]
                if dead:
                    with contextlib.suppress(queue.Empty):
                        return results.get(timeout=1.0)  # it may have reported just before dying
                    raise RankFailed(dead[0], f"its process exited with code {procs[dead[0]].exitcode} "
                                              "before reporting (its stderr is above)")
            raise AssertionError(f"ranks {sorted(waiting_for)} did not finish within {deadline_s}s")

        try:
            yield next_result
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()


# The session's rank processes, one pool per world size (`rank_pool.RankPool`).
_POOLS: dict = {}


def pool(world_size: int):
    """The session's pool of `world_size` rank processes, started on first use."""
    from rank_pool import RankPool

    if not _POOLS:
        atexit.register(close_pools)
    return _POOLS.setdefault(world_size, RankPool(world_size))


def close_pools() -> None:
    for started in _POOLS.values():
        started.close()
    _POOLS.clear()


def run_ranks(fn, world_size: int, *args, deadline_s: float = 240, collective_timeout_s: float | None = None,
              fresh: bool = False):
    """fn(rank, world_size, *args) on each rank; return values by rank. A failing rank raises.

    By default it runs on the session's pool of `world_size` ranks, which
    keeps its process group and its processes' warm state (Dynamo's, Inductor's
    loaded code) from run to run. With `fresh=True` or a
    `collective_timeout_s` it starts processes for this run alone: for a run
    that must begin in new processes (resuming a checkpoint), or that needs its
    own timeout.
    """
    if not fresh and collective_timeout_s is None:
        outcomes = pool(world_size).run(fn, *args, deadline_s=deadline_s)
        for rank, outcome in enumerate(outcomes):
            if "error" in outcome:
                raise RankFailed(rank, outcome["error"])
        return [outcome["value"] for outcome in outcomes]
    values: dict[int, object] = {}
    collective_timeout_s = 60 if collective_timeout_s is None else collective_timeout_s
    with _spawned(fn, world_size, args, deadline_s, collective_timeout_s) as next_result:
        while len(values) < world_size:
            rank, status, value = next_result(set(range(world_size)) - set(values))
            if status == "error":
                raise RankFailed(rank, value)
            values[rank] = value
    return [values[r] for r in range(world_size)]


def run_ranks_collect(fn, world_size: int, *args, deadline_s: float = 240, collective_timeout_s: float = 60):
    """Like `run_ranks`, but waits for every rank: [{"value": ...} or {"error": traceback}] by rank."""
    outcomes: dict[int, dict] = {}
    with _spawned(fn, world_size, args, deadline_s, collective_timeout_s) as next_result:
        while len(outcomes) < world_size:
            rank, status, value = next_result(set(range(world_size)) - set(outcomes))
            outcomes[rank] = {"value": value} if status == "ok" else {"error": value}
    return [outcomes[r] for r in range(world_size)]
