"""The ATen decompositions every graph gets, captured or spliced in by a pass: one table, so
that what capture traces and what a pass inserts decompose alike."""
from __future__ import annotations

import torch

from .compat import select_decomp_table
from .options import Strategy


def decompositions_for(strategy: Strategy) -> dict | None:
    """The ATen decompositions every graph (captured or spliced in by a pass) gets.

    Inductor expects graphs decomposed with its own table; eager runs ATen as is.
    """
    if strategy.codegen != "inductor":
        return None
    return _inductor_decompositions()


# The last table Inductor selected (it depends on its config) and that table without `exponential`.
_LAST_TABLE: list[tuple[dict, dict]] = []


def _inductor_decompositions() -> dict:
    """Inductor's table, but for `exponential`, which `passes.functionalize_random` draws itself
    (as it draws it under eager codegen): the table's `-log(u)` of a uniform `u` is another
    value than the pass's `-log(1 - u)`, which is finite for every `u` it draws in [0, 1)."""
    table = select_decomp_table()
    if not _LAST_TABLE or _LAST_TABLE[0][0] is not table:
        _LAST_TABLE[:] = [(table, {op: fn for op, fn in table.items() if op is not torch.ops.aten.exponential.default})]
    return _LAST_TABLE[0][1]
