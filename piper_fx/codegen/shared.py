"""Each distinct task compiled once among the ranks that share a compile cache.

Ranks of a data-parallel group run the same task graphs (bucketing names no rank,
`passes.bucket_collectives`), and a rank's pipeline stages often repeat another's
layers. Inductor's FX graph cache (TORCHINDUCTOR_CACHE_DIR) lets any process load
code another compiled, but ranks that compile at the same time all miss it and
each compiles everything. So, under Inductor, the ranks first exchange what they
are about to compile: the key of each task (its code and its inputs' layouts) and
where their cache is (host and directory). Every distinct task is given to one
rank of those holding it with the same cache, the least loaded so far (by nodes,
largest first), the same answer on every rank. Each rank compiles what it was
given; then all ranks wait for each other, and compile the rest, which they now
load from the cache (a rank whose cache does not have it, say on another file
system, compiles it: slower, never wrong).

A rank whose own compiles fail tells its peers in that wait: it raises its own
error, they a `PiperError` naming it, instead of waiting for it in the step.
Without a process group (one process, or the fake group that plans large worlds)
there is no one to share with and nothing is exchanged.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import socket
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from ..compat import inductor_cache_dir, inductor_config
from ..errors import PiperError
from ..ir import Task


@dataclass(frozen=True)
class Shares:
    """This rank's tasks in the order to compile them: `first` before the ranks wait for
    each other (those given to it), `then` after (those a peer compiles)."""

    first: list[Task]
    then: list[Task]
    exchanged: bool  # whether the ranks exchanged their tasks (and so must wait for each other)


def code_key(gm: fx.GraphModule) -> str:
    """What Inductor's FX graph cache keys a task's (or a region's) graph by, as far as ranks
    and tasks can differ in it: its code (values named by position,
    `inductor.name_by_position`) and its inputs' layouts."""
    digest = hashlib.sha256(gm.code.encode())
    for node in gm.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            digest.update(repr((tuple(val.shape), val.stride(), val.dtype, val.device)).encode())
        else:
            digest.update(repr(val).encode())
    return digest.hexdigest()


def _exchanging() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 \
        and dist.get_backend() != "fake"


def _cache() -> str | None:
    """Where compiled code goes that other processes can load: (host, directory), or None
    where Inductor's FX graph cache is off."""
    if not inductor_config.fx_graph_cache:
        return None
    return f"{socket.gethostname()}:{os.path.realpath(inductor_cache_dir())}"


def assign(everyone: Sequence[tuple[str | None, Sequence[tuple[str, int]]]]) -> dict[tuple[str, str], int]:
    """Who compiles what: for each rank's (cache, [(task key, cost)]), each distinct
    (cache, key) -> the rank that compiles it, among those holding it: the least loaded
    so far, the costliest tasks given out first; ties to the lowest rank."""
    holders: dict[tuple[str, str], list[int]] = {}
    costs: dict[tuple[str, str], int] = {}
    for rank, (cache, tasks) in enumerate(everyone):
        if cache is None:
            continue
        for key, cost in tasks:
            holders.setdefault((cache, key), []).append(rank)
            costs[(cache, key)] = cost
    load = [0] * len(everyone)
    owner: dict[tuple[str, str], int] = {}
    for held in sorted(holders, key=lambda held: (-costs[held], held)):
        rank = min(holders[held], key=lambda r: (load[r], r))
        owner[held] = rank
        load[rank] += costs[held]
    return owner


def share(tasks: Sequence[Task], keys: Sequence[str]) -> Shares:
    """Exchange the tasks about to be compiled, with their `code_key`s, with every rank
    (collective, under a process group) and split them into this rank's share and the rest."""
    if not _exchanging():
        return Shares(list(tasks), [], exchanged=False)
    cache = _cache()
    mine = (cache, [(key, len(task.graph.graph.nodes)) for key, task in zip(keys, tasks)])
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    owner = assign(everyone)
    rank = dist.get_rank()
    first, then, seen = [], [], set()
    for key, task in zip(keys, tasks):
        # Ours to compile, or no one's (no shared cache): the first of its kind now; any
        # repeat of it on this rank after, with the peers' (its code reused in the process).
        ours = cache is None or owner[(cache, key)] == rank
        (first if ours and key not in seen else then).append(task)
        seen.add(key)
    return Shares(first, then, exchanged=True)


def compile_shares(shares: Shares, compile_one: Callable[[Task], None],
                   wait: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Compile this rank's share, wait for every rank to compile theirs (inside `wait()`),
    then the rest. If this rank's share fails, the peers hear of it in the wait."""
    failure = None
    try:
        for task in shares.first:
            compile_one(task)
    except Exception as error:
        failure = error
        if not shares.exchanged:
            raise
    if shares.exchanged:
        with wait():
            _agree(failure)
    for task in shares.then:
        compile_one(task)


def _agree(failure: Exception | None) -> None:
    """Every rank's outcome of its share: raise this rank's own error, or a `PiperError`
    naming the first rank that failed."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if failure is None else f"{type(failure).__name__}: {failure}"[:2000])
    if failure is not None:
        raise failure
    for rank, outcome in enumerate(everyone):
        if outcome is not None:
            raise PiperError(f"piper_fx rank {rank} failed to compile its tasks, so this rank stops too: {outcome}")
