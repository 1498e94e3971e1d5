"""What compiling a step records of the model's parameters and buffers on this rank, and
frees: each one's `Holding` (a replica over dp, the pipeline ranks whose stages read a
parameter or update a buffer), and under a pipeline the storage of those this rank's stages
neither read nor update. Also the readers an earlier compile recorded, which a later one keeps."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import PiperError
from .ir import HELD_ROLES, InputRole
from .options import Strategy
from .sharding.dtensor_params import stood_for
from .sharding.holdings import Holding, has_holding, holding_of, is_stored, record_holding, \
    record_pipeline_readers, release
from .sharding.mesh import pp_group_name

if TYPE_CHECKING:
    from .plan_cache import Plan


def pipeline_readers(example_inputs: list, strategy: Strategy) -> dict[int, tuple[int, ...]]:
    """Under a pipeline, by argument index, the pipeline ranks whose stages read each parameter
    an earlier compile of the model planned (`record_compiled_holdings`): a later one (another
    batch shape, a recompile) must read it there too, for the other ranks let go of it."""
    if strategy.pp == 1:
        return {}
    arguments = [stood_for(t) for t in example_inputs]
    return {index: holding_of(t).readers for index, t in enumerate(arguments)
            if isinstance(t, torch.Tensor) and has_holding(t) and holding_of(t).readers}


def record_compiled_holdings(planned: Plan, example_inputs: list, strategy: Strategy) -> None:
    """Complete each parameter's `Holding`: a replica over dp if `prepare` did not lay
    it out, and under a pipeline, the pipeline ranks whose stages read it (the first
    trains it), and likewise the one whose stage updates each buffer the forward mutates
    (a replica's own: each updates it from its rows). Raises a `PiperError` if a stage of
    this rank reads a parameter (or updates a buffer) whose storage an earlier compile let
    go of (no split keeping its readers was found)."""
    for graph_input in planned.inputs:
        holders = planned.parameter_holders.get(graph_input.name)
        if graph_input.role in (InputRole.PARAM, InputRole.PARAM_SHARD):
            tensor = example_inputs[graph_input.arg_index]
            if not has_holding(tensor):
                record_holding(tensor, Holding(tuple(tensor.shape), replica_group=planned.dp_group))
            what = "reads the parameter"
        elif graph_input.role is InputRole.BUFFER and holders:
            tensor = example_inputs[graph_input.arg_index]
            if not has_holding(tensor):
                record_holding(tensor, Holding(tuple(tensor.shape)))
            what = "updates the buffer"
        else:
            continue
        if strategy.pp == 1 or not holders:
            continue
        if strategy.pp_index in holders and not is_stored(tensor):
            raise PiperError(f"a stage of pipeline rank {strategy.pp_index} {what} {graph_input.fqn}, whose "
                             "storage an earlier compile of the model let go of on this rank (it ran no stage "
                             "reading it then)")
        record_pipeline_readers(tensor, holders, pp_group_name(strategy))  # they end the step equal


def release_other_stages(planned: Plan, example_inputs: list, strategy: Strategy) -> None:
    """Under a pipeline, free the storage of every parameter no stage of this rank reads, and
    of every buffer another rank's stage updates: a rank holds the parameters and buffers of
    the stages it runs, not the whole model's."""
    if strategy.pp == 1:
        return
    for graph_input in planned.inputs:
        holders = planned.parameter_holders.get(graph_input.name)
        if graph_input.role in HELD_ROLES and holders and strategy.pp_index not in holders:
            release(example_inputs[graph_input.arg_index])
