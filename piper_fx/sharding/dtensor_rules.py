"""DTensor's sharding propagator asked about one node of the joint graph (step 6 of
`specs`'s order): the op's schema info as DTensor's dispatch gives it, global shapes that
fit this rank's, and the inputs it reads otherwise placed than they are."""
from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, NamedTuple

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_flatten

from ..compat import DTensorSpec, OpSchema, TensorMeta
from .library_rules import register_for
from .spec_base import SPEC_KEY, DTensorFailed, NoRule, fill_value, format_spec, tensor_inputs


def _sharded_dim(placement: Any) -> int | None:
    """The tensor dimension `placement` shards, if it shards one."""
    dim = getattr(placement, "dim", None)  # Shard's and _StridedShard's
    return dim if isinstance(dim, int) else None


def _meta(val: torch.Tensor, placement: Placement, ranks: int | None) -> TensorMeta:
    """`val`'s metadata; with `ranks`, the global tensor's: its sharded dimension `ranks`
    times this rank's, strides in the same order: by stride, and of dimensions of one stride
    (broadcast ones, of stride 0) the later inner, as in a contiguous tensor. A dimension of
    size 1 has no order of its own (its stride is never stepped): it is taken to sit just
    outside the next one, so the views that fold it with the next dimension on this rank fold
    the global tensor too (with one row a rank, matmul's decomposition views a transposed
    batch as rows of heads, and one row of keys expanded over a query's heads as rows of
    heads: Falcon, Gemma 2)."""
    shape, dim = list(val.shape), _sharded_dim(placement)
    if ranks is None or dim is None:
        return TensorMeta(val.shape, val.stride(), val.dtype)
    # Each dimension's place, innermost first: by stride, of one stride the later first; a
    # dimension of size 1 just outside the next one.
    order: list[tuple[int, int, int]] = [(0, 0, 0)] * len(shape)
    for d in reversed(range(len(shape))):
        if shape[d] == 1 and d + 1 < len(shape):
            stride_of_next, next_dim, outside = order[d + 1]
            order[d] = (stride_of_next, next_dim, outside + 1)
        else:
            order[d] = (val.stride(d), -d, 0)
    shape[dim] *= ranks
    stride, step = [0] * len(shape), 1
    for d in sorted(range(len(shape)), key=order.__getitem__):  # innermost first
        stride[d], step = step, step * shape[d]
    return TensorMeta(torch.Size(shape), tuple(stride), val.dtype)


def _as_dtensor_spec(mesh: DeviceMesh, node: fx.Node, placed: dict[fx.Node, Placement], ranks: int | None) -> Any:
    spec, val = placed.get(node, node.meta.get(SPEC_KEY)), node.meta.get("val")
    if isinstance(spec, Placement) and isinstance(val, torch.Tensor):
        return DTensorSpec(mesh, (spec,), tensor_meta=_meta(val, spec, ranks))
    return val  # a value that is no tensor (a SymInt, a scalar) is an argument as it is


def _from_output_spec(out: Any) -> Any:
    if isinstance(out, DTensorSpec):
        return out.placements[0]
    if isinstance(out, (tuple, list)):
        return tuple(_from_output_spec(o) for o in out)
    return None


