"""Expert parameters, sharded by experts over the expert-parallel group.

A mixture-of-experts layer holds its experts as batched weights whose dim 0
indexes the expert (e.g. `w_in` of shape (experts, d, hidden)). The model says
which they are with `piper_fx.mark_experts(module)`; with `mesh.ep > 1`,
`prepare` replaces each by the block of experts this rank computes (rank i of
the ep group holds experts [i*E/ep, (i+1)*E/ep)), a `Shard(0)` DTensor
parameter on the ep mesh (`dtensor_params`) whose reads turn the block back
into the full weight with the `piper::unshard_experts` op. Dynamo traces that op as a marker, distinct from
ZeRO's `piper::unshard` (whose group may be the very same ranks when ep = dp); the pass
`shard_experts` lowers it and its backward (`piper::reduce_expert_grad`) to
the local computation of an expert-parallel layer. Used eagerly (outside
`torch.compile`, e.g. by `full_state_dict`) the ops gather the experts over
the group and reduce-scatter their gradient, so a prepared model still runs
as a plain module.
"""
from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from .dtensor_params import program_placeholder
from .read_through import read_through
from .row_shard import INFO_ATTR, RowShardLayout, ShardedParameter, define_row_markers

EXPERT_ATTR = "_piper_expert"


def mark_experts(module: nn.Module) -> nn.Module:
    """Declare every parameter of `module` an expert weight: dim 0 indexes the experts.

    With `mesh.ep > 1`, `piper_fx.prepare` shards these over the expert-parallel
    group, and their computation must run inside `piper_fx.annotate("EP")`.
    Returns `module`.
    """
    for p in module.parameters():
        setattr(p, EXPERT_ATTR, True)
    return module


def is_expert_parameter(p: object) -> bool:
    return isinstance(p, nn.Parameter) and getattr(p, EXPERT_ATTR, False)


# The markers Dynamo traces where the expert weights are read, and where their gradient leaves:
# distinct from ZeRO's, whose group may be the very same ranks when ep = dp.
UNSHARD_EXPERTS, REDUCE_EXPERT_GRAD = define_row_markers("unshard_experts", "reduce_expert_grad")


def expert_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    """The parameters `mark_experts` marked, by name."""
    return {name: p for name, p in model.named_parameters() if is_expert_parameter(p)}


def shard_experts(model: nn.Module, mesh: DeviceMesh) -> None:
    """Replace every expert parameter of `model` by this rank's block of experts, a `Shard(0)`
    DTensor parameter on the 1-D `mesh` (the strategy mesh's "ep"), in place.

    Requires: each expert parameter's dim 0 divides by the mesh's size (checked by `prepare`).
    """
    group_name = mesh.get_group().group_name
    held = [(module_name, module, name, p) for module_name, module in model.named_modules()
            for name, p in module._parameters.items() if p is not None and is_expert_parameter(p)]
    for module_name, module, name, p in held:
        fqn = f"{module_name}.{name}" if module_name else name
        layout = RowShardLayout(tuple(p.shape), mesh.size())
        shard = layout.parameter(p.detach(), mesh, p.requires_grad)
        setattr(shard, EXPERT_ATTR, True)
        setattr(shard, INFO_ATTR, ShardedParameter((fqn,), layout, group_name, mesh_dim="ep"))
        module._parameters[name] = shard
        full_shape = list(layout.full_shape)
        read_through(module, name, program_placeholder(shard, fqn), (UNSHARD_EXPERTS, full_shape, group_name))
