"""`piper_fx.prepare`: parameter layout, fixed before the optimizer is built.

Layout changes belong here and not in the backend: changing a parameter's
shape while Dynamo compiles makes its guards fail on the frame it just built.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .compat import dynamo_config, maybe_mark_dynamic, resolve_process_group
from .errors import PiperConfigError, PiperError
from .options import Strategy, parse_options_on_all_ranks
from .sharding.read_through import gathers_in_eager_forward, laid_out_on_meta, replicate_parameters, trace_in_dtype
from .sharding.experts import expert_parameters, is_expert_parameter, shard_experts
from .sharding.fused_optimizers import step_fused_optimizers_on_local_tensors
from .sharding.holdings import Holding, held_parameters, hide_released_parameters, record_holding
from .sharding.mesh import dp_group_name, expert_replica_group_name, strategy_mesh
from .sharding.replicas import broadcast_from_first_replica
from .sharding.row_shard import shard_parameters, sharded_parameter_info
from .sharding.sync_batch_norm import replica_sync_batch_norms

_LAYOUT_ATTR = "_piper_layout_key"


def prepare(model: nn.Module, options: Mapping[str, Any] | None = None) -> nn.Module:
    """Lay out `model`'s parameters for the strategy in `options`, in place.

    With ZeRO >= 1 over dp > 1 ranks every parameter becomes its 1/dp rows, a
    new `nn.Parameter` holding a `Shard(0)` DTensor on the dp mesh (build the
    optimizer afterwards, as with FSDP2); 0-d parameters, which have no rows,
    stay whole replicas. With `mesh.ep > 1` every expert parameter
    (`piper_fx.mark_experts`) becomes the block of experts this rank computes,
    a `Shard(0)` DTensor on the ep mesh, replicated over the dp/ep groups (and
    never ZeRO-sharded on top); with ep = 1 experts are ordinary parameters.
    Every other parameter (all of them at ZeRO-0) becomes a `Replicate()`
    DTensor on the dp mesh, sharing the original's storage (the placement DDP's
    replicas have); with dp = 1 (one rank, or a pipeline alone) nothing
    replicates them and they stay plain tensors, as in a stage module of
    torch.distributed.pipelining.
    Parameters keep their names: `state_dict()` keys do not change, except that
    under a pipeline, once compiling has released the parameters of stages this
    rank does not run, its state dict leaves them out (as a stage module of
    torch.distributed.pipelining holds only its own).
    With mixed precision (`mixed_precision.param_dtype`), Dynamo traces the model with
    its floating parameters in `param_dtype`, as FSDP2's `fully_shard(mp_policy=...)`
    runs it (`read_through.trace_in_dtype`); the parameters stay in their dtype.
    Calling it again with the same layout is a no-op. With dp > 1 it first gives every replica the first replica's
    parameters and buffers, as DDP does, so it is collective: every rank must call it.
    A model built on the meta device is laid out there, as under FSDP2: `model.to_empty(device=...)`
    then gives each parameter its memory in place (`dtensor_params.materialize`), and the backend
    starts the replicas alike when it first compiles the model.
    """
    strategy = parse_options_on_all_ranks(options)
    _check_recurrent_layers_traced(model)
    applied = prepared_layout(model)
    if applied is not None:
        if applied != strategy.layout_key():
            raise PiperConfigError(
                "options", dict(options or {}),
                f"the model was already prepared for a different layout {applied}; "
                "build a fresh model to change mesh or ZeRO sharding")
        return model
    group_name = dp_group_name(strategy)
    experts = expert_parameters(model) if strategy.ep > 1 else {}
    if strategy.ep > 1:
        _check_experts(experts, strategy.ep)
    broadcast_from_first_replica([*model.parameters(), *model.buffers()], group_name)
    replica_sync_batch_norms(model, resolve_process_group(group_name) if strategy.dp > 1 else None)
    if strategy.shards_parameters:
        # Experts shared out over ep are replicated over the dp/ep groups, never ZeRO-sharded on top;
        # with ep = 1 they are parameters like any other, sharded and reduced by ZeRO.
        shard_parameters(model, strategy_mesh(strategy, "dp"), keep=lambda p: strategy.ep > 1 and is_expert_parameter(p))
    if experts:
        shard_experts(model, strategy_mesh(strategy, "ep"))
    if strategy.dp > 1:
        replicate_parameters(model, strategy_mesh(strategy, "dp"))
    if any(sharded_parameter_info(p) is not None for p in model.parameters()):
        gathers_in_eager_forward(model)  # and every module holding a sharded parameter (`read_through`)
    if any(p.is_meta for p in model.parameters()):
        laid_out_on_meta(model)
    if strategy.mixed_precision.param_dtype is not None:
        trace_in_dtype(model, strategy.mixed_precision.param_dtype)
    record_holdings(model, strategy)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        step_fused_optimizers_on_local_tensors()
    if strategy.pp > 1:  # compiling releases the parameters of other ranks' stages
        hide_released_parameters(model)
    if strategy.microbatches > 1:
        model.register_forward_pre_hook(_mark_batch_dimension_dynamic, with_kwargs=True)
    setattr(model, _LAYOUT_ATTR, strategy.layout_key())
    return model


def record_holdings(model: nn.Module, strategy: Strategy) -> None:
    """Record how this rank holds each parameter of `model` (laid out for `strategy`):
    ZeRO shards over dp, blocks of experts over ep (copies of them over the
    other ep groups), everything else whole, a replica over dp."""
    for held in held_parameters(model):
        info = sharded_parameter_info(held.parameter)
        if info is not None and info.mesh_dim == "ep":
            holding = Holding(info.layout.full_shape, info.group_name, expert_replica_group_name(strategy))
        elif info is not None:
            holding = Holding(info.layout.full_shape, info.group_name)
        else:
            holding = Holding(tuple(held.parameter.shape), replica_group=dp_group_name(strategy))
        record_holding(held.parameter, holding)


def _check_recurrent_layers_traced(model: nn.Module) -> None:
    """`nn.RNN`, `nn.LSTM` and `nn.GRU` are traced by Dynamo only with its `allow_rnn`: without
    it, Dynamo breaks the graph around them, and on one rank or in a pipeline alone (dp = 1) runs
    the whole forward eagerly, so that piper_fx never sees the model, and a pipeline runs all of
    it on every rank, silently."""
    recurrent = [f"{name} ({type(module).__name__})" for name, module in model.named_modules()
                 if isinstance(module, nn.RNNBase)]
    if recurrent and not dynamo_config.allow_rnn:
        raise PiperError(
            f"the model's recurrent layers {', '.join(recurrent)} are traced by Dynamo only with "
            "torch._dynamo.config.allow_rnn = True; without it Dynamo runs them, and on one rank or in "
            "a pipeline alone the whole forward, eagerly, outside piper_fx's step (no pipeline, no "
            "data parallelism): set it before compiling")


def _check_experts(experts: dict[str, nn.Parameter], ep: int) -> None:
    if not experts:
        raise PiperConfigError("mesh.ep", ep, "1, or a model with expert parameters to share out: mark the "
                                              "experts' module with piper_fx.mark_experts(module)")
    for name, p in experts.items():
        if p.dim() == 0 or p.shape[0] % ep:
            raise PiperConfigError("mesh.ep", ep, f"a divisor of the number of experts: {name} has shape "
                                                  f"{tuple(p.shape)}, whose dim 0 (the experts) must split over ep")


@torch.compiler.disable
def _mark_batch_dimension_dynamic(module: nn.Module, args: tuple, kwargs: dict) -> None:
    """Runs outside Dynamo before each call: batch sizes reach the backend as
    SymInts, so it can trace the model at microbatch size (see capture)."""
    for arg in (*args, *kwargs.values()):
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            maybe_mark_dynamic(arg, 0)


def prepared_layout(model: nn.Module) -> tuple | None:
    return getattr(model, _LAYOUT_ATTR, None)


def check_prepared(strategy: Strategy, example_inputs: list, traced: list) -> None:
    """Raise if the parameters the backend sees (`example_inputs`, where Dynamo `traced` their
    program placeholders) do not match `strategy`'s layout, or were traced in another dtype
    than its mixed precision's `param_dtype`."""
    _check_traced_dtypes(strategy.mixed_precision.param_dtype, example_inputs, traced)
    params = [t for t in example_inputs if isinstance(t, nn.Parameter)]
    infos = [sharded_parameter_info(p) for p in params]
    zero_shards = sum(info is not None and info.mesh_dim == "dp" for info in infos)
    expert_shards = sum(info is not None and info.mesh_dim == "ep" for info in infos)
    plain = [p for p, info in zip(params, infos) if info is None]
    if strategy.shards_parameters and any(p.dim() > 0 and not (strategy.ep > 1 and is_expert_parameter(p))
                                          for p in plain):
        raise PiperConfigError(
            "zero", strategy.zero,
            f"ZeRO-{strategy.zero} over dp={strategy.dp} needs sharded parameters: call "
            "piper_fx.prepare(model, options) with the same options before building the "
            "optimizer and compiling")
    if not strategy.shards_parameters and zero_shards:
        raise PiperConfigError(
            "zero", strategy.zero,
            "the model was prepared with sharded parameters (ZeRO >= 1), but these options "
            "do not shard; compile with the options given to prepare")
    if strategy.ep > 1 and any(is_expert_parameter(p) for p in plain):
        raise PiperConfigError(
            "mesh.ep", strategy.ep,
            "prepared experts: call piper_fx.prepare(model, options) with the same options before "
            "building the optimizer and compiling, so each rank holds its block of experts")
    if strategy.ep == 1 and expert_shards:
        raise PiperConfigError(
            "mesh.ep", strategy.ep,
            "the model's experts were sharded by prepare with another mesh.ep; compile with the options "
            "given to prepare")


