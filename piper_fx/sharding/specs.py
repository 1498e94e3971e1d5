"""DTensor-style placement specs on every FX node (`node.meta["piper_spec"]`).

A placement says, as DTensor's do, how the value each rank computes relates to
one value over the data-parallel ("dp") mesh dimension: `Shard(0)` (this
rank's rows of it), `Replicate()` (all of it, on every rank), `Partial(op)`
(a part that the ranks' parts reduce to it). Seeds: a replica's batch is
`Shard(0)`, parameters are `Replicate()` (or `Shard(0)` when stored as row
shards), the loss seed gradient and any other input `Replicate()`.

The guarantee: `propagate` gives every placeholder, constant and call a
decided placement (`is_decided`: a `Placement` for a tensor, a tuple for an
op with several results, None for what is no tensor), or raises a
`PiperError` naming the node, its op and its inputs' placements. Nothing is
guessed. A call's placement comes from the first of these that applies:

1. Our own ops, whose placement change *is* their meaning (`_own_op_spec`):
   the ZeRO markers, the functional collectives and their waits (the expert
   all-to-all keeps its input's placement: `_EXCHANGE`), `getitem` of a
   multi-result op, and the result of a placement change over dp that
   `passes.lower_redistributions` lowered (`ops.PLACED`: the change's target,
   e.g. ZeRO-1's rows of the all-reduced gradient, `Shard(0)`).
2. An op with no tensor result: None.
3. Values drawn from the RNG input (`random_values_rule`): `Shard(0)` when
   batch-major, else `Replicate()`.
4. An op whose tensor inputs are all `Replicate()`: `Replicate()` (every rank
   computes the same function of the same values; random ops are no longer in
   the graph, `passes.functionalize_random` made them functions of the RNG
   input, which 3 covers). Graph constants (`get_attr`) are `Replicate()`.
5. piper_fx's rules for ops DTensor has no rule for, or none that fits
   (`op_rules.RULES`): attention kernels and max pooling (Inductor's prims) that
   compute each batch row from that row alone, an `as_strided` that reshapes rows (a
   group norm's, as Inductor decomposes it), row statistics (var_mean) and dtype
   conversions (prims'), which
   DTensor has rules for from torch 2.13 only, scatter-adds whose every rank
   adds its own rows (the embedding backward as Inductor decomposes it),
   the functional copy and fill of a slice assignment (DTensor's rules are the
   in-place ops'), the indexing of a batch by its row numbers (Hugging Face's
   attention masks), and the squeeze of a one-row gradient whose sum over the
   batch autograd did not write (a value broadcast along the batch, at one row
   a rank).
   Each rule holds only for the input placements it names; for others the op
   goes on to 6.
6. DTensor's own sharding propagator (`dtensor_rules`; the rules DTensor's dispatch uses),
   given the op's registered schema info as DTensor's dispatch gives it, and
   the global shapes (a sharded dimension this rank's times the ranks; a
   shape argument, e.g. a view's, each global shape of the result in turn):
   its answer must fit this rank's shapes. A result of at most one element it
   leaves unplaced (a GPU attention kernel's RNG seed and offset, empty
   offsets) is `Replicate()`, as DTensor's backward rules read it. Where no
   global shape fits (a replicated tensor of this rank's batch size, such as
   its row numbers, meeting a sharded one), it is given this rank's shapes as
   the global ones.
   Where the rule it picks reads an input otherwise placed than it is (e.g. a
   replicated tensor as this rank's rows, or a partial sum, such as the
   loss's normaliser, as its total), the graph computes with the input as it
   is: the placement holds as far as that reading does. Such readings are
   kept in `meta["piper_spec_reads"]` and shown in the placement table,
   except where they change nothing (`dtensor_rules._holds_as`: an empty tensor, or a
   factory's tensor of one repeated value, which is its own row shard and
   its own average).
An op none of these decides (DTensor has no rule, or fails on it) is an error.

The propagator runs on a planning mesh that needs no process group
(`planning_mesh`), of the device type of the graph's values.
"""
from __future__ import annotations

import operator
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..errors import PiperError
from ..ops import PLACED, REDUCE_GRAD, UNSHARD, WAIT
from .dtensor_rules import dtensor_answer
from .mesh import process_group_device_type
from .op_rules import RULES
from .spec_base import SPEC_KEY, NoRule, alike, format_spec, is_decided, tensor_inputs, tensors

# Where DTensor's rule for an op reads an input otherwise placed than it is:
# ((input name, the placement the rule reads it as), ...).
READS_KEY = "piper_spec_reads"

