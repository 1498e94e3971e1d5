"""Each distinct task compiled once among the ranks that share a compile cache.

Ranks of a data-parallel group run the same task graphs (bucketing names no rank,
`passes.bucket_collectives`), and a rank's pipeline stages often repeat another's
layers. Inductor's FX graph cache (TORCHINDUCTOR_CACHE_DIR) lets any process load
code another compiled, but ranks that compile at the same time all miss it and
each compiles everything. So, under Inductor, the ranks claim what they compile:
each rank goes through its distinct tasks, costliest first (by nodes), and
compiles a task only if it is the first rank to claim it, in the default process
group's store (an atomic `add` on a key of the task's code key and where the
rank's cache is: host and directory). A rank that finishes early claims what is
left, so the ranks finish their shares together, whatever each task's compile
takes (a split fixed in advance by node count left one rank of a 12-block
ZeRO-3 GPT waiting 3-5 s for the other). A rank marks each task it compiled
done in the store, and compiles the rest once their claimers marked them done,
loading them from the cache. Ranks with different caches (say on different
file systems) claim apart, each group compiling for itself: slower, never wrong.

A model's first compile is every rank's at once (its first call), so the ranks
agree on a name to claim under, fresh for the compile, and wait for each other
before the rest: a rank whose own compiles fail tells its peers there (it
raises its own error, they a `PiperError` naming it) instead of leaving them
waiting for it in the step. A later compile (a step for another batch shape,
a recompile) may be one rank's alone while its peers run their steps, as when
each rank pads its batch to its own longest sequence: it exchanges nothing
(a collective would meet the peers' step collectives) and claims under one name
for all later compiles; a peer that compiles the same task then waits for its
mark, and a claimer's failure is in the mark. Without a process group (one
process, or the fake group that plans large worlds) there is no one to share
with and nothing is claimed.
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

from ..compat import default_store, inductor_cache_dir, inductor_config, qualified_name
from ..errors import PiperError
from ..ir import Task


@dataclass(frozen=True)
class Shares:
    """This rank's tasks in the order to compile them: `first` before the ranks wait for
    each other (its distinct tasks with their code keys, costliest first, each compiled here
    if `claim` gives its key to this rank), `then` after (repeats, and those a peer claimed)."""

    first: list[tuple[Task, str]]
    then: list[Task]
    claim: Claims | None  # None: nothing exchanged, compile all of `first`
    together: bool = False  # every rank compiles now: they wait for each other, hearing of failures


def code_key(gm: fx.GraphModule) -> str:
    """What Inductor's FX graph cache keys a task's graph by, as far as ranks and tasks can
    differ in it (`span_key` of the whole graph)."""
    nodes = [node for node in gm.graph.nodes if node.op not in ("placeholder", "output")]
    output = next(node for node in reversed(gm.graph.nodes) if node.op == "output")
    return span_key(gm.graph.find_nodes(op="placeholder"), nodes, output.args[0])


class _Value:
    """A value of a graph in its key, by position: `%v3` (a string argument `"v3"` reads `'v3'`)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"%{self.name}"


def span_key(inputs: Sequence[fx.Node], nodes: Sequence[fx.Node], outputs: object) -> str:
    """The key of the graph that takes `inputs`, runs `nodes` and returns `outputs` (a
    structure of nodes): each node's op, target and arguments, values named by position
    as in the code of that graph (`inductor.name_by_position`), with the inputs' layouts.
    Equal for graphs with equal code and input layouts, read off the nodes without making
    the graph (a region of a task is made a graph only if it is the first with its key)."""
    position = {node: _Value(f"in{index}") for index, node in enumerate(inputs)}
    position.update((node, _Value(f"v{index}")) for index, node in enumerate(nodes))
    digest = hashlib.sha256()
    for node in inputs:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            digest.update(repr((tuple(val.shape), val.stride(), val.dtype, val.device)).encode())
        else:
            digest.update(repr(val).encode())
    for node in nodes:
        target = node.target if isinstance(node.target, str) else qualified_name(node.target)
        digest.update(repr((node.op, target, fx.map_arg((node.args, node.kwargs), position.__getitem__))).encode())
    digest.update(repr(fx.map_arg(outputs, position.__getitem__)).encode())
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