def _argument_nodes(node: fx.Node, info: Any) -> list[fx.Node]:
    """The tensor arguments of `node`, in the order of DTensor's `OpSchema.args_spec`."""
    args = tree_flatten(node.args)[0] if info is not None and info.needs_pytree else node.args
    return [a for a in args if isinstance(a, fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]


def _cache_key(mesh: DeviceMesh, schema: OpSchema) -> Any:
    def key(leaf):
        if isinstance(leaf, DTensorSpec):
            meta = leaf.tensor_meta
            return "spec", leaf.placements, tuple(meta.shape), tuple(meta.stride), meta.dtype
        return leaf
    leaves, structure = tree_flatten((schema.args_schema, schema.kwargs_schema))
    return mesh.device_type, mesh.size(), schema.op, tuple(map(key, leaves)), str(structure)


def _holds_as(node: fx.Node, placement: Placement) -> bool:
    """Whether `node`'s value, as every rank holds it, is also placed `placement`: true of
    a tensor with no elements, and of a factory's replicated tensor of one repeated value,
    which is its own row shard and the average, maximum and minimum of the ranks' copies
    (and, if zeros, their sum)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.numel() == 0:
        return True
    fill = fill_value(node)
    if fill is None or not isinstance(node.meta.get(SPEC_KEY), Replicate):
        return False
    if isinstance(placement, Shard):
        return True
    if isinstance(placement, Partial):
        return placement.reduce_op in ("avg", "max", "min") or (placement.reduce_op == "sum" and fill == 0)
    return False


class _Refused(NamedTuple):
    """DTensor's propagator raised on an op: what it said, without the exception itself,
    whose traceback holds every frame of the planning that asked (the joint graph, its
    fake values), which a cached answer would keep alive for the life of the process."""
    no_rule: bool  # it has no rule for the op (NotImplementedError)
    reason: str  # the exception's type and first line


# DTensor's answers (or its refusal), by every argument: DTensor's own cache keys only
# the non-tensor arguments an op's schema info names.
_ANSWERS: dict[Any, Any] = {}


def _ask_dtensor(mesh: DeviceMesh, node: fx.Node, placed: dict[fx.Node, Placement], global_shapes: bool = False,
                 shape: list[int] | None = None) -> tuple[Any, list]:
    """DTensor's placement of `node`'s value from its inputs' placements (those in `placed`
    instead of their own), and the inputs its rule reads otherwise placed, with the
    placement it reads each as, but for those that hold as it anyway. DTensor is given
    this rank's shapes as the global ones; with `global_shapes`, the global shapes instead
    (and `shape` as the op's shape argument, if it has one), and its answer must fit this
    rank's shapes."""
    register_for(node.target)  # a library's custom op that ships no rule, but we know one
    propagator = DTensor._op_dispatcher.sharding_propagator
    # The op's schema info, as DTensor's own dispatch passes it: which arguments are lists
    # to flatten, and which non-tensor arguments the sharding depends on.
    info = (propagator.op_to_schema_info.get(node.target)
            or propagator.op_to_schema_info_for_single_dim_strategy.get(node.target))
    ranks = mesh.size() if global_shapes else None
    as_spec = lambda n: _as_dtensor_spec(mesh, n, placed, ranks)  # noqa: E731
    args = list(node.args)
    index = _shape_argument(node)
    if shape is not None and index is not None:
        args[index] = shape
    schema = OpSchema(node.target, fx.node.map_arg(tuple(args), as_spec), fx.node.map_arg(node.kwargs, as_spec),
                      schema_info=info)
    try:
        key = _cache_key(mesh, schema)
        hash(key)
    except TypeError:  # an unhashable argument: not cached
        key = None
    if key is None or key not in _ANSWERS:
        try:
            with _quiet_meta_failures():
                result = propagator.propagate_op_sharding_non_cached(schema)
            answer = result.output_spec, result.redistribute_schema
        except Exception as e:  # noqa: BLE001 - DTensor's reason, whatever it is, goes into the error
            first_line = (str(e).strip().splitlines() or [""])[0][:200]
            answer = _Refused(isinstance(e, NotImplementedError), f"{type(e).__name__}: {first_line}")
        if key is not None:
            if len(_ANSWERS) > 100_000:
                _ANSWERS.clear()
            _ANSWERS[key] = answer
    else:
        answer = _ANSWERS[key]
    if isinstance(answer, _Refused):
        if answer.no_rule:
            raise NoRule("DTensor's sharding propagator has no rule for this op")
        raise DTensorFailed(f"DTensor's sharding propagator failed on it ({answer.reason})")
    output_spec, redistribute = answer
    if ranks is not None and not _fits(output_spec, node.meta.get("val"), ranks):
        raise DTensorFailed(f"DTensor's placement {format_spec(_from_output_spec(output_spec))} of the "
                             f"global value does not fit this rank's")
    reads = []
    if redistribute is not None:
        for a, given, read in zip(_argument_nodes(node, info), schema.args_spec, redistribute.args_spec):
            if given.placements != read.placements and not _holds_as(a, read.placements[0]):
                reads.append((a, read.placements[0]))
    return _from_output_spec(output_spec), reads


class _MetaFailure(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("failed while attempting to run meta")


@contextlib.contextmanager
def _quiet_meta_failures():
    """Without fake tensors' log of an op that failed on them: DTensor's propagator runs the
    op on fake tensors of the shapes it is given, and a failure there is an answer here (a
    global shape that does not fit), not an error to report."""
    logger, quiet = logging.getLogger("torch._subclasses.fake_tensor"), _MetaFailure()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


def _shape_argument(node: fx.Node) -> int | None:
    """The index of the argument of `node`'s op that is the shape of its result (a view's,
    a factory's), which DTensor reads as the global shape; None if it has none."""
    index = DTensor._op_dispatcher.sharding_propagator.op_to_shape_and_stride_idx.get(node.target)
    return index[0] if isinstance(index, tuple) else index


def _fits(output_spec: Any, val: Any, ranks: int) -> bool:
    """Whether DTensor's global output spec is of values of this rank's shapes."""
    if isinstance(output_spec, (tuple, list)) and isinstance(val, (tuple, list)):
        return len(output_spec) == len(val) and all(_fits(o, v, ranks) for o, v in zip(output_spec, val))
    if not isinstance(output_spec, DTensorSpec) or not isinstance(val, torch.Tensor):
        return output_spec is None and not isinstance(val, torch.Tensor)
    shape = list(output_spec.tensor_meta.shape)
    dim = _sharded_dim(output_spec.placements[0])
    if dim is not None:
        if shape[dim] % ranks:
            return False
        shape[dim] //= ranks
    return shape == list(val.shape)


def _global_attempts(node: fx.Node, ranks: int) -> list[list[int] | None]:
    """The global shapes of `node`'s result to give DTensor as its op's shape argument, most
    likely first (None for an op with none): the one whose sharded dimension is that of its
    first sharded input (a view keeps the batch where it was), or where that input is a
    strided shard (the batch's rows folded inside `split_factor` leading elements, as a
    time-major (T, B, E) tensor viewed as (T * B, E) for a matmul has them), the dimensions
    after that many leading elements first (the view that unfolds them again); then any
    other, then none."""
    val = node.meta.get("val")
    if _shape_argument(node) is None or not isinstance(val, torch.Tensor):
        return [None]
    placement = next((p for a in tensor_inputs(node) if _sharded_dim(p := a.meta.get(SPEC_KEY)) is not None), None)
    if placement is None:
        return [list(val.shape)]
    first, split = _sharded_dim(placement), getattr(placement, "split_factor", None)
    unfolded = [e for e in range(val.dim()) if split is not None and math.prod(val.shape[:e]) == split]
    dims = sorted(range(val.dim()), key=lambda e: (e not in unfolded, e != first))
    return [[n * ranks if d == e else n for d, n in enumerate(val.shape)] for e in dims] + [list(val.shape)]


def dtensor_answer(mesh: DeviceMesh, node: fx.Node) -> tuple[Any, list[tuple[fx.Node, Placement]]]:
    """DTensor's placement of `node`'s value and the inputs its rule reads otherwise placed
    (`_ask_dtensor`). Raises `NoRule` if DTensor has no rule or fails on the op.

    DTensor is given the global shapes (a sharded dimension is this rank's times the number
    of ranks, whose checks, e.g. that a view folds no sharded dimension of one row, are of
    the batch, not of this rank's rows), and for an op with a shape argument each global
    shape of its result in turn (`_global_attempts`), until its answer fits this rank's
    shapes. (With one row per rank, a view cannot tell the batch's dimension from a new one
    of size 1: it is taken to stay where it was.) Where it fails on all of them, e.g. on a
    replicated tensor of this rank's batch size (such as its row numbers) meeting a sharded
    one, it is given this rank's shapes as the global ones.

    Where its rule reads an input otherwise placed and some inputs are a factory's tensors
    of one repeated value, which hold as any `Shard` too (`_holds_as`), it is asked again
    with those placed as each other input is, and an answer that reads none is taken:
    DTensor's rules often follow the first input (e.g. in Inductor's slice backward, a
    scatter into zeros)."""
    attempts = [(True, shape) for shape in _global_attempts(node, mesh.size())] + [(False, None)]
    failure = None
    for global_shapes, shape in attempts:
        try:
            output, reads = _ask_dtensor(mesh, node, {}, global_shapes, shape)
        except DTensorFailed as e:
            failure = failure or e
            continue
        break
    else:
        raise failure
    if reads:
        inputs = tensor_inputs(node)
        fills = [a for a in inputs if _holds_as(a, Shard(0))]
        for placement in dict.fromkeys(a.meta[SPEC_KEY] for a in inputs if a not in fills):
            if isinstance(placement, Shard):
                try:
                    again, again_reads = _ask_dtensor(mesh, node, dict.fromkeys(fills, placement), global_shapes, shape)
                except NoRule:
                    continue
                if not again_reads:
                    return again, again_reads
    return output, reads
