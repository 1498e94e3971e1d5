"""piper_fx's placement rules for ops DTensor has no rule for, or none that fits
(`specs.infer_spec`, its step 5): each takes the node and its tensor inputs with their
placements, and returns the node's spec and the inputs it reads otherwise placed
(`specs.READS_KEY`), or raises `NoRule` saying why when the placements are not those it
holds for (the op then goes on to DTensor's propagator).
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..compat import inductor_prims  # noqa: F401  (the prims of Inductor's decompositions, ruled below)
from ..ir import is_row_major
from .spec_base import SPEC_KEY, NoRule, alike, aten, fill_value, format_spec

# ---- piper_fx's rules for ops DTensor has no rule for, or none that fits. Each gets the
# node and its tensor inputs with their placements, and returns the node's spec and the
# inputs it reads otherwise placed (`READS_KEY`), or raises `NoRule` saying why when the
# placements are not those it holds for.

def _mask(node: fx.Node) -> fx.Node | None:
    """An attention op's mask: its `attn_mask` (CPU flash) or `attn_bias` (the CUDA kernels), if given."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name in ("attn_mask", "attn_bias"):
            value = node.kwargs.get(argument.name, node.args[index] if index < len(node.args) else None)
            return value if isinstance(value, fx.Node) else None
    return None


def _rows_made_alike(node: fx.Node, placement: Placement, rows: int) -> bool:
    """A `Replicate()` tensor of the batch's `rows` rows: made alike on every rank for its own
    rows (a mask or ids built from the rows' count), so it is read as this rank's rows of it,
    as DTensor's rules read such a tensor (`READS_KEY`)."""
    val = node.meta["val"]
    return isinstance(placement, Replicate) and val.dim() >= 1 and val.shape[0] == rows


def _read_alike_by_every_row(val: torch.Tensor) -> bool:
    """A replicated tensor every batch row reads the same of: one row broadcast over the batch,
    a 0-d one (a CUDA attention kernel's RNG seed and offset) or an empty one."""
    return val.dim() == 0 or val.numel() == 0 or val.shape[0] == 1