def _check_traced_dtypes(param_dtype: torch.dtype | None, example_inputs: list, traced: list) -> None:
    """Raise if the model was prepared to be traced in a `param_dtype` (its parameters' program
    placeholders in that dtype, `trace_in_dtype`) other than the options', or not prepared for
    the options' one. A parameter registered after `prepare` is traced as it is, cast where
    the program reads it."""
    pairs = [(t, p) for t, p in zip(traced, example_inputs)
             if isinstance(p, nn.Parameter) and p.is_floating_point()]
    in_other_dtype = {t.dtype for t, p in pairs if t is not p and t.dtype != p.dtype}
    if in_other_dtype and in_other_dtype != {param_dtype}:
        raise PiperConfigError(
            "mixed_precision.param_dtype", param_dtype,
            f"{', '.join(map(str, in_other_dtype))}, the param_dtype the model was prepared with: compile with "
            "the options given to prepare")
    if param_dtype is not None and not in_other_dtype and any(p.dtype != param_dtype for _, p in pairs):
        raise PiperConfigError(
            "mixed_precision.param_dtype", param_dtype,
            "a param_dtype the model was prepared with: mixed precision traces the model with its parameters "
            "in param_dtype, as FSDP2 runs it; call piper_fx.prepare(model, options) with these options "
            "before compiling")
