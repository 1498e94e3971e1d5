"""`piper_fx.annotate`: tag regions of a model's forward for the strategy passes.

    for block in self.blocks:
        with piper_fx.annotate("PP"):
            x = block(x)

Built on `torch.fx.traceback.annotate`, which puts `{kind: region id}` in the
`custom` metadata of every node traced inside the region (Dynamo graph, and
AOTAutograd's forward and backward). PP regions are grouped in order into the
pipeline's stages. Region ids only need to increase in tracing order: they come
from a counter read through `assume_constant_result`, so Dynamo bakes them into
the graph without guarding on the counter (which would recompile every call).
"""
from __future__ import annotations

import contextlib
import itertools
from typing import Iterator

import torch
import torch.fx.traceback as fx_traceback

KINDS = ("PP", "EP")
_region_ids = itertools.count()


@torch.compiler.assume_constant_result
def _new_region_id() -> int:
    return next(_region_ids)


@contextlib.contextmanager
def annotate(kind: str) -> Iterator[None]:
    """Everything traced inside is one region of `kind` ("PP" or "EP")."""
    if kind not in KINDS:
        raise ValueError(f"piper_fx.annotate({kind!r}): kind must be one of {list(KINDS)}")
    with fx_traceback.annotate({kind: _new_region_id()}):
        yield
