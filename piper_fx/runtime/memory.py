"""Measure live tensor bytes of chosen ops while a program runs (CPU included).

`LiveStorageBytes` is a dispatch mode that follows the storages produced by
the ops it is told to watch (e.g. the all-gathers that materialize full
parameters) and every tensor that later aliases them, counting a storage's
bytes from creation until the last tensor on it dies. It measures the program
as it runs, with eager codegen (Inductor's compiled kernels bypass dispatch).
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from ..compat import TorchDispatchMode, tree_leaves


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage, shared by its views. Not the storage's
    address: on a device without memory (`meta`) every storage has address 0."""
    return tensor.untyped_storage()._cdata


class LiveStorageBytes(TorchDispatchMode):
    def __init__(self, watch: Callable[[object], bool]):
        super().__init__()
        self.watch = watch
        self._live: dict[int, list[int]] = {}  # storage (`storage_key`) -> [bytes, live tensors]
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._observe(func, value)
        return out

    def _observe(self, func, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage_key(tensor)
        if key not in self._live:
            if not self.watch(func) or storage.nbytes() == 0:
                return
            self._live[key] = [storage.nbytes(), 0]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._live[key][1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]
