"""The op vocabulary every pass, the renderer, codegen and the runtime share.

Each concept is defined here once: what is a collective (and of which kind),
its wait, a ZeRO or expert marker, a heavy op (compute worth hiding
communication behind), and the `node.meta` keys the passes leave on nodes.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .collectives.buckets import GATHER_BUCKET
from .sharding.experts import REDUCE_EXPERT_GRAD, UNSHARD_EXPERTS
from .sharding.row_shard import REDUCE_GRAD, UNSHARD

# ---- Functional collectives (`torch.distributed._functional_collectives`) and their wait.
WAIT = torch.ops._c10d_functional.wait_tensor.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default

_COLLECTIVE_KINDS = {"all_gather_into_tensor": "all_gather", "all_gather_into_tensor_out": "all_gather",
                     "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_out": "reduce_scatter",
                     "all_reduce": "all_reduce", "all_to_all_single": "all_to_all",
                     # In-place forms, which Inductor's reinplacing makes of the ones above.
                     "all_reduce_": "all_reduce"}


def collective_op_kind(op) -> str | None:
    """`all_gather`, `reduce_scatter`, `all_reduce` or `all_to_all` for a functional collective
    op, or a bucket's all-gather (`piper::gather_bucket`, issued and waited as one), else None."""
    if op is GATHER_BUCKET:
        return "all_gather"
    if getattr(op, "namespace", "") != "_c10d_functional":
        return None
    return _COLLECTIVE_KINDS.get(op.__name__.split(".")[0])


def collective_kind(node: fx.Node) -> str | None:
    """The kind of a functional collective's node (`collective_op_kind`), else None."""
    return collective_op_kind(node.target) if node.op == "call_function" else None


def collective_group(node: fx.Node) -> str:
    """The name of the process group a functional collective's node runs on: its `group_name`
    argument, wherever its op's schema puts it."""
    index = [a.name for a in node.target._schema.arguments].index("group_name")
    return node.args[index] if index < len(node.args) else node.kwargs["group_name"]


def collective_sends(node: fx.Node) -> tuple[tuple[int, ...], torch.dtype] | None:
    """The shape and dtype of what a collective's node sends from this rank (its input's; a
    bucket's all-gather sends its shards, cast and flattened into one), or None where its
    input has no `val`."""
    if node.target is GATHER_BUCKET:
        shards, _, _, dtype = node.args
        vals = [shard.meta.get("val") for shard in shards]
        return None if any(val is None for val in vals) else ((sum(val.numel() for val in vals),), dtype)
    val = node.args[0].meta.get("val")
    return None if val is None else (tuple(val.shape), val.dtype)


def is_wait(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target is WAIT


def wait_of(collective: fx.Node) -> fx.Node | None:
    """The wait of a collective's result, if it has one."""
    return next((user for user in collective.users if user.target is WAIT), None)


# ---- Markers Dynamo traces where a sharded parameter is read; passes lower them to collectives
# (defined with `sharding.row_shard.define_row_markers`).
ZERO_MARKERS = (UNSHARD, REDUCE_GRAD)            # `piper::unshard` and its backward
EXPERT_MARKERS = (UNSHARD_EXPERTS, REDUCE_EXPERT_GRAD)

# ---- Casts: what a pure dtype conversion looks like in a joint graph (decomposed or not).
CONVERT = torch.ops.prims.convert_element_type.default
_TO_COPY = torch.ops.aten._to_copy.default


def cast_dtype(node: fx.Node) -> torch.dtype | None:
    """The dtype `node` converts its input to, if it is a pure dtype cast (`prims.convert_element_type`,
    or `aten._to_copy` changing nothing but the dtype: autograd's backward of a cast also names
    the strided layout and its input's device); else None."""
    if node.op != "call_function":
        return None
    if node.target is CONVERT:
        return node.args[1]
    if node.target is not _TO_COPY or len(node.args) != 1 or "dtype" not in node.kwargs:
        return None
    val = getattr(node.args[0], "meta", {}).get("val")
    same = {"layout": torch.strided, "device": None if val is None else val.device}
    if any(key not in same or value != same[key] for key, value in node.kwargs.items() if key != "dtype"):
        return None
    return node.kwargs["dtype"]


# ---- Aliases: ops whose result shares its input's data without reading it.
def is_alias(node: fx.Node) -> bool:
    """A view op (its schema returns an alias of its input: `view`, `split_with_sizes`,
    `permute`, ...) or an item of a tuple result (`operator.getitem`): it reads no data, so
    it can run whenever its input exists."""
    if node.op != "call_function":
        return False
    return node.target is operator.getitem or bool(getattr(node.target, "is_view", False))


# ---- Heavy ops: matmuls and attention, the compute a collective can hide behind.
MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default,
           torch.ops.aten.baddbmm.default}


def is_attention(node: fx.Node) -> bool:
    return "scaled_dot_product" in str(node.target)


def is_heavy(node: fx.Node) -> bool:
    """Compute worth hiding a collective behind: a matmul or an attention."""
    return node.target in MATMULS or is_attention(node)


# ---- `node.meta` keys the passes set, each starting with META_PREFIX.
META_PREFIX = "piper_"
# Ops that run once per step rather than per microbatch: `node.meta[PHASE]` is one of these.
PHASE = "piper_phase"
STEP_START, STEP_END = "step_start", "step_end"
# The unit a ZeRO-3 all-gather serves (`sharding.units`: a layer such as `model.layers.3`, or
# outside units the module reading the parameter); buckets never span two.
UNIT = "piper_unit"
# The unit (`sharding.units`) whose forward runs a node, or whose forward a backward node
# differentiates, on every such node of the joint graph (`capture`); code generation compiles a
# task as one region per unit it runs, each distinct region once (`codegen.regions`).
LAYER = "piper_layer"
# What a collective moves, in words, for the dumps (`all_gather blocks.0.attn.qkv.weight (forward)`).
COMM_NOTE = "piper_comm"
# The placement over dp a lowered placement change leaves its result in (`lower_redistributions`),
# which `propagate_placements` takes as stated: each rank's rows of a replicated value are `Shard(0)`,
# though the slice that takes them looks replicated to DTensor's rules.
PLACED = "piper_placed"
# On a copy `checkpoint_activations` made to recompute a forward value in the backward: that value.
RECOMPUTES = "piper_recomputes"
# On each placeholder of Dynamo's graph: the name of its input's source, as Dynamo names it
# (`L['self']._modules['rotary']._buffers['inv_freq']`), which tells a buffer from a batch
# argument. Kept by the backend (`capture.keep_input_sources`): Dynamo deletes its own record
# of it (`grapharg`) once the frame's compile ends, before the step's first call plans the step.
SOURCE = "piper_source"
