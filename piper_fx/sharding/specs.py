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
   (`_RULES`): attention kernels that compute each batch row from that row
   alone, row statistics (var_mean) and dtype conversions (prims'), which
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
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..errors import PiperError
from ..ops import PLACED, REDUCE_GRAD, UNSHARD, WAIT
from .dtensor_rules import dtensor_answer
from .mesh import process_group_device_type
from .spec_base import SPEC_KEY, NoRule, aten, fill_value, format_spec, is_decided, tensor_inputs, tensors

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


def _alike(val: Any, placement: Placement) -> Any:
    """`placement` for every tensor of `val`, None for what is no tensor."""
    if isinstance(val, torch.Tensor):
        return placement
    if isinstance(val, (tuple, list)):
        return tuple(_alike(v, placement) for v in val)
    return None


# ---- piper_fx's rules for ops DTensor has no rule for, or none that fits. Each gets the
# node and its tensor inputs with their placements, and returns the node's spec and the
# inputs it reads otherwise placed (`READS_KEY`), or raises `NoRule` saying why when the
# placements are not those it holds for.

def _batch_rows(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """For an op that computes row b of each result (dim 0: the batch) from row b of each
    input alone: with every input `Shard(0)` (or `Replicate()` with dim 0 of size 1, which
    every row reads alike, e.g. an attention mask), every result is `Shard(0)`, and the
    rows of the batch are those of the inputs. A `Replicate()` attention mask of the
    batch's rows (built for this rank's rows, as Hugging Face's is where it materializes a
    causal mask for the attention) is read as this rank's rows, as DTensor's rules read
    such a tensor (`READS_KEY`)."""
    sharded = [a for a, s in inputs if s == Shard(0)]
    if not sharded:
        raise NoRule("it computes each batch row from that row alone, but no input is Shard(0)")
    rows = sharded[0].meta["val"].shape[0]
    reads = []
    for a, s in inputs:
        val = a.meta["val"]
        if a is node.kwargs.get("attn_mask") and isinstance(s, Replicate) and val.dim() >= 1 \
                and val.shape[0] == rows != 1:
            reads.append((a, Shard(0)))
        elif not (s == Shard(0) and val.shape[0] == rows
                  or isinstance(s, Replicate) and val.dim() >= 1 and val.shape[0] == 1):
            raise NoRule(f"it computes each batch row from that row alone, so it needs every input Shard(0) "
                          f"with the batch's {rows} rows (or Replicate() with 1 row, or a mask of those "
                          f"rows), not {a.name}: {format_spec(s)} with {tuple(val.shape)}")
    if not all(o.dim() >= 1 and o.shape[0] == rows for o in tensors(node.meta.get("val"))):
        raise NoRule(f"a result of it does not have the batch's {rows} rows")
    return _alike(node.meta.get("val"), Shard(0)), reads


def _scatter_add(destination: fx.Node, keys: list[fx.Node], values: fx.Node) -> Placement:
    """out = destination + the rows of `values` summed into place at the indices (`keys`:
    the index tensors and any mask; a masked-out row adds nothing). The sum over ranks of
    the outputs is the single-device output when the destination counts once in it (zeros,
    or a `Partial(sum)`), and what each rank adds is either its rows of the values (keys and
    values `Shard(0)` along the same rows) or its part of them (keys `Replicate()`, values
    `Partial(sum)`): the output is `Partial(sum)`."""
    spec = lambda n: n.meta.get(SPEC_KEY)  # noqa: E731
    if not (fill_value(destination) == 0 or spec(destination) == Partial("sum")):
        raise NoRule(f"it sums rows into {destination.name}, which is neither zeros nor Partial(sum)")
    own_rows = (all(spec(n) == Shard(0) for n in keys + [values])
                and len({n.meta["val"].shape[0] for n in keys + [values]}) == 1)
    own_part = all(isinstance(spec(n), Replicate) for n in keys) and spec(values) == Partial("sum")
    if not (own_rows or own_part):
        raise NoRule("it sums rows into place, so it needs the indices (and mask) and values all Shard(0), "
                      "or the indices Replicate() and the values Partial(sum)")
    return Partial("sum")


def _row_statistics(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """var_mean over dimensions other than dim 0 (a layer norm's statistics, as Inductor
    decomposes it): each row's statistics read that row alone, so with the input
    `Shard(0)` both results are `Shard(0)` (dim 0 is kept, keepdim or not). DTensor has a
    rule for it from torch 2.13; this one serves earlier versions too."""
    (source, placement), = inputs
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else dims
    ndim = source.meta["val"].dim()
    if placement != Shard(0) or dims is None or 0 in [d % ndim for d in dims]:
        raise NoRule("it reads each row alone only over dimensions other than dim 0 of a Shard(0) input")
    return _alike(node.meta.get("val"), Shard(0)), []


def _convert_element_type(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """A dtype conversion (as Inductor's decompositions write `.to(dtype)`): element by
    element, so a `Shard` stays; a partial value is read whole (`Replicate()`), since
    converting the parts need not sum to converting the total (to an integer, say). This
    is DTensor's rule for it from torch 2.13; earlier versions have none."""
    (source, placement), = inputs
    if isinstance(placement, Partial):
        return Replicate(), [(source, Replicate())]
    return placement, []


def _masked_index_put_accumulate(node: fx.Node, inputs) -> Any:
    destination, mask, indices, values = node.args[:4]
    return _scatter_add(destination, [mask] + [i for i in indices if isinstance(i, fx.Node)], values), []


def _index_put(node: fx.Node, inputs) -> Any:
    destination, indices, values = node.args[:3]
    if not (node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)):
        raise NoRule("it writes rows in place without summing them")
    return _scatter_add(destination, [i for i in indices if isinstance(i, fx.Node)], values), []


def _copy(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`aten.copy(destination, source)` and `aten.fill(destination, value)`, functionalized
    `destination[...] = source` (as Hugging Face's T5 shifts its labels right and puts its
    start token first): a tensor of the destination's shape holding the source's values,
    broadcast. So it is placed as the source where the source's dim 0 is the result's (a
    `Shard(0)` source: its rows; a partial one: its part, since the copy is linear); a
    `Replicate()` source (a fill's value) fills every row alike, a `Shard(0)` destination's
    rows (`Shard(0)`) as well as a replicated one's. DTensor's rules are the in-place ops'."""
    destination, source = node.args[:2]
    placed = dict(inputs)
    if isinstance(placed[source], Replicate):
        return (Shard(0) if placed[destination] == Shard(0) else Replicate()), []
    dst, src = destination.meta["val"], source.meta["val"]
    if src.dim() != dst.dim() or src.shape[0] != dst.shape[0]:
        raise NoRule(f"it broadcasts its source {source.name} ({format_spec(placed[source])}) along dim 0")
    return placed[source], []


# Ops that keep every value of their first argument where it is, only reshaping: what the row
# numbers `torch.arange(rows)` pass through on their way to an index (`_row_numbers`).
_SAME_VALUES = {aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
                aten.expand.default, aten.clone.default, aten.alias.default, aten._to_copy.default,
                torch.ops.prims.convert_element_type.default}


def _row_numbers(node: fx.Node, rows: int) -> bool:
    """Whether `node` holds 0, 1, ..., rows - 1 along its dim 0 and nothing else (every other
    dimension of size 1): `torch.arange(rows)` (`prims.iota` as Inductor decomposes it)
    reshaped, or offset by 0, as Hugging Face's masks number the batch's rows to index the
    attention mask with."""
    val = node.meta.get("val")
    if not (isinstance(val, torch.Tensor) and val.dim() >= 1 and val.shape[0] == rows and val.numel() == rows):
        return False
    while node.target in _SAME_VALUES or node.target is aten.add.Tensor and node.args[1] == 0:
        node = node.args[0]
        if not isinstance(node, fx.Node):
            return False
    if node.target is aten.arange.default:
        return node.args[0] == rows
    if node.target is torch.ops.prims.iota.default:
        return node.args[0] == rows and node.kwargs.get("start") == 0 and node.kwargs.get("step") == 1
    if node.target in (aten.arange.start, aten.arange.start_step):
        return node.args[0] == 0 and node.args[1] == rows and (node.args[2:] or (1,))[0] == 1
    return False


def _index_rows(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`aten.index(x, [rows, ...])` of a `Shard(0)` `x` whose dim-0 index is its row numbers
    (`_row_numbers`: this rank's rows in order, each the same on every rank) and whose other
    indices are replicated and do not vary along the rows: each row of the result is that
    row of `x`, indexed on the other dimensions alike, so the result is `Shard(0)` (as
    Hugging Face's masks read each row's attention mask, `mask[batch_rows, kv_positions]`).
    DTensor's rule reads a sharded indexed dimension as replicated."""
    source, indices = node.args[:2]
    rows = source.meta["val"].shape[0]
    if not (source.meta.get(SPEC_KEY) == Shard(0) and indices and isinstance(indices[0], fx.Node)
            and _row_numbers(indices[0], rows)):
        raise NoRule("it indexes dim 0 of a Shard(0) tensor by its row numbers only")
    for index in indices[1:]:
        if index is None:
            continue
        val = index.meta["val"]
        if not (isinstance(index.meta.get(SPEC_KEY), Replicate) and val.dim() >= indices[0].meta["val"].dim()
                and val.shape[val.dim() - indices[0].meta["val"].dim()] == 1):
            raise NoRule(f"its index {index.name} is not replicated alike for every row")
    return Shard(0), []


def _squeeze_one_row(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`aten.squeeze` of dim 0 of a `Shard(0)` gradient of one row on this rank: the gradient
    of a value of one row broadcast along the batch (a position bias added to every row's
    attention scores), whose sum over the batch's rows autograd did not write, since at one
    row a rank's gradient already has the value's shape. The rows' sum is the gradient:
    each rank holds its row's part, `Partial(sum)`, of the squeezed value, and the rest of
    the backward is linear in it. A forward value stays unplaced: squeezing the batch away
    there means a model written for one row."""
    (source, placement), = inputs
    ndim = source.meta["val"].dim()
    dims = node.args[1] if len(node.args) > 1 else range(ndim)
    dims = [dims] if isinstance(dims, int) else dims
    if not (placement == Shard(0) and source.meta["val"].shape[0] == 1 and 0 in [d % ndim for d in dims]
            and node.meta.get("autograd_backward")):
        raise NoRule("it squeezes dim 0 away only of a gradient of one row Shard(0)")
    return Partial("sum"), []


_RULES: dict[Any, Callable[[fx.Node, list[tuple[fx.Node, Placement]]], tuple[Any, list]]] = {
    # CPU flash attention (DTensor has rules for the CUDA kernels, not these): batch row b
    # of the output (and log-sum-exp), and of the gradients, reads row b of q, k, v alone.
    aten._scaled_dot_product_flash_attention_for_cpu.default: _batch_rows,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _batch_rows,
    aten.var_mean.correction: _row_statistics,
    torch.ops.prims.convert_element_type.default: _convert_element_type,
    # The embedding backward as Inductor decomposes it: a scatter-add into zeros.
    aten._unsafe_masked_index_put_accumulate.default: _masked_index_put_accumulate,
    # DTensor's index_put rule needs the indices replicated; a scatter-add of each rank's
    # rows (e.g. the backward of indexing the batch's rows) is a partial sum.
    aten.index_put.default: _index_put,
    aten.copy.default: _copy,
    aten.fill.Tensor: _copy,
    aten.index.Tensor: _index_rows,
    aten.squeeze.dim: _squeeze_one_row,
    aten.squeeze.dims: _squeeze_one_row,
    aten.squeeze.default: _squeeze_one_row,
}


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


def _undecided(node: fx.Node, why: str) -> PiperError:
    inputs = ", ".join(f"{a.name}: {format_spec(a.meta.get(SPEC_KEY))}" for a in node.all_input_nodes)
    rules = ", ".join(sorted(str(op) for op in _RULES))
    return PiperError(
        f"piper_fx cannot place node {node.name} = {node.target}({inputs}): {why}. Placements come only from "
        f"DTensor's sharding propagator and from piper_fx's own rules (piper_fx/sharding/specs.py: its "
        f"collectives and markers, replicated inputs, random values, and {rules}). Please report this op "
        f"with your model to piper_fx, or add a rule for it there")


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
        return _alike(val, Replicate()), []  # None for an op with no tensor result (e.g. an assertion)
    inputs = [(a, a.meta.get(SPEC_KEY)) for a in tensor_inputs(node)]
    for a, s in inputs:
        if not is_decided(s, a.meta.get("val")):
            raise _undecided(node, f"its input {a.name} has no placement")
    if random_values is not None and (drawn := random_values(node)) is not None:
        return drawn, []
    if all(isinstance(s, Replicate) for _, s in inputs):
        return _alike(val, Replicate()), []
    why = []
    if node.target in _RULES:
        try:
            return _RULES[node.target](node, inputs)
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
              random_values: Callable[[fx.Node], Any] | None = None) -> None:
    """Set `meta["piper_spec"]` on every placeholder (from `seeds`), constant and call
    (module docstring), and `meta["piper_spec_reads"]` where DTensor's rule read an input
    otherwise placed. Raises `PiperError` for a node whose placement cannot be decided."""
    for node in graph.nodes:
        node.meta.pop(READS_KEY, None)
        if node.op == "placeholder":
            node.meta[SPEC_KEY] = seeds[node.name]
        elif node.op == "get_attr":  # a constant of the graph: the same on every rank
            node.meta[SPEC_KEY] = _alike(node.meta.get("val"), Replicate())
        elif node.op == "call_function":
            node.meta[SPEC_KEY], reads = infer_spec(mesh, node, random_values)
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