_c10d = torch.ops._c10d_functional
_FIXED: dict[Any, Placement] = {
    _c10d.all_gather_into_tensor.default: Replicate(),
    _c10d.reduce_scatter_tensor.default: Shard(0),
    _c10d.all_reduce.default: Replicate(),
    UNSHARD: Replicate(),
    REDUCE_GRAD: Shard(0),
}
# The all-to-all of expert parallelism (`passes.shard_experts`), over the ep group, moves
# rows between the layouts outside and inside an EP region, and the pass keeps the region,
# exchanges included, equal to the replica's own computation of it. Its result keeps its
# input's placement over dp, so the region is placed as in the replica's own program (the
# exchanged layout, a permutation of rows among the ep ranks, has no placement over dp).
_EXCHANGE = _c10d.all_to_all_single.default


def planning_mesh(dp: int, device_type: str | None = None) -> DeviceMesh:
    """A ("dp",) mesh for propagation only: no process group is touched. Its device type
    is the one DTensor's propagator makes its fake tensors on, so a device's own kernels
    meet their device: by default the one the process group communicates on, as the real
    mesh's (`mesh.process_group_device_type`); `passes.propagate_placements` gives the
    device type of the graph's values."""
    return DeviceMesh(device_type or process_group_device_type(), list(range(dp)), mesh_dim_names=("dp",),
                      _init_backend=False, _rank=0)


# ---- Values drawn from the RNG input.

def random_values_rule(rng_inputs: set[fx.Node], samples: int) -> Callable[[fx.Node], Any]:
    """The placement of the values drawn from `rng_inputs` (`InputRole.RNG`, made by
    `passes.functionalize_random`): a node computed from them, or from such nodes, and
    from nothing else but replicated values; None for any other node. Element i of
    sample s of a random tensor is Philox-4x32 of (global element index, op, step), the
    key the same on every rank: batch-major values (dim 0 a multiple of the microbatch's
    `samples`, as the pass decides) are this rank's rows of the single-device ones,
    `Shard(0)`, and others are drawn alike on every rank, `Replicate()`. (The RNG input is
    `Replicate()`, though one of its words is this rank's first sample: that word is what
    makes its draws this rank's rows. The 0-d words read from it are shown `Replicate()`.)"""
    drawn: set[fx.Node] = set(rng_inputs)

    def placement(val: torch.Tensor) -> Placement:
        return Shard(0) if val.dim() >= 1 and val.shape[0] % samples == 0 else Replicate()

    def rule(node: fx.Node) -> Any:
        inputs = tensor_inputs(node)
        if not any(a in drawn for a in inputs):
            return None
        if not all(a in drawn or isinstance(a.meta.get(SPEC_KEY), Replicate) for a in inputs):
            return None
        drawn.add(node)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return placement(val)
        return tuple(placement(v) if isinstance(v, torch.Tensor) else None for v in val)
    return rule


# ---- Propagation.

def _bookkeeping_replicated(spec: Any, val: Any) -> Any:
    """DTensor's answer with `Replicate()` for each result it leaves unplaced that is a
    tensor of at most one element. DTensor's rules leave the bookkeeping results of the
    device's attention kernels unplaced (returned as plain tensors: the RNG seed and
    offset of the CUDA flash and memory-efficient kernels, empty sequence offsets and
    debug masks) and read them back in the backward as `Replicate()`. They hold no
    random draws here: `passes.functionalize_random` refuses attention with dropout."""
    if not isinstance(spec, tuple) or not isinstance(val, (tuple, list)) or len(spec) != len(val):
        return spec
    return tuple(Replicate() if s is None and isinstance(v, torch.Tensor) and v.numel() <= 1 else s
                 for s, v in zip(spec, val))


def _own_op_spec(node: fx.Node) -> tuple[bool, Any]:
    """(True, spec) for the ops whose placement is fixed by what they are, else (False, None)."""
    if PLACED in node.meta:
        return True, node.meta[PLACED]
    if node.target in _FIXED:
        return True, _FIXED[node.target]
    if node.target is WAIT or node.target is _EXCHANGE:
        return True, node.args[0].meta.get(SPEC_KEY)
    if node.target is operator.getitem:
        parent = node.args[0].meta.get(SPEC_KEY)
        return True, parent[node.args[1]] if isinstance(parent, tuple) else parent
    return False, None


def _one_row(node: fx.Node) -> str:
    """Where an input of `node` is sharded along a dimension of size 1 on this rank (one row a
    rank or a microbatch), what that can mean; else nothing."""
    for a in node.all_input_nodes:
        spec, val = a.meta.get(SPEC_KEY), a.meta.get("val")
        if isinstance(spec, Shard) and isinstance(val, torch.Tensor) and val.dim() > spec.dim \
                and val.shape[spec.dim] == 1:
            return (f" Its input {a.name} has one row on this rank (dimension {spec.dim}): ops that treat every "
                    f"dimension of size 1 alike (squeeze(), einsum, views) can drop or move the batch's rows "
                    f"there, where a batch of more rows keeps them; with 2 rows or more a rank, and a "
                    f"microbatch, the model may plan.")
    return ""


