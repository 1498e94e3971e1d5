"""Pipeline schedules: data (per-rank action lists), preset builders, checks, pictures.

    schedule = piper_fx.schedules.build("1f1b", ranks=4, microbatches=8)
    piper_fx.schedules.validate(schedule)       # raises ScheduleError naming the first bad action
    print(piper_fx.schedules.text_grid(schedule))
"""
from .presets import (PRESETS, SPLIT_BACKWARD, V_SHAPED, Preset, Rule, ShapeError, gpipe, greedy_zero_bubble,
                      interleaved_1f1b, min_microbatches, one_f_one_b, v_placement, zb1p, zbv)
from .render import svg, text_grid
from .schedule import (COMPUTE_KINDS, PAIR_SEPARATOR, Action, ActionKind, Schedule, ScheduleError, dependencies,
                       run_order, step_from_str, step_kind, step_str, validate)
from .simulate import Costs, Simulation, simulate
from .torch_format import from_torch_csv, from_torch_rows, to_torch_csv, to_torch_rows


def build(name: str, ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """A validated preset schedule."""
    return validate(PRESETS[name](ranks, microbatches, stages_per_rank))


__all__ = ["COMPUTE_KINDS", "PAIR_SEPARATOR", "PRESETS", "SPLIT_BACKWARD", "V_SHAPED", "Action", "ActionKind", "Costs",
           "Preset", "Rule", "Schedule", "ScheduleError", "ShapeError", "Simulation", "build", "dependencies",
           "from_torch_csv", "from_torch_rows", "gpipe", "greedy_zero_bubble", "interleaved_1f1b", "min_microbatches",
           "one_f_one_b", "run_order", "simulate", "step_from_str", "step_kind", "step_str", "svg", "text_grid",
           "to_torch_csv", "to_torch_rows", "v_placement", "validate", "zb1p", "zbv"]
