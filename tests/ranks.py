"""Run a function on N real processes over gloo, as torchrun would, and collect results.

A rank that raises makes the whole run fail with that rank's traceback; its
peers are stopped rather than left waiting in a collective, and every run has
a hard deadline.
"""
from __future__ import annotations

import os
import queue
import tempfile
import traceback
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    def __init__(self, rank: int, text: str):
        self.rank, self.text = rank, text
        super().__init__(f"rank {rank} failed:\n{text}")


def _worker(rank, world_size, init_file, fn, args, results, collective_timeout_s):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
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


def run_ranks(fn, world_size: int, *args, deadline_s: float = 240, collective_timeout_s: float = 60):
    """fn(rank, world_size, *args) on each rank; returns the list of return values by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, results, collective_timeout_s))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        values: dict[int, object] = {}
        try:
            while len(values) < world_size:
                try:
                    rank, status, value = results.get(timeout=deadline_s)
                except queue.Empty:
                    raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(values))} did not finish "
                                         f"within {deadline_s}s") from None
                if status == "error":
                    raise RankFailed(rank, value)
                values[rank] = value
        finally:
            for p in procs:
                p.join(timeout=5)
                if p.is_alive():
                    p.kill()
                    p.join()
    return [values[r] for r in range(world_size)]
