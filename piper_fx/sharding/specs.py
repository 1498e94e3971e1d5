"""DTensor-style placement specs on every FX node (`node.meta["piper_spec"]`).

Placements over the data-parallel mesh dimension are propagated with DTensor's
own sharding propagator (the rules `DTensor` dispatch uses), on a planning
mesh that needs no process group. Seeds: a replica's batch is `Shard(0)`,
parameters are `Replicate()` (or `Shard(0)` when stored as row shards),
the loss seed gradient is `Replicate()`. Our own ops (the ZeRO markers and
functional collectives) have their rules here, since their placement change
*is* their meaning.
"""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from ..compat import DTensorSpec, OpSchema, TensorMeta
from ..ops import REDUCE_GRAD, UNSHARD, WAIT
from .mesh import process_group_device_type

SPEC_KEY = "piper_spec"
UNKNOWN = "?"

_c10d = torch.ops._c10d_functional
_FIXED: dict[Any, Placement] = {
    _c10d.all_gather_into_tensor.default: Replicate(),
    _c10d.reduce_scatter_tensor.default: Shard(0),
    _c10d.all_reduce.default: Replicate(),
}


def planning_mesh(dp: int, device_type: str | None = None) -> DeviceMesh:
    """A ("dp",) mesh for propagation only: no process group is touched. By default
    for the device type the process group communicates on, as the real mesh."""
    return DeviceMesh(device_type or process_group_device_type(), list(range(dp)), mesh_dim_names=("dp",),
                      _init_backend=False, _rank=0)


def format_spec(spec: Any) -> str:
    if spec is None:
        return "-"
    if isinstance(spec, tuple):
        return "(" + ", ".join(format_spec(s) for s in spec) + ")"
    if isinstance(spec, Placement):
        return f"dp:{spec}"
    return str(spec)


def _tensor_meta(val: torch.Tensor) -> TensorMeta:
    return TensorMeta(val.shape, val.stride(), val.dtype)


def _as_dtensor_spec(mesh: DeviceMesh, node: fx.Node) -> Any:
    spec, val = node.meta.get(SPEC_KEY), node.meta.get("val")
    if isinstance(spec, Placement) and isinstance(val, torch.Tensor):
        return DTensorSpec(mesh, (spec,), tensor_meta=_tensor_meta(val))
    raise LookupError(node.name)


def _from_output_spec(out: Any) -> Any:
    if isinstance(out, DTensorSpec):
        return out.placements[0]
    if isinstance(out, (tuple, list)):
        return tuple(_from_output_spec(o) for o in out)
    return None


def _propagate_with_dtensor(mesh: DeviceMesh, node: fx.Node) -> Any:
    args = fx.node.map_arg(node.args, lambda n: _as_dtensor_spec(mesh, n))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: _as_dtensor_spec(mesh, n))
    schema = OpSchema(node.target, args, kwargs)
    result = DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding(schema)
    return _from_output_spec(result.output_spec)


def _input_specs(node: fx.Node) -> list[Any]:
    return [a.meta.get(SPEC_KEY) for a in node.all_input_nodes]


def infer_spec(mesh: DeviceMesh, node: fx.Node) -> Any:
    """The placement of `node`'s value from its inputs' placements."""
    if node.target in _FIXED:
        return _FIXED[node.target]
    if node.target is WAIT:
        return node.args[0].meta.get(SPEC_KEY)
    if node.target is UNSHARD:
        return Replicate()
    if node.target is REDUCE_GRAD:
        return Shard(0)
    if node.target is operator.getitem:
        parent = node.args[0].meta.get(SPEC_KEY)
        return parent[node.args[1]] if isinstance(parent, tuple) else parent
    inputs = _input_specs(node)
    if all(isinstance(s, Replicate) for s in inputs):
        return Replicate()
    try:
        return _propagate_with_dtensor(mesh, node)
    except Exception:
        return _batch_preserving_fallback(node, inputs)


def _batch_preserving_fallback(node: fx.Node, inputs: list[Any]) -> Any:
    """For ops DTensor has no rule for (e.g. CPU flash attention): an op whose
    sharded inputs are all batch-sharded and whose outputs all keep that batch
    size as dim 0 acts row by row, so its outputs are `Shard(0)` too. Anything
    else is shown as unknown in the dumps rather than guessed."""
    sharded = [(a, s) for a, s in zip(node.all_input_nodes, inputs) if not isinstance(s, Replicate)]
    if not sharded or any(s != Shard(0) for _, s in sharded):
        return UNKNOWN
    batch = sharded[0][0].meta["val"].shape[0]
    val = node.meta.get("val")
    outs = val if isinstance(val, (tuple, list)) else (val,)
    if all(isinstance(o, torch.Tensor) and o.dim() >= 1 and o.shape[0] == batch for o in outs):
        return tuple(Shard(0) for _ in outs) if isinstance(val, (tuple, list)) else Shard(0)
    return UNKNOWN


def propagate(graph: fx.Graph, seeds: dict[str, Placement], mesh: DeviceMesh) -> None:
    """Set `meta["piper_spec"]` on every node; placeholders take theirs from `seeds`."""
    for node in graph.nodes:
        if node.op == "placeholder":
            node.meta[SPEC_KEY] = seeds[node.name]
        elif node.op == "call_function":
            node.meta[SPEC_KEY] = infer_spec(mesh, node)


def placement_table(graph: fx.Graph) -> str:
    rows = [f"{'node':<40} {'op':<44} {'shape':<22} spec"]
    for node in graph.nodes:
        if node.op == "output":
            continue
        val = node.meta.get("val")
        shape = tuple(val.shape) if isinstance(val, torch.Tensor) else "-"
        op = str(node.target) if node.op == "call_function" else node.op
        rows.append(f"{node.name:<40} {op[:44]:<44} {str(shape):<22} {format_spec(node.meta.get(SPEC_KEY))}")
    return "\n".join(rows) + "\n"
