"""`piper_fx.prepare`: parameter layout, fixed before the optimizer is built.

Layout changes belong here and not in the backend: changing a parameter's
shape while Dynamo compiles makes its guards fail on the frame it just built.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn

from .errors import PiperConfigError
from .options import Strategy, parse_options_on_all_ranks
from .sharding.mesh import dp_group_name
from .sharding.replicas import broadcast_from_first_replica
from .sharding.row_shard import shard_parameters

_LAYOUT_ATTR = "_piper_layout_key"


def prepare(model: nn.Module, options: Mapping[str, Any] | None = None) -> nn.Module:
    """Lay out `model`'s parameters for the strategy in `options`, in place.

    With ZeRO >= 1 over dp > 1 ranks every parameter becomes its 1/dp row shard
    (a new `nn.Parameter`; build the optimizer afterwards, as with FSDP2).
    Otherwise the layout does not change. Calling it again with the same layout
    is a no-op. With dp > 1 it first gives every replica the first replica's
    parameters and buffers, as DDP does, so it is collective: every rank must call it.
    """
    strategy = parse_options_on_all_ranks(options)
    applied = prepared_layout(model)
    if applied is not None:
        if applied != strategy.layout_key():
            raise PiperConfigError(
                "options", dict(options or {}),
                f"the model was already prepared for a different layout {applied}; "
                "build a fresh model to change mesh or ZeRO sharding")
        return model
    group_name = dp_group_name(strategy)
    broadcast_from_first_replica([*model.parameters(), *model.buffers()], group_name)
    if strategy.shards_parameters:
        shard_parameters(model, group_name, strategy.dp, strategy.dp_index)
    if strategy.microbatches > 1:
        model.register_forward_pre_hook(_mark_batch_dimension_dynamic)
    setattr(model, _LAYOUT_ATTR, strategy.layout_key())
    return model


@torch._dynamo.disable
def _mark_batch_dimension_dynamic(module: nn.Module, args: tuple) -> None:
    """Runs outside Dynamo before each call: batch sizes reach the backend as
    SymInts, so it can trace the model at microbatch size (see capture)."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            torch._dynamo.maybe_mark_dynamic(arg, 0)


def prepared_layout(model: nn.Module) -> tuple | None:
    return getattr(model, _LAYOUT_ATTR, None)


def check_prepared(strategy: Strategy, sharded_inputs: int, plain_parameters: int) -> None:
    """Raise if the parameters the backend sees do not match `strategy`'s layout."""
    if strategy.shards_parameters and plain_parameters:
        raise PiperConfigError(
            "zero", strategy.zero,
            f"ZeRO-{strategy.zero} over dp={strategy.dp} needs sharded parameters: call "
            "piper_fx.prepare(model, options) with the same options before building the "
            "optimizer and compiling")
    if not strategy.shards_parameters and sharded_inputs:
        raise PiperConfigError(
            "zero", strategy.zero,
            "the model was prepared with sharded parameters (ZeRO >= 1), but these options "
            "do not shard; compile with the options given to prepare")
