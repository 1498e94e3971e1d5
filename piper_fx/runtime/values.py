"""The values a program holds while it runs: in slots (`Values`), and, while the runtime
still measures what the program makes, counted by memory part as they come and go
(`CountedValues` reporting to `HeldBytes`, whose peak is a run's `MemoryProfile`)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import torch

from .memory import MEMORY_PARTS, TaskPeak, storage_key

Key = tuple[str, "int | None"]  # a value's name and microbatch (None: one value a step)


class HeldBytes:
    """Bytes of the values the program makes and holds, by memory part (`MEMORY_PARTS`),
    kept up to date as values come and go (a scan of every value after every instruction
    cost a tenth of a pipeline step), and the most held at once with its parts.
    The step's inputs (batch, parameters) and views of them, such as a transposed
    weight, are not values it counts; what the step holds throughout (parameters,
    optimizer state, gradients from before) is added to the peak afterwards
    (`MemoryProfile.with_held`): held all step, it does not move the peak.
    A storage shared by several values counts once, in the part of the first."""

    def __init__(self, part_of: dict[str, str | None], input_storages: set[int]):
        # Value name -> its part where the name decides it (None for the step's inputs);
        # any other value's part follows from its key.
        self.part_of = part_of
        self.input_storages = input_storages
        self.live: dict[int, list] = {}  # storage (`storage_key`) -> [bytes, values on it, part]
        self.parts = dict.fromkeys(MEMORY_PARTS, 0)
        self.total = 0
        self.peak_parts = dict(self.parts)
        self.peak_total = 0
        self.activation_peak = 0

    def add(self, key: Key, value) -> int | None:
        """Count `value` set under `key`; the storage (`storage_key`) it is counted on, or
        None where it is not counted (not a tensor, or the step's input)."""
        name, microbatch = key
        part = self.part_of[name] if name in self.part_of else (
            "activations" if microbatch is not None else "communication_buffers")
        if part is None or not isinstance(value, torch.Tensor):
            return None
        return self.hold(value, part)

    def hold(self, tensor: torch.Tensor, part: str) -> int | None:
        """Count `tensor` in `part`, unless its storage is counted already or is the step's
        input; the storage it is counted on, or None."""
        storage = tensor.untyped_storage()
        key = storage._cdata  # `storage_key`, with the storage at hand for its size
        if key in self.input_storages:
            return None
        entry = self.live.get(key)
        if entry is None:
            size = storage.nbytes()
            self.live[key] = [size, 1, part]
            self.parts[part] += size
            self.total += size
        else:
            entry[1] += 1
        return key

    def release(self, tensor: torch.Tensor) -> None:
        """Stop counting `tensor`, which `hold` counted."""
        self.release_storage(storage_key(tensor))

    def release_storage(self, storage: int) -> None:
        """Stop counting one value on `storage` (`storage_key`)."""
        entry = self.live.get(storage)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.parts[entry[2]] -= entry[0]
            self.total -= entry[0]
            del self.live[storage]

    def observe(self) -> None:
        """Note what is held now."""
        self.activation_peak = max(self.activation_peak, self.parts["activations"])
        if self.total > self.peak_total:
            self.peak_total = self.total
            self.peak_parts = {**self.parts, "task_temporaries": 0}

    def observe_task(self, peak: TaskPeak, released: list[int | None]) -> None:
        """Note what is held at the `peak` of a task about to run, which frees by then its
        inputs (those at `peak.released`) counted on the storages `released` (one entry
        per input: a storage is freed once every value the runtime holds on it is)."""
        total = self.total + peak.made
        freed: dict[str, int] = {}
        for storage, values in Counter(s for s in released if s is not None).items():
            entry = self.live.get(storage)
            if entry is not None and entry[1] == values:  # no other value holds its storage
                freed[entry[2]] = freed.get(entry[2], 0) + entry[0]
                total -= entry[0]
        if total > self.peak_total:
            self.peak_total = total
            self.peak_parts = {**{part: held - freed.get(part, 0) for part, held in self.parts.items()},
                               "task_temporaries": peak.made}

    def profile(self) -> "MemoryProfile":
        """What the run made at its peak, as counted so far."""
        return MemoryProfile(self.peak_total, dict(self.peak_parts), self.activation_peak)


@dataclass(frozen=True)
class MemoryProfile:
    """What a run of the program made at its peak: the bytes (`peak`), by part, and the most
    bytes of activations held at once. Every run of a program makes the same values, so a
    profile two runs in a row measured alike is the program's (`ProgramExecutor.profile`)."""

    peak: int
    parts: dict[str, int]
    activation_peak: int

    def with_held(self, held: dict[str, int]) -> dict[str, int]:
        """The step's peak and its parts, with the parts `held` throughout the step."""
        return {"peak": self.peak + sum(held.values()),
                **{part: made + held.get(part, 0) for part, made in self.parts.items()}}


class Values:
    """The program's values, in slots: each key the program reads, makes or hands back
    has its own (`ProgramExecutor.slot_of`), None while it holds no value. The runtime
    stores and frees values by the list of slots an instruction reads, makes or drops,
    computed once for the program: a step does no key hashing and no per-value method
    call. `sums` holds the slots whose value is a sum `accumulate` made."""

    __slots__ = ("held", "sums")

    def __init__(self, size: int):
        self.held: list = [None] * size
        self.sums: set[int] = set()  # slots whose value is a sum `accumulate` made

    def set(self, slot: int, value) -> None:
        self.held[slot] = value
        if self.sums:
            self.sums.discard(slot)

    def drop(self, slots: Sequence[int]) -> None:
        held = self.held
        for slot in slots:
            held[slot] = None
        if self.sums:
            self.sums.difference_update(slots)

    def store(self, slots: Sequence[tuple[int, bool]], results: Sequence) -> None:
        """Store a task's `results` in `slots`, each (slot, whether it is summed into)."""
        held = self.held
        for (slot, summed), value in zip(slots, results, strict=True):
            if summed:
                self.accumulate(slot, value)
            else:
                held[slot] = value
                if self.sums:
                    self.sums.discard(slot)

    def accumulate(self, slot: int, value: torch.Tensor) -> None:
        """Add `value` to the value held in `slot`, or hold it if there is none: into
        a new tensor the first time (the value held may be read elsewhere, such as a
        received buffer or a task's output), in place into that sum after, until the
        sum is read (a partial sum sent to another rank must stay as it was sent)."""
        held = self.held[slot]
        if held is None:
            self.set(slot, value)
        elif slot in self.sums:
            held.add_(value)
        else:
            self.set(slot, held + value)
            self.sums.add(slot)


class CountedValues(Values):
    """`Values` reporting every value set or dropped to a `HeldBytes`, with the storage each
    is counted on (a value's storage is looked up once, when it is set)."""

    __slots__ = ("tracked", "keys", "counted")

    def __init__(self, size: int, tracked: HeldBytes, keys: Sequence[Key]):
        super().__init__(size)
        self.tracked = tracked
        self.keys = keys  # each slot's key, which decides the memory part of its value
        self.counted: dict[int, int] = {}  # slot -> the storage its value is counted on

    def set(self, slot: int, value) -> None:
        self._uncount(slot)
        super().set(slot, value)
        storage = self.tracked.add(self.keys[slot], value)
        if storage is not None:
            self.counted[slot] = storage

    def drop(self, slots: Sequence[int]) -> None:
        for slot in slots:
            self._uncount(slot)
        super().drop(slots)

    def store(self, slots: Sequence[tuple[int, bool]], results: Sequence) -> None:
        for (slot, summed), value in zip(slots, results, strict=True):
            if summed:
                self.accumulate(slot, value)
            else:
                self.set(slot, value)

    def _uncount(self, slot: int) -> None:
        storage = self.counted.pop(slot, None)
        if storage is not None:
            self.tracked.release_storage(storage)
