"""Splice plain PyTorch code into an FX graph as ATen ops.

The strategy passes describe what a collective computes in
`collectives.lowering` (plain PyTorch with functional collectives); this
traces such a function on the fake values of its input nodes and inserts the
resulting ops, with their `val` metadata, into the graph being transformed.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

# Metadata copied from the node a splice replaces, so regions and annotations survive.
INHERITED_META = ("custom", "nn_module_stack", "seq_nr", "partitioner_tag", "stack_trace")


def insert_traced(
    graph: fx.Graph,
    fn: Callable[..., torch.Tensor],
    inputs: list[fx.Node],
    *,
    before: fx.Node,
    like: fx.Node | None = None,
    meta: dict[str, Any] | None = None,
    decompositions: dict | None = None,
) -> fx.Node:
    """Insert the ops of `fn(*inputs)` before `before`; return the node of its result.

    `decompositions` must be those the graph was captured with, so spliced ops
    are as lowered as their neighbours.
    """
    fake_inputs = [n.meta["val"] for n in inputs]
    # Trace inside the graph's own fake mode, so tensors the function creates
    # (padding) are fake values of the same mode as their neighbours.
    fake_mode = next((v.fake_mode for v in fake_inputs if hasattr(v, "fake_mode")), None)
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        traced = make_fx(fn, decomposition_table=decompositions)(*fake_inputs)
    env: dict[fx.Node, fx.Node] = {}
    remaining = iter(inputs)
    result = None
    with graph.inserting_before(before):
        for node in traced.graph.nodes:
            if node.op == "placeholder":
                env[node] = next(remaining)
            elif node.op == "output":
                result = env[node.args[0]]
            else:
                new = graph.node_copy(node, lambda n: env[n])
                if like is not None:
                    for key in INHERITED_META:
                        if key in like.meta:
                            new.meta[key] = like.meta[key]
                new.meta.update(meta or {})
                env[node] = new
    assert result is not None
    return result
