"""How a failure on one rank ends the step on every rank, each naming the rank that failed.

A step is one protocol over all ranks: when one rank stops mid-step, its peers
are left blocked in a receive or a collective that it will never join. They
end when their transport gives up: at once when the failed rank's process
exits and its connections close ("Connection closed by peer"), as under
torchrun, or at the process group's timeout while it lives on. Neither error
names the rank that failed, nor why.

So the first rank to fail records its failure (rank, where, error text) in the
process group's store, which every rank can read, before it re-raises; any
rank whose step then fails looks the record up and raises a `PeerFailedError`
naming that rank, from its own (communication) error. The record is written
with a store round trip (`compare_set`), so it is readable before the failed
rank's connections can close. The store is touched only on failure: the
success path costs one counter increment per step.

The failed rank does not tear its communication down to wake its peers sooner:
with gloo, `ProcessGroup.abort()` and `shutdown()` do nothing, and
`destroy_process_group()` leaves the connections open while any of the rank's
own operations are pending (the receives its program posted ahead), so only
the process's exit closes them. Destroying the caller's process group from
inside a step would also be a surprise to any code that handles the error.

One record is kept, the first failure of the latest failed call; it carries
the number of the step call it comes from (every rank calls the compiled steps
in the same order, so the numbers agree across ranks). Calls are numbered per
process group, over every compiled step that talks over it: steps of two models
interleave in one protocol, and a rank may be blocked in one model's step on a
peer that failed in the other's. A failure of a rank
that had started its program is blamed within `world_size` calls of it: a peer
may be a few calls ahead of a rank it stopped depending on (at most one call
per hop between them). A failure before the program started (bad input) is
blamed only within its own call: if every rank rejected the same input and the
caller went on, that record must not be blamed for a later failure.
"""
from __future__ import annotations

import json
import weakref
from dataclasses import asdict, dataclass
from typing import NoReturn

import torch.distributed as dist

from ..errors import PeerFailedError

_KEY = "piper_fx/first_failure"
_MAX_ERROR_CHARS = 2000

# The number of the next step call over each process group: the group's, dropped with it
# (a new group, e.g. after `destroy_process_group`, numbers its calls from 0).
_calls: weakref.WeakKeyDictionary[dist.ProcessGroup, list[int]] = weakref.WeakKeyDictionary()


def next_call() -> int:
    """Number this call of a compiled step: one per call, over every step run over
    the default process group (0 without one: there is no peer to tell)."""
    if not dist.is_initialized():
        return 0
    count = _calls.setdefault(dist.group.WORLD, [0])
    count[0] += 1
    return count[0] - 1


def upcoming_call() -> int:
    """The number `next_call` will give the coming call, not taken: that of a step being
    compiled before its call runs."""
    if not dist.is_initialized():
        return 0
    return _calls.get(dist.group.WORLD, [0])[0]


@dataclass(frozen=True)
class Failure:
    call: int
    rank: int
    where: str  # e.g. "in task B0.2", "while receiving add_6 (microbatch 1) from rank 1"
    error: str  # "ValueError: message"
    started: bool  # whether the rank had started its program: peers may be blocked mid-protocol on it

    def explains(self, call: int, window: int) -> bool:
        """Whether this failure may be what stopped a rank in step call `call`."""
        return self.call == call or (self.started and abs(self.call - call) <= window)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @staticmethod
    def decode(raw: bytes) -> "Failure":
        return Failure(**json.loads(raw))


def _describe(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}"
    return text if len(text) <= _MAX_ERROR_CHARS else text[:_MAX_ERROR_CHARS] + " ..."


def _first_failure(mine: Failure) -> Failure:
    """The failure every rank reports for `mine`'s step call: a relevant one already
    recorded, else `mine`, recorded atomically (of ranks failing at once, the first
    to write wins; the others get its record back)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return mine  # no peer to tell
    store = dist.group.WORLD.get_group_store()
    window = dist.get_world_size()
    # `check` first: `get` of a missing key blocks for the store's whole timeout.
    current = store.get(_KEY) if store.check([_KEY]) else b""
    if current and Failure.decode(current).explains(mine.call, window):
        return Failure.decode(current)
    # Replace a stale record, or none, only if no other rank did since we read it.
    return Failure.decode(store.compare_set(_KEY, current, mine.encode()))


def raise_failure(error: Exception, rank: int, call: int, where: str, started: bool = True) -> NoReturn:
    """Raise what this rank's step ends with when `error` stopped it `where`.

    Call it while handling `error`. `started`: whether this rank had started
    running its program; a failure before that (a rejected argument) concerns
    this rank alone, so it is recorded for the peers but always raised as
    itself. Otherwise, if another rank recorded a failure of this step first,
    raises `PeerFailedError` naming it, from `error` and with a note quoting
    it. Else this failure is recorded for the other ranks and `error` itself is
    re-raised, its type and traceback unchanged, with a note naming this rank
    and `where`.
    """
    mine = Failure(call, rank, where, _describe(error), started)
    try:
        first = _first_failure(mine)
    except Exception as store_error:  # noqa: BLE001 - the step's own error matters more than the record
        error.add_note(f"piper_fx rank {rank}: failed {where} (not recorded for the other ranks: "
                       f"{_describe(store_error)})")
        raise error
    if started and first.rank != rank:
        peer_failed = PeerFailedError(rank, where, first.rank, first.where, first.error)
        # Dynamo re-raises a PiperError `from None` out of a compiled frame, dropping the chain:
        # a note keeps this rank's own error in the traceback through torch.compile too.
        peer_failed.add_note(f"piper_fx rank {rank} stopped on: {_describe(error)}")
        raise peer_failed from error
    error.add_note(f"piper_fx rank {rank}: failed {where}")
    raise error