def _batch_rows(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """For an op that computes row b of each result (dim 0: the batch) from row b of each
    input alone (attention, forward and backward): with every input `Shard(0)` (or
    `Replicate()` and read alike by every row, `_read_alike_by_every_row`), every result of
    the batch's rows is `Shard(0)`, and one read alike by every row (an RNG seed, an empty
    one) `Replicate()`. A `Replicate()` attention mask of the batch's rows (built for this
    rank's rows, as Hugging Face's is where it materializes a causal mask for the attention)
    is read as this rank's rows, as DTensor's rules read such a tensor (`READS_KEY`)."""
    sharded = [a for a, s in inputs if s == Shard(0)]
    if not sharded:
        raise NoRule("it computes each batch row from that row alone, but no input is Shard(0)")
    rows = sharded[0].meta["val"].shape[0]
    mask = _mask(node)
    reads = []
    for a, s in inputs:
        val = a.meta["val"]
        if a is mask and rows != 1 and _rows_made_alike(a, s, rows):
            reads.append((a, Shard(0)))
        elif not (s == Shard(0) and val.shape[0] == rows or isinstance(s, Replicate) and _read_alike_by_every_row(val)):
            raise NoRule(f"it computes each batch row from that row alone, so it needs every input Shard(0) "
                         f"with the batch's {rows} rows (or Replicate() read alike by every row, or a mask of "
                         f"those rows), not {a.name}: {format_spec(s)} with {tuple(val.shape)}")

    def placed(val: Any) -> Any:
        if isinstance(val, (tuple, list)):
            return tuple(placed(v) for v in val)
        if not isinstance(val, torch.Tensor):
            return None
        if val.dim() >= 1 and val.shape[0] == rows:
            return Shard(0)
        if val.dim() == 0 or val.numel() == 0:
            return Replicate()
        raise NoRule(f"a result of it of shape {tuple(val.shape)} does not have the batch's {rows} rows")

    return placed(node.meta.get("val")), reads


def _efficient_attention_backward(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`_batch_rows`, but the mask's gradient (result 3, where the mask requires one: a learned
    bias) sums every row's part: this rank's rows of it where the mask is this rank's rows;
    where every row reads the mask alike, a sum over the ranks of what each computes, which
    this rule does not place (DTensor's computes it on the batch's rows gathered)."""
    spec, reads = _batch_rows(node, inputs)
    mask = _mask(node)
    if node.meta["val"][3] is not None and mask is not None and dict(inputs)[mask] != Shard(0) \
            and mask not in dict(reads):
        raise NoRule(f"the gradient of its mask {mask.name}, which every batch row reads alike, sums the rows'")
    return spec, reads


def _scatter_add(destination: fx.Node, keys: list[fx.Node], values: fx.Node) -> Any:
    """out = destination + the rows of `values` summed into place at the indices (`keys`:
    the index tensors and any mask; a masked-out row adds nothing). The sum over ranks of
    the outputs is the single-device output when the destination counts once in it (zeros,
    or a `Partial(sum)`), and what each rank adds is either its rows of the values (keys and
    values `Shard(0)` along the same rows) or its part of them (keys `Replicate()`, values
    `Partial(sum)`): the output is `Partial(sum)`. With the values `Shard(0)`, a
    `Replicate()` key of their rows (made alike on every rank for its rows, as a model's
    position or token-type ids expanded over the batch) is read as this rank's rows, as
    DTensor's rule for the embedding's backward reads it (`READS_KEY`)."""
    spec = lambda n: n.meta.get(SPEC_KEY)  # noqa: E731
    if not (fill_value(destination) == 0 or spec(destination) == Partial("sum")):
        raise NoRule(f"it sums rows into {destination.name}, which is neither zeros nor Partial(sum)")
    rows = values.meta["val"].shape[0] if values.meta["val"].dim() else None
    made_alike = [n for n in keys if _rows_made_alike(n, spec(n), rows)]
    own_rows = (spec(values) == Shard(0)
                and all(spec(n) == Shard(0) and n.meta["val"].shape[0] == rows or n in made_alike for n in keys))
    own_part = all(isinstance(spec(n), Replicate) for n in keys) and spec(values) == Partial("sum")
    if not (own_rows or own_part):
        raise NoRule("it sums rows into place, so it needs the indices (and mask) and values all Shard(0) (or "
                     "the indices Replicate() with the values' rows), or the indices Replicate() and the values "
                     "Partial(sum)")
    return Partial("sum"), [(n, Shard(0)) for n in made_alike] if own_rows else []


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
    return alike(node.meta.get("val"), Shard(0)), []


def _weight_norm_backward(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """The gradients of weight norm's direction and magnitude (`torch.nn.utils.parametrizations.
    weight_norm`: w = g * v / ||v||) from the weight's: linear in it, the parameters and norms
    fixed. So a weight gradient that sums the ranks' parts (`Partial`, the batch's rows
    spread over them) gives both gradients as such parts, the rest `Replicate()` (whole, as
    ZeRO gathers a parameter before its use)."""
    (grad, placement), *rest = inputs
    if not isinstance(placement, Partial) or grad is not node.args[0] or \
            not all(isinstance(s, Replicate) for _, s in rest):
        raise NoRule("it is linear in the weight's gradient alone: a Partial weight gradient, the rest Replicate()")
    return alike(node.meta.get("val"), placement), []


def _bags_of_this_ranks_rows(node: fx.Node, inputs: list[tuple[fx.Node, Placement]], bags: int,
                              whole: fx.Node) -> list[tuple[fx.Node, Placement]]:
    """Check an embedding bag's inputs hold this rank's rows, `bags` of them: the table `whole`
    `Replicate()` (ZeRO gathers it before its use), the indices and every per-index or per-bag
    value `Shard(0)`; the offsets (the bags' starts, which `F.embedding_bag` of a 2-d batch
    makes with `arange` for this rank's rows) `Shard(0)` or made alike for them, and read as
    this rank's rows. The inputs read otherwise placed (`READS_KEY`)."""
    reads = []
    for a, s in inputs:
        if a is whole:
            if not isinstance(s, Replicate):
                raise NoRule(f"it reads its table {a.name} whole, not {format_spec(s)}")
        elif isinstance(s, Replicate) and _rows_made_alike(a, s, bags):
            reads.append((a, Shard(0)))
        elif s != Shard(0):
            raise NoRule(f"each bag is one of the batch's rows, so it needs {a.name} Shard(0), not {format_spec(s)}")
    return reads


def _embedding_bag(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`nn.EmbeddingBag`: each bag (a row of the batch) reduces the table's rows its indices
    name; with the indices and offsets this rank's rows', so are its results (per bag, and
    per index: `offset2bag`)."""
    bags = node.meta["val"][0].shape[0]
    return tuple(Shard(0) for _ in node.meta["val"]), _bags_of_this_ranks_rows(node, inputs, bags, node.args[0])


def _embedding_bag_backward(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """The table's gradient of `_embedding_bag`: each rank adds its bags' gradients into the
    rows its indices name, a part of the sum over the batch (`Partial`). Not with
    `scale_grad_by_freq`, whose scale counts the indices of the whole batch."""
    grad = node.args[0]
    if node.args[7]:
        raise NoRule("scale_grad_by_freq scales by how often the whole batch names each row")
    reads = _bags_of_this_ranks_rows(node, inputs, grad.meta["val"].shape[0], None)
    return Partial("sum"), reads


def _trilinear(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`nn.Bilinear`'s product (and its gradients'): three tensors unsqueezed (`expand`) to one
    frame, multiplied, and summed over `sumdim`. With the frame's dim 0 the batch's (every input
    not broadcast along it `Shard(0)`, the others, a weight, `Replicate()`), the result keeps
    the rows (`Shard(0)`), or where it sums over them (a weight's gradient) is each rank's
    part of that sum (`Partial`)."""
    tensors, expands, sumdim = node.args[:3], node.args[3:6], node.args[6]
    placements = dict(inputs)
    rows = False
    for tensor, expand in zip(tensors, expands):
        placement = placements.get(tensor, Replicate())
        if 0 in expand and not isinstance(placement, Replicate) or 0 not in expand and placement != Shard(0):
            raise NoRule(f"it multiplies its inputs along the batch's rows (dim 0), so {tensor.name} must be "
                         f"{'Replicate()' if 0 in expand else 'Shard(0)'}, not {format_spec(placement)}")
        rows = rows or 0 not in expand
    if not rows:
        raise NoRule("no input has the batch's rows")
    return (Partial("sum") if 0 in sumdim else Shard(0)), []


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
    return _scatter_add(destination, [mask] + [i for i in indices if isinstance(i, fx.Node)], values)


def _index_put(node: fx.Node, inputs) -> Any:
    destination, indices, values = node.args[:3]
    if not (node.args[3] if len(node.args) > 3 else node.kwargs.get("accumulate", False)):
        raise NoRule("it writes rows in place without summing them")
    # Each row's values summed into that row (an interpolation's gradient): the rows stay.
    if _rows_untouched(indices) and values.meta.get(SPEC_KEY) == Shard(0) and (
            fill_value(destination) == 0 or destination.meta.get(SPEC_KEY) == Shard(0)):
        return Shard(0), []
    return _scatter_add(destination, [i for i in indices if isinstance(i, fx.Node)], values)


def _rows_untouched(indices: list) -> bool:
    """Whether advanced indices leave dim 0, the batch's rows, where it is: no index for it, every
    index `Replicate()`, and the indexed dimensions adjacent (else the indexed dimensions come
    first in the result, as in NumPy), as an interpolation indexes an image's height and width."""
    positions = [d for d, index in enumerate(indices) if index is not None]
    return bool(positions) and positions[0] > 0 and positions == list(range(positions[0], positions[-1] + 1)) \
        and all(isinstance(indices[d].meta.get(SPEC_KEY), Replicate) for d in positions)


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


def _as_strided(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`aten.as_strided(x, size, stride)` that reads all of a contiguous `x` as a contiguous
    tensor of its rows (`_reshapes_rows`; the strides of dims of one element, never stepped,
    any): a reshape that keeps each rank's rows a block of the result's, so `Shard(0)` from
    `Shard(0)` (Inductor's decomposition of a group norm reshapes its statistics so, and that
    of an adaptive average pool its means and their gradient: Swin). DTensor has no rule for
    `as_strided`."""
    source, size, stride = node.args[:3]
    offset = node.args[3] if len(node.args) > 3 else node.kwargs.get("storage_offset")
    val = source.meta["val"]
    if dict(inputs)[source] != Shard(0):
        raise NoRule("it reads a Shard(0) tensor's rows only")
    if not _reshapes_rows(val, size, stride, offset):
        raise NoRule("it reads its input otherwise than as a contiguous tensor of its rows")
    return Shard(0), []


def _reshapes_rows(val: torch.Tensor, size: list[int], stride: list[int], offset: int | None) -> bool:
    """Whether `as_strided` (or its scatter) of `size`, `stride` and `offset` reads (or writes)
    all of the contiguous `val` as a contiguous tensor whose dim 0 holds `val`'s rows whole: as
    many rows, or a multiple of them or a divisor (a flat buffer of rows of 32 read as its
    rows, say), so that each rank's rows are a block of the result's."""
    size, stride = list(size), list(stride)
    return (not offset and val.dim() > 0 and val.is_contiguous() and bool(size) and size[0] > 0
            and (size[0] % val.shape[0] == 0 or val.shape[0] % size[0] == 0)
            and is_row_major(size, stride) and math.prod(size) == val.numel())


def _as_strided_scatter(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`aten.as_strided_scatter(destination, source, size, stride)` that writes a `Shard(0)`
    source over all of a contiguous destination made alike on every rank (zeros), as one
    tensor of its rows: the destination then holds this rank's rows alone, `Shard(0)`
    (functionalized, an adaptive average pool's backward writes its gradient so: Swin).
    DTensor has no rule for it."""
    destination, source, size, stride = node.args[:4]
    offset = node.args[4] if len(node.args) > 4 else node.kwargs.get("storage_offset")
    placed = dict(inputs)
    if placed[source] != Shard(0) or fill_value(destination) is None or list(size) != list(source.meta["val"].shape) \
            or not _reshapes_rows(destination.meta["val"], size, stride, offset):
        raise NoRule("it writes only a Shard(0) source over all of a destination made alike, as its rows")
    return Shard(0), []


def _unfold_rows(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`aten.im2col` (`nn.Unfold`: ConvBERT's span-based convolution) and its gradient,
    `aten.col2im` (`nn.Fold`), of a batch (4-d images, 3-d columns): each row's columns (image)
    from that row's image (columns) alone, as `_batch_rows`. DTensor has no rule for either."""
    if node.args[0].meta["val"].dim() != {aten.im2col.default: 4, aten.col2im.default: 3}[node.target]:
        raise NoRule("it unfolds (folds) a batch of images (columns) only, with the batch's rows at dim 0")
    return _batch_rows(node, inputs)


def _rev(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`prims.rev(x, dims)`, Inductor's decomposition of `flip` (Qwen3-Next's gated delta rule
    reverses its chunks' cumulative decays): each element moves along `dims` alone, so a
    placement over another dimension stays, and a partial value stays partial (a permutation
    is linear). DTensor has no rule for it."""
    (source, placement), = inputs
    dims = [d % max(source.meta["val"].dim(), 1) for d in node.args[1]]
    if isinstance(placement, Shard) and placement.dim in dims:
        raise NoRule("it reverses the dimension its input is sharded on")
    return placement, []


# Ops that make a tensor of one value, or of none yet, alike on every rank: every row of it alike.
_MADE_ALIKE = {aten.new_empty.default, aten.empty.memory_format, aten.new_empty_strided.default,
               aten.empty_strided.default, aten.new_zeros.default, aten.zeros.default, aten.new_full.default,
               aten.full.default, aten.empty_like.default, aten.zeros_like.default, aten.full_like.default}


def _slice_scatter(node: fx.Node, inputs: list[tuple[fx.Node, Placement]]) -> Any:
    """`aten.slice_scatter(base, source, dim)` along a dim other than 0 with a `Shard(0)`
    source of the batch's rows, functionalized `base[..., a:b] = source`: each row of the
    result is that row of the base with a slice of it written from that row of the source,
    so `Shard(0)` where the base is `Shard(0)` with those rows, or made alike on every rank
    by a factory op (`new_empty`, `zeros`, `full`, ...), every row alike, and then read as
    this rank's rows (DeepSeek-V3 builds its keys so: `new_empty`, then the parts without
    and with rotary positions copied into slices of the last dim). DTensor's rule reads
    such a base as replicated, and replicates the source and the result."""
    base, source = node.args[:2]
    dim = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
    placed, val = dict(inputs), base.meta["val"]
    rows = source.meta["val"].shape[0]
    if dim % val.dim() == 0 or placed[source] != Shard(0) or val.shape[0] != rows:
        raise NoRule("it writes a slice along a dim other than 0 of a Shard(0) source's rows only")
    if placed[base] == Shard(0):
        return Shard(0), []
    if isinstance(placed[base], Replicate) and base.target in _MADE_ALIKE:  # one of zeros: its own row shard
        return Shard(0), [] if fill_value(base) is not None else [(base, Shard(0))]
    raise NoRule(f"its base {base.name} ({format_spec(placed[base])}) is neither Shard(0) nor made alike row by row")


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
    DTensor's rule reads a sharded indexed dimension as replicated. Likewise with no index
    for dim 0 (`_rows_untouched`: an interpolation's, `x[:, :, rows_h, cols_w]`)."""
    source, indices = node.args[:2]
    rows = source.meta["val"].shape[0]
    if source.meta.get(SPEC_KEY) == Shard(0) and _rows_untouched(indices):
        return Shard(0), []  # each row indexed alike on other dimensions (an interpolation's)
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
    the backward is linear in it. A forward value stays unplaced: a model that squeezes
    every dimension of size 1 (`squeeze()`, as mBART's labels' shift does; `einsum` at one
    row, XLNet's and Funnel's attention) squeezes away the batch's rows where a rank or a
    microbatch has one, which a batch of more rows keeps (`specs._undecided` says so)."""
    (source, placement), = inputs
    ndim = source.meta["val"].dim()
    dims = node.args[1] if len(node.args) > 1 else range(ndim)
    dims = [d % ndim for d in ([dims] if isinstance(dims, int) else dims)]
    rows = placement.dim if isinstance(placement, Shard) else None
    squeezes_rows = rows is not None and source.meta["val"].shape[rows] == 1 and rows in dims
    if squeezes_rows and not node.meta.get("autograd_backward"):
        raise NoRule(f"it squeezes away dimension {rows}, the batch's rows, one on this rank (`specs`' error "
                     f"says more)")
    if not (squeezes_rows and rows == 0):
        raise NoRule("it squeezes dim 0 away only of a gradient of one row Shard(0)")
    return Partial("sum"), []


RULES: dict[Any, Callable[[fx.Node, list[tuple[fx.Node, Placement]]], tuple[Any, list]]] = {
    # Attention: batch row b of the output (and log-sum-exp), and of the gradients, reads row
    # b of q, k, v (and of the mask) alone. DTensor has no rule for the CPU flash kernels, its
    # rule for cuDNN's takes no mask (Hugging Face's bf16 attention on a GPU), and torch 2.11's
    # for the memory-efficient backward fails on its mask's gradient left undefined (fp32 on
    # a GPU); a mask broadcast over the batch, it would gather the batch's rows for.
    aten._scaled_dot_product_flash_attention_for_cpu.default: _batch_rows,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _batch_rows,
    aten._scaled_dot_product_efficient_attention.default: _batch_rows,
    aten._scaled_dot_product_efficient_attention_backward.default: _efficient_attention_backward,
    aten._scaled_dot_product_cudnn_attention.default: _batch_rows,
    aten._scaled_dot_product_cudnn_attention_backward.default: _batch_rows,
    # Max pooling as Inductor decomposes it: each row's window maxima and their offsets, and
    # the offsets as indices, from that row alone.
    torch.ops.prims._low_memory_max_pool_with_offsets.default: _batch_rows,
    torch.ops.prims._low_memory_max_pool_offsets_to_indices.default: _batch_rows,
    # Pooling's gradients, for which DTensor has no rule (it has the forwards'): each row's
    # (each plane's) from that row's gradient, input and indices alone (Funnel's pooling of
    # the sequence, under eager code).
    **dict.fromkeys((aten.avg_pool2d_backward.default, aten.avg_pool3d_backward.default,
                     aten._adaptive_avg_pool2d_backward.default, aten._adaptive_avg_pool3d_backward.default,
                     aten.max_pool2d_with_indices_backward.default, aten.max_pool3d_with_indices_backward.default,
                     aten.adaptive_max_pool2d_backward.default, aten.adaptive_max_pool3d_backward.default),
                    _batch_rows),
    aten.var_mean.correction: _row_statistics,
    aten.im2col.default: _unfold_rows,
    aten.col2im.default: _unfold_rows,
    aten._weight_norm_interface_backward.default: _weight_norm_backward,
    aten._embedding_bag.default: _embedding_bag,
    aten._embedding_bag_backward.default: _embedding_bag_backward,
    aten._trilinear.default: _trilinear,
    torch.ops.prims.convert_element_type.default: _convert_element_type,
    # The embedding backward as Inductor decomposes it: a scatter-add into zeros.
    aten._unsafe_masked_index_put_accumulate.default: _masked_index_put_accumulate,
    # DTensor's index_put rule needs the indices replicated; a scatter-add of each rank's
    # rows (e.g. the backward of indexing the batch's rows) is a partial sum.
    aten.index_put.default: _index_put,
    aten._unsafe_index_put.default: _index_put,
    aten.slice_scatter.default: _slice_scatter,
    aten.as_strided.default: _as_strided,
    aten.as_strided_scatter.default: _as_strided_scatter,
    torch.ops.prims.rev.default: _rev,
    aten.copy.default: _copy,
    aten.fill.Tensor: _copy,
    aten.index.Tensor: _index_rows,
    aten._unsafe_index.Tensor: _index_rows,
    aten.squeeze.dim: _squeeze_one_row,
    aten.squeeze.dims: _squeeze_one_row,
    aten.squeeze.default: _squeeze_one_row,
}
