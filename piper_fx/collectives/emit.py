"""Splice plain PyTorch code into an FX graph as ATen ops.

The strategy passes describe what a collective computes in
`collectives.lowering` (plain PyTorch with functional collectives); this
traces such a function on the fake values of its input nodes and inserts the
resulting ops, with their `val` metadata, into the graph being transformed;
`replace_uses` gives a node's readers another node and their values with it.
"""
from __future__ import annotations

import collections
import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..compat import detect_fake_mode, tree_leaves, tree_map_only
from ..ops import CONVERT, LAYER, is_alias
from ..runtime.memory import storage_key

# Metadata copied from the node a splice replaces, so regions and annotations survive (the
# model's `torch.utils.checkpoint` tags, `recompute` and `ac_graph_id`, among them).
INHERITED_META = ("custom", "nn_module_stack", "seq_nr", "partitioner_tag", "stack_trace", "recompute",
                  "ac_graph_id", LAYER)


# The metadata of a traced node that holds values: its own, and its inputs' as make_fx saw them
# (for an op whose inputs' strides Inductor keeps as they were, `constrain_to_fake_tensors`).
_VALUE_META = ("val", "eager_input_vals")


@dataclass(frozen=True)
class _Like:
    """A kept trace's value of a tensor: its layout, to make one like it in another fake mode."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device

    @staticmethod
    def of(t: torch.Tensor) -> "_Like":
        return _Like(tuple(t.shape), t.stride(), t.dtype, t.device)


class KeptTraces:
    """make_fx traces kept for the process, by a key naming what each depends on, the `kept`
    most recently used (all, where None): a model has many parameters of few shapes, each
    lowering or bucket of a layout is the same code, and a later compile of the same shapes (a
    recompile, the next model of a test) traces none of them again. A kept trace holds no
    fake tensor: those of the compile that traced it would keep its fake mode alive; its
    nodes' values are kept as their layouts (`_Like`), and each splice makes values of its own
    graph's. `pinned`, an object the key names by `id`, is kept with the trace, so that no
    other object takes that id while the key stands."""

    def __init__(self, kept: int | None = None):
        self._entries: collections.OrderedDict[tuple, tuple[fx.GraphModule, Any]] = collections.OrderedDict()
        self._kept = kept

    def get(self, key: tuple, trace: Callable[[], fx.GraphModule], pinned: Any = None) -> fx.GraphModule:
        """The trace kept under `key`, else `trace()`'s, kept."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key][0]
        traced = trace()
        for node in traced.graph.nodes:
            for kind in _VALUE_META:
                if kind in node.meta:
                    node.meta[kind] = tree_map_only(torch.Tensor, _Like.of, node.meta[kind])
        self._entries[key] = traced, pinned
        if self._kept is not None and len(self._entries) > self._kept:
            self._entries.popitem(last=False)
        return traced

    def graphs(self) -> list[fx.GraphModule]:
        return [traced for traced, _ in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)


# The lowerings traced in this process (`_trace`).
_TRACED = KeptTraces(kept=512)


def _fake_mode_of(values: list) -> Any:
    """The fake mode of the first of `values` that has one (the graph's own), or None."""
    return next((v.fake_mode for v in values if hasattr(v, "fake_mode")), None)


def _trace(fn: Callable[..., torch.Tensor], fake_inputs: list, decompositions: dict | None) -> fx.GraphModule:
    """`fn` traced on inputs like `fake_inputs`; a `functools.partial` of fake inputs is kept
    for the process (`_TRACED`), by its function, arguments, its inputs' layouts and the
    decomposition table (Inductor's, which depends on its config, or none; kept with it)."""
    # Trace inside the graph's own fake mode, so tensors the function creates
    # (padding) are fake values of the same mode as their neighbours.
    fake_mode = _fake_mode_of(fake_inputs)

    def trace() -> fx.GraphModule:
        with fake_mode if fake_mode is not None else contextlib.nullcontext():
            return make_fx(fn, decomposition_table=decompositions)(*fake_inputs)

    if not isinstance(fn, functools.partial) or fake_mode is None:
        return trace()
    key = (fn.func, tuple(sorted((k, repr(v)) for k, v in fn.keywords.items())), fn.args,
           tuple((tuple(v.shape), v.dtype, tuple(v.stride()), v.device) for v in fake_inputs),
           None if decompositions is None else id(decompositions))
    return _TRACED.get(key, trace, pinned=decompositions)


def _fresh(val: Any, fake_mode: Any = None) -> Any:
    """A new fake tensor like each tensor of `val`, in its fake mode, or like each `_Like`,
    in `fake_mode`."""
    def fresh(t: torch.Tensor | _Like) -> torch.Tensor:
        if isinstance(t, _Like):
            with fake_mode:
                return torch.empty_strided(t.shape, t.stride, dtype=t.dtype, device=t.device)
        if not hasattr(t, "fake_mode"):
            return t
        with t.fake_mode:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device)
    return tree_map_only((torch.Tensor, _Like), fresh, val)


