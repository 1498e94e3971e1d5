"""Placement changes, and the collective each one is.

A strategy pass says what becomes of a value's placement, and where: it
inserts a `piper::redistribute(x, src, dst, group, ...)` marker (with
`state_redistribution`), saying that `x`, placed `src` over the process group,
is needed placed `dst`. The pass `lower_redistributions` then turns every
marker into code from one table, the only place where a placement change
becomes a collective:

| src            | dst           | collective                                              |
|----------------|---------------|---------------------------------------------------------|
| `Shard(0)`     | `Replicate()` | all-gather of the row shards, padding cut               |
| `Partial(avg)` | `Shard(0)`    | reduce-scatter (avg) into this rank's rows              |
| `Partial(avg)` | `Replicate()` | all-reduce (avg)                                        |
| `Replicate()`  | `Shard(0)`    | none: this rank's rows of the value                     |
| `Shard(0)`     | `Shard(1)`    | all-to-all of dim 0's equal blocks                      |

Row shards follow `collectives.lowering`'s layout (DTensor's `Shard(0)`:
`ceil(rows / group_size)` rows per rank, the last ones padded). The all-to-all
row reads a rank's value as one row of the block matrix `B[source][destination]`
of the group (`global_shape` is `(group_size, group_size * block_rows, ...)`):
each rank holds its row (`Shard(0)`: the blocks it sends, one per destination),
and gets its column (`Shard(1)`: the blocks every source sent it, in source
order); the two local values have the same shape. Exchanging an expert-major
layout for a rank-major one and back is this one change (`passes.shard_experts`).

Eagerly (outside a traced graph) the marker runs its row of the table, so a
graph holding markers still computes the right values.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from .emit import insert_call
from .lowering import all_reduce_mean, all_to_all_experts, gather_rows, reduce_scatter_rows, take_rows

AVG = Partial("avg")
_PLACEMENTS: dict[str, Placement] = {"Shard(0)": Shard(0), "Shard(1)": Shard(1), "Replicate()": Replicate(),
                                     "Partial(avg)": AVG}


def placement_name(placement: Placement) -> str:
    """The name a placement has in a marker's arguments (`Shard(0)`, `Replicate()`, `Partial(avg)`)."""
    for name, known in _PLACEMENTS.items():
        if known == placement:
            return name
    raise ValueError(f"piper_fx redistributes only between {', '.join(_PLACEMENTS)}, not {placement}")


@dataclass(frozen=True)
class Redistribution:
    """One placement change over one process group, as a marker states it."""

    src: Placement
    dst: Placement
    group_name: str
    group_size: int
    group_rank: int
    global_shape: tuple[int, ...]

    @classmethod
    def of(cls, marker: fx.Node) -> "Redistribution":
        _, src, dst, group_name, group_size, group_rank, global_shape = marker.args
        return cls(_PLACEMENTS[src], _PLACEMENTS[dst], group_name, group_size, group_rank, tuple(global_shape))

    @property
    def shard_rows(self) -> int:
        rows = self.global_shape[0] if self.global_shape else 1
        return math.ceil(rows / self.group_size)

    def local_shape(self, placement: Placement) -> tuple[int, ...]:
        """The shape of this rank's value when placed `placement`."""
        if Shard(1) in (self.src, self.dst):  # an exchange of blocks: a rank's row or column, both flat
            return (self.global_shape[1], *self.global_shape[2:])
        if placement == Shard(0):
            return (self.shard_rows, *self.global_shape[1:])
        return self.global_shape


@dataclass(frozen=True)
class Lowering:
    """A row of the table: the collective's kind (None: local) and its code for one change."""

    kind: str | None
    code: Callable[[Redistribution], Callable[[torch.Tensor], torch.Tensor]]


LOWERINGS: dict[tuple[Placement, Placement], Lowering] = {
    (Shard(0), Replicate()): Lowering("all_gather", lambda r: functools.partial(
        gather_rows, full_shape=list(r.global_shape), group_size=r.group_size, group_name=r.group_name)),
    (AVG, Shard(0)): Lowering("reduce_scatter", lambda r: functools.partial(
        reduce_scatter_rows, shard_rows=r.shard_rows, group_size=r.group_size, group_name=r.group_name)),
    (AVG, Replicate()): Lowering("all_reduce", lambda r: functools.partial(
        all_reduce_mean, group_name=r.group_name)),
    (Replicate(), Shard(0)): Lowering(None, lambda r: functools.partial(
        take_rows, shard_rows=r.shard_rows, group_size=r.group_size, group_rank=r.group_rank)),
    (Shard(0), Shard(1)): Lowering("all_to_all", lambda r: functools.partial(
        all_to_all_experts, group_size=r.group_size, group_name=r.group_name)),
}


def lowering_of(redistribution: Redistribution) -> Lowering:
    """The table's row for a change; a `KeyError` naming the change if it has none."""
    key = (redistribution.src, redistribution.dst)
    if key not in LOWERINGS:
        raise KeyError(f"no collective turns {placement_name(redistribution.src)} into "
                       f"{placement_name(redistribution.dst)}")
    return LOWERINGS[key]


@torch.library.custom_op("piper::redistribute", mutates_args=())
def _redistribute(x: torch.Tensor, src: str, dst: str, group_name: str, group_size: int, group_rank: int,
                  global_shape: list[int]) -> torch.Tensor:
    change = Redistribution(_PLACEMENTS[src], _PLACEMENTS[dst], group_name, group_size, group_rank,
                            tuple(global_shape))
    return lowering_of(change).code(change)(x).clone()


@_redistribute.register_fake
def _(x, src, dst, group_name, group_size, group_rank, global_shape):
    change = Redistribution(_PLACEMENTS[src], _PLACEMENTS[dst], group_name, group_size, group_rank,
                            tuple(global_shape))
    return x.new_empty(change.local_shape(change.dst))


REDISTRIBUTE = torch.ops.piper.redistribute.default


def is_redistribution(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is REDISTRIBUTE


def state_redistribution(graph: fx.Graph, value: fx.Node, src: Placement, dst: Placement, *, group_name: str,
                         group_size: int, group_rank: int, global_shape, before: fx.Node,
                         like: fx.Node | None = None, meta: dict | None = None) -> fx.Node:
    """Insert, before `before`, the marker saying `value` (placed `src` over the group)
    is needed placed `dst`; return it. `global_shape` is the whole value's shape.
    The marker inherits `like`'s annotations and takes `meta` (what the collective
    will carry: its note, phase, unit)."""
    args = (value, placement_name(src), placement_name(dst), group_name, group_size, group_rank,
            [int(d) for d in global_shape])
    return insert_call(graph, REDISTRIBUTE, args, before=before, like=like, meta=meta)
