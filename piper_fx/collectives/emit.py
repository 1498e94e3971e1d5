"""Splice plain PyTorch code into an FX graph as ATen ops.

The strategy passes describe what a collective computes in
`collectives.lowering` (plain PyTorch with functional collectives); this
traces such a function on the fake values of its input nodes and inserts the
resulting ops, with their `val` metadata, into the graph being transformed.
"""
from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..ops import CONVERT, LAYER

# Metadata copied from the node a splice replaces, so regions and annotations survive (the
# model's `torch.utils.checkpoint` tags, `recompute` and `ac_graph_id`, among them).
INHERITED_META = ("custom", "nn_module_stack", "seq_nr", "partitioner_tag", "stack_trace", "recompute",
                  "ac_graph_id", LAYER)


# Lowerings traced for each graph they are spliced into, kept as long as that
# graph: each compilation's own (its values are of its fake mode, on its
# device), never another's. A cached trace holds no reference to the graph.
_TRACED: weakref.WeakKeyDictionary[fx.Graph, dict[tuple, fx.GraphModule]] = weakref.WeakKeyDictionary()


def _trace(graph: fx.Graph, fn: Callable[..., torch.Tensor], fake_inputs: list,
           decompositions: dict | None) -> fx.GraphModule:
    """`fn` traced on inputs like `fake_inputs`; cached per graph, since a model
    has many parameters of few shapes and each collective lowering is the same code."""
    # Trace inside the graph's own fake mode, so tensors the function creates
    # (padding) are fake values of the same mode as their neighbours.
    fake_mode = next((v.fake_mode for v in fake_inputs if hasattr(v, "fake_mode")), None)
    traced_for_graph = _TRACED.setdefault(graph, {})
    key = None
    if isinstance(fn, functools.partial):
        key = (fn.func, tuple(sorted((k, repr(v)) for k, v in fn.keywords.items())), fn.args,
               tuple((tuple(v.shape), v.dtype, tuple(v.stride()), v.device) for v in fake_inputs),
               id(fake_mode), decompositions is not None)  # a graph is captured with one table (Inductor's) or none
        if key in traced_for_graph:
            return traced_for_graph[key]
    with fake_mode if fake_mode is not None else contextlib.nullcontext():
        traced = make_fx(fn, decomposition_table=decompositions)(*fake_inputs)
    if key is not None:
        traced_for_graph[key] = traced
    return traced


def _fresh(val):
    """A new fake tensor like `val`: splices of one cached trace must not share
    values, or passes that trace them again (Inductor's bucketing) would see
    one tensor where there are two."""
    if not hasattr(val, "fake_mode"):
        return val
    with val.fake_mode:
        return torch.empty_strided(val.shape, val.stride(), dtype=val.dtype, device=val.device)


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
    traced = _trace(graph, fn, fake_inputs, decompositions)
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
                new.meta["val"] = _fresh(node.meta.get("val"))
                if like is not None:
                    for key in INHERITED_META:
                        if key in like.meta:
                            new.meta[key] = like.meta[key]
                new.meta.update(meta or {})
                env[node] = new
    assert result is not None
    return result


def insert_call(graph: fx.Graph, target: Callable, args: tuple, *, before: fx.Node,
                like: fx.Node | None = None, meta: dict[str, Any] | None = None) -> fx.Node:
    """Insert, before `before`, the call `target(*args)`; return it. Its value (`meta["val"]`)
    is the call's on its arguments' values, in their fake mode; it inherits `like`'s
    annotations (`INHERITED_META`) and takes `meta`."""
    with graph.inserting_before(before):
        node = graph.call_function(target, args)
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    fake = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    with fake if fake is not None else contextlib.nullcontext():
        node.meta["val"] = target(*vals)
    for key in INHERITED_META:
        if like is not None and key in like.meta:
            node.meta[key] = like.meta[key]
    node.meta.update(meta or {})
    return node


def cast(graph: fx.Graph, value: fx.Node, dtype: torch.dtype, *, before: fx.Node,
         like: fx.Node | None = None, meta: dict[str, Any] | None = None) -> fx.Node:
    """Insert, before `before`, `value` converted to `dtype` (`prims.convert_element_type`, which
    every codegen runs); return it. It inherits `like`'s annotations and takes `meta`."""
    return insert_call(graph, CONVERT, (value, dtype), before=before, like=like, meta=meta)
