"""What every placement rule shares (`specs` decides each node's placement, asking its own
rules and DTensor's, `dtensor_rules`): the meta key of a node's placement, how a placement
is written and when one is decided, a node's tensor inputs, the value a factory fills a
tensor with, and the exception a rule raises when it does not hold for the inputs' placements.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.distributed.tensor.placement_types import Placement
from torch.utils._pytree import tree_flatten

SPEC_KEY = "piper_spec"

aten = torch.ops.aten


def format_spec(spec: Any) -> str:
    if spec is None:
        return "-"
    if isinstance(spec, tuple):
        return "(" + ", ".join(format_spec(s) for s in spec) + ")"
    if isinstance(spec, Placement):
        return f"dp:{spec}"
    return str(spec)


def is_decided(spec: Any, val: Any) -> bool:
    """Whether `spec` places `val` completely: a `Placement` for a tensor, a tuple of
    specs for a tuple or list of values, None for anything else."""
    if isinstance(val, torch.Tensor):
        return isinstance(spec, Placement)
    if isinstance(val, (tuple, list)):
        return isinstance(spec, tuple) and len(spec) == len(val) and all(map(is_decided, spec, val))
    return spec is None


def tensors(val: Any) -> list[torch.Tensor]:
    return [v for v in tree_flatten(val)[0] if isinstance(v, torch.Tensor)]


def tensor_inputs(node: fx.Node) -> list[fx.Node]:
    return [a for a in node.all_input_nodes if tensors(a.meta.get("val"))]


class NoRule(Exception):
    pass


class DTensorFailed(NoRule):
    """DTensor's propagator raised on the op (it has a rule, but not for these inputs)."""


_ZERO_FACTORIES = {aten.zeros.default, aten.new_zeros.default, aten.zeros_like.default}
_FILL_ARGUMENT = {aten.full.default: 1, aten.new_full.default: 2, aten.full_like.default: 1}


def fill_value(node: fx.Node) -> Any:
    """The value every element of `node` holds, if a factory made it so; else None."""
    if node.target in _ZERO_FACTORIES:
        return 0
    index = _FILL_ARGUMENT.get(node.target)
    if index is not None and len(node.args) > index and isinstance(node.args[index], (int, float, bool)):
        return node.args[index]
    return None


def alike(val: Any, placement: Placement) -> Any:
    """`placement` for every tensor of `val`, None for what is no tensor."""
    if isinstance(val, torch.Tensor):
        return placement
    if isinstance(val, (tuple, list)):
        return tuple(alike(v, placement) for v in val)
    return None