class Claims:
    """Which rank compiles each task, claimed in `store` under `prefix`: the first rank to
    claim a (cache, code key) compiles it, for every rank sharing that cache, and marks it
    done (or failed, with its error). A rank without a shared cache (`cache` None)
    compiles everything it holds, for no one."""

    def __init__(self, store: dist.Store, prefix: str, cache: str | None):
        self.store, self.prefix, self.cache = store, prefix, cache

    def _name(self, key: str) -> str:
        digest = hashlib.sha256(f"{self.cache}\0{key}".encode()).hexdigest()[:32]
        return f"{self.prefix}/{digest}"

    def __call__(self, key: str) -> bool:
        if self.cache is None:
            return True
        return self.store.add(self._name(key), 1) == 1

    def mark(self, key: str, failure: str = "") -> None:
        """Mark the task this rank claimed compiled (into the cache), or failed to, with `failure`."""
        if self.cache is not None:
            self.store.set(f"{self._name(key)}/done", failure)

    def wait(self, key: str) -> None:
        """Until the task a peer claimed is marked; a `PiperError` naming the peer if it failed."""
        if self.cache is None:
            return
        self.store.wait([f"{self._name(key)}/done"])
        failure = self.store.get(f"{self._name(key)}/done").decode()
        if failure:
            raise PiperError(f"piper_fx {failure}")


def order(costs: Sequence[int], keys: Sequence[str]) -> tuple[list[int], list[int]]:
    """Of tasks with these costs and code keys: the indices to claim, each distinct key's
    first, costliest first, ties by key, the same order on every rank; and the rest (repeats)."""
    first: dict[str, int] = {}
    rest = []
    for index, key in enumerate(keys):
        if key in first:
            rest.append(index)
        else:
            first[key] = index
    return sorted(first.values(), key=lambda index: (-costs[index], keys[index])), rest


def share(tasks: Sequence[Task], keys: Sequence[str], together: bool) -> Shares:
    """The tasks about to be compiled, with their `code_key`s, in the order to claim and
    compile them. Collective where every rank compiles `together` (a model's first compile):
    the ranks agree on where to claim; a later compile claims where every later one does."""
    if not _exchanging():
        return Shares(list(zip(tasks, keys)), [], claim=None)
    if together:  # each such compile claims under a name of its own, rank 0's: the store outlives it
        nonce = [os.urandom(16).hex()]
        dist.broadcast_object_list(nonce, src=0)
        prefix = f"piper_fx/compile/{nonce[0]}"
    else:
        prefix = "piper_fx/compile/later"
    claims = Claims(default_store(), prefix, _cache())
    firsts, rest = order([len(task.graph.graph.nodes) for task in tasks], keys)
    return Shares([(tasks[index], keys[index]) for index in firsts], [tasks[index] for index in rest], claims,
                  together)


def compile_shares(shares: Shares, compile_one: Callable[[Task], None],
                   wait: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Compile the tasks this rank claims, marking each; if every rank compiles `together`,
    wait for all of them to compile theirs (inside `wait()`, where the peers hear of this
    rank's failure); then the rest, each once its claimer marked it (inside `wait()`)."""
    failure = None
    later = []
    try:
        for task, key in shares.first:
            if shares.claim is None or shares.claim(key):
                try:
                    compile_one(task)
                except Exception as error:
                    if shares.claim is not None:
                        shares.claim.mark(key, f"rank {dist.get_rank()} failed to compile a task this rank compiles "
                                               f"too, so this rank stops too: {_described(error)}")
                    raise
                if shares.claim is not None:
                    shares.claim.mark(key)
            else:
                later.append((task, key))
    except Exception as error:
        failure = error
        if shares.claim is None or not shares.together:
            raise
    if shares.together:
        with wait():
            _agree(failure)
    for task, key in later:
        with wait():
            shares.claim.wait(key)
        compile_one(task)
    for task in shares.then:
        compile_one(task)


def _described(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:2000]


def _agree(failure: Exception | None) -> None:
    """Every rank's outcome of its share: raise this rank's own error, or a `PiperError`
    naming the first rank that failed."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, None if failure is None else _described(failure))
    if failure is not None:
        raise failure
    for rank, outcome in enumerate(everyone):
        if outcome is not None:
            raise PiperError(f"piper_fx rank {rank} failed to compile its tasks, so this rank stops too: {outcome}")