def _undecided(node: fx.Node, why: str) -> PiperError:
    inputs = ", ".join(f"{a.name}: {format_spec(a.meta.get(SPEC_KEY))}" for a in node.all_input_nodes)
    rules = ", ".join(sorted(str(op) for op in RULES))
    return PiperError(
        f"piper_fx cannot place node {node.name} = {node.target}({inputs}): {why}.{_one_row(node)} Placements "
        f"come only from DTensor's sharding propagator and from piper_fx's own rules (piper_fx/sharding/specs.py "
        f"and op_rules.py: its collectives and markers, replicated inputs, random values, and {rules}). Register "
        f"a rule for it with DTensor (torch.distributed.tensor.experimental.register_sharding), which planning "
        f"asks too, or report this op with your model to piper_fx")


def infer_spec(mesh: DeviceMesh, node: fx.Node, random_values: Callable[[fx.Node], Any] | None = None
               ) -> tuple[Any, list[tuple[fx.Node, Placement]]]:
    """The placement of the call `node`'s value from its inputs' placements (module
    docstring), and the inputs DTensor's rule for it reads otherwise placed (`READS_KEY`).
    A `PiperError` if none can be decided. `random_values` is a `random_values_rule`."""
    own, spec = _own_op_spec(node)
    if own:
        return spec, []
    val = node.meta.get("val")
    if not tensors(val):
        return alike(val, Replicate()), []  # None for an op with no tensor result (e.g. an assertion)
    inputs = [(a, a.meta.get(SPEC_KEY)) for a in tensor_inputs(node)]
    for a, s in inputs:
        if not is_decided(s, a.meta.get("val")):
            raise _undecided(node, f"its input {a.name} has no placement")
    if random_values is not None and (drawn := random_values(node)) is not None:
        return drawn, []
    if all(isinstance(s, Replicate) for _, s in inputs):
        return alike(val, Replicate()), []
    why = []
    if node.target in RULES:
        try:
            return RULES[node.target](node, inputs)
        except NoRule as e:
            why.append(f"piper_fx's rule does not hold: {e}")
    try:
        spec, reads = dtensor_answer(mesh, node)
    except NoRule as e:
        why.append(str(e))
    else:
        spec = _bookkeeping_replicated(spec, val)
        if is_decided(spec, val):
            return spec, reads
        why.append(f"DTensor's sharding propagator placed it {format_spec(spec)}")
    raise _undecided(node, "; ".join(why))


def propagate(graph: fx.Graph, seeds: dict[str, Placement], mesh: DeviceMesh,
              random_values: Callable[[fx.Node], Any] | None = None, one_replica: bool = False) -> None:
    """Set `meta["piper_spec"]` on every placeholder (from `seeds`), constant and call
    (module docstring), and `meta["piper_spec_reads"]` where DTensor's rule read an input
    otherwise placed. Raises `PiperError` for a node whose placement cannot be decided, but
    with `one_replica` (a pipeline alone): there every placement holds a value whole, on the
    one rank, and a node no rule places is `Replicate()`."""
    for node in graph.nodes:
        node.meta.pop(READS_KEY, None)
        if node.op == "placeholder":
            node.meta[SPEC_KEY] = seeds[node.name]
        elif node.op == "get_attr":  # a constant of the graph: the same on every rank
            node.meta[SPEC_KEY] = alike(node.meta.get("val"), Replicate())
        elif node.op == "call_function":
            try:
                node.meta[SPEC_KEY], reads = infer_spec(mesh, node, random_values)
            except PiperError:
                if not one_replica:
                    raise
                node.meta[SPEC_KEY], reads = alike(node.meta.get("val"), Replicate()), []
            if reads:
                node.meta[READS_KEY] = tuple((a.name, p) for a, p in reads)


def placement_table(graph: fx.Graph) -> str:
    """Every node's placement, with what DTensor's rule read an input as, where it did."""
    rows = [f"{'node':<40} {'op':<44} {'shape':<22} spec"]
    for node in graph.nodes:
        if node.op == "output":
            continue
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else "-"
        op = str(node.target) if node.op == "call_function" else node.op
        reads = "".join(f"  (reads {name} as {format_spec(p)})" for name, p in node.meta.get(READS_KEY, ()))
        rows.append(f"{node.name:<40} {op[:44]:<44} {str(shape):<22} {format_spec(node.meta.get(SPEC_KEY))}{reads}")
    return "\n".join(rows) + "\n"
