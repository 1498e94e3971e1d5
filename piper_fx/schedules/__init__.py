"""Pipeline schedules: data (per-rank action lists), preset builders, checks, pictures.

    schedule = piper_fx.schedules.build("1f1b", ranks=4, microbatches=8)
    piper_fx.schedules.validate(schedule)       # raises ScheduleError naming the first bad action
    print(piper_fx.schedules.text_grid(schedule))
"""
from .presets import (PRESETS, SPLIT_BACKWARD, V_SHAPED, gpipe, greedy_zero_bubble, interleaved_1f1b,
                      min_microbatches, one_f_one_b, v_placement, zb1p, zbv)
from .render import svg, text_grid
from .schedule import Action, Schedule, ScheduleError, dependencies, run_order, validate
from .simulate import Costs, Simulation, simulate
from .torch_format import from_torch_csv, from_torch_rows, to_torch_csv, to_torch_rows


def build(name: str, ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """A validated preset schedule."""
    return validate(PRESETS[name](ranks, microbatches, stages_per_rank))


__all__ = ["Action", "Costs", "PRESETS", "SPLIT_BACKWARD", "V_SHAPED", "greedy_zero_bubble", "v_placement", "zbv", "Schedule", "ScheduleError", "Simulation", "build",
           "dependencies", "from_torch_csv", "from_torch_rows", "gpipe", "interleaved_1f1b", "min_microbatches",
           "one_f_one_b", "run_order", "simulate", "svg", "text_grid", "to_torch_csv", "to_torch_rows", "validate",
           "zb1p"]