def _value(new: fx.Node, traced: fx.Node, fake_mode) -> Any:
    """The value of `new`, a splice's copy of the trace's node `traced`. Each splice of one
    cached trace has values of its own: passes that trace them again (Inductor's bucketing)
    would see one tensor where there are two. A view's is its op run on its input's value,
    on that storage (what a task holds is counted by storage, `runtime.memory.task_peak`);
    any other op's, a new fake tensor of `fake_mode` like the trace's (running every op on values took
    `lower_redistributions` of a ZeRO-1 GPT of 12 layers from 1.6 to 3.9 s under cProfile)."""
    if is_alias(new):
        try:
            with fake_mode if fake_mode is not None else contextlib.nullcontext():
                return run_on_values(new)
        except Exception:  # noqa: BLE001 - best effort: a new value like the trace's
            pass
    return _fresh(traced.meta.get("val"), fake_mode)


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
    traced = _trace(fn, fake_inputs, decompositions)
    fake_mode = _fake_mode_of(fake_inputs)
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
                new.meta["val"] = _value(new, node, fake_mode)
                if "eager_input_vals" in node.meta:  # this splice's inputs', as make_fx records them
                    new.meta["eager_input_vals"] = fx.map_arg((new.args, new.kwargs), lambda n: n.meta["val"])
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
    fake = _fake_mode_of(vals)
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


def layout(arg: Any) -> Any:
    """What a trace (or a value's metadata) depends on of `arg`: a tensor's shape, strides,
    offset, dtype and device; a list's or tuple's of each item; anything else itself."""
    if isinstance(arg, torch.Tensor):
        return "T", tuple(arg.shape), arg.stride(), arg.storage_offset(), arg.dtype, arg.device
    if isinstance(arg, (list, tuple)):
        return type(arg).__name__, tuple(layout(a) for a in arg)
    return arg


def detached(value: Any) -> Any:
    """`value` as make_fx records values: each tensor detached, so a view's value is no view
    (the plan cache pickles values that are not views by their layout: `compat.pickle_graphs`)
    and still shares its base's storage."""
    return tree_map_only(torch.Tensor, torch.Tensor.detach, value)


def run_on_values(node: fx.Node) -> Any:
    """`node`'s op run on its inputs' values (`meta["val"]`), recorded as make_fx records
    values (`detached`), in whatever fake mode the caller entered."""
    args, kwargs = fx.map_arg((node.args, node.kwargs), lambda n: n.meta["val"])
    return detached(node.target(*args, **kwargs))


def _storages(value: Any) -> list[int]:
    return [storage_key(t) for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


def repair_values(users: list[fx.Node], relaid: set[fx.Node]) -> None:
    """Recompute the values of `users` (of nodes given new values), and in turn of theirs, where
    they change: a new value may have other strides than the one it replaces (`relaid`: those
    nodes; Inductor's `_recompute_changed_user_metadata`, the values detached), and a view's
    value is a view of its input's (its storage), which may be new: what a task holds is
    counted by storage (`runtime.memory.task_peak`), and a view left on the storage of the
    value it read before counted that storage once more. An op that is no view, on inputs laid
    out as before, makes what it made (on a storage of its own): it is not run again. As in
    Inductor's, a node whose op does not run on its inputs' values keeps its value."""
    work, queued = collections.deque(users), set(users)
    while work:
        node = work.popleft()
        queued.discard(node)
        if node.op != "call_function" or "val" not in node.meta \
                or not all("val" in n.meta for n in node.all_input_nodes):
            continue
        alias = is_alias(node)
        if not alias and relaid.isdisjoint(node.all_input_nodes):
            continue
        try:
            with detect_fake_mode([n.meta["val"] for n in node.all_input_nodes]) or contextlib.nullcontext():
                value = run_on_values(node)
        except Exception:  # noqa: BLE001 - best effort, as Inductor's repair
            continue
        if layout(value) != layout(node.meta["val"]):
            relaid.add(node)
        elif not (alias and _storages(value) != _storages(node.meta["val"])):
            continue
        node.meta["val"] = value
        for user in node.users:
            if user not in queued:
                queued.add(user)
                work.append(user)


def replace_uses(old: fx.Node, new: fx.Node) -> None:
    """Make every reader of `old` read `new`, and their values follow (`repair_values`): a
    view of it becomes a view of `new`'s value, on its storage, and an op on it is
    recomputed where `new`'s value is laid out otherwise than `old`'s."""
    users = list(old.users)
    same = "val" in old.meta and "val" in new.meta and layout(old.meta["val"]) == layout(new.meta["val"])
    old.replace_all_uses_with(new)
    repair_values(users, set() if same else {new})
