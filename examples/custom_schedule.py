"""Write your own pipeline schedule, check it, compare it, and train with it.

    python examples/custom_schedule.py                      # prints the schedules and writes the strategy
    python examples/train_gpt.py --nproc 2 --strategy examples/strategies/pp2_custom.json

A schedule is data: per pipeline rank, the actions it runs in order. This one
is 1F1B whose backwards are split into input gradients (I), sent on at once,
and weight gradients (W), deferred to the end of each rank's list, where 1F1B
leaves the earlier ranks idle (a hand-written relative of ZB-H1): less
bubble, at the cost of holding every microbatch's activations until its W,
which the simulation's peak live microbatches shows. The script
validates it (a bad schedule raises `ScheduleError` naming the action),
simulates it against the 1F1B preset with per-action costs, prints both as
text grids, and writes it as Piper-style directives into a strategy file that
`train_gpt.py` accepts, so the same schedule trains the example GPT.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from piper_fx import schedules  # noqa: E402
from piper_fx.schedules import Action, Costs, Schedule  # noqa: E402

RANKS, MICROBATCHES = 2, 4
COSTS = Costs(F=1.0, B=2.0, I=1.0, W=1.0)  # a backward costs two forwards: half input, half weight gradient


def one_f_one_b_deferred_weights(ranks: int, microbatches: int) -> Schedule:
    """1F1B order with each B split into I (at B's place) and W (all at the end of the rank's list)."""
    rows = []
    for rank in range(ranks):
        warmup = min(ranks - 1 - rank, microbatches)
        row = [Action(rank, "F", m) for m in range(warmup)]
        for m in range(microbatches):
            if warmup + m < microbatches:
                row.append(Action(rank, "F", warmup + m))
            row.append(Action(rank, "I", m))
        row += [Action(rank, "W", m) for m in range(microbatches)]
        rows.append(row)
    return Schedule("1f1b_deferred_w", ranks, microbatches, tuple(range(ranks)), rows)


def as_directives(schedule: Schedule) -> list[dict]:
    """The schedule as `options["directives"]`: split, place and order."""
    directives: list[dict] = [{"split": {"microbatches": schedule.num_microbatches}}]
    directives += [{"place": {"stage": s, "rank": r}} for s, r in enumerate(schedule.stage_to_rank)]
    directives += [{"order": {"rank": r, "actions": [str(a) for a in row]}} for r, row in enumerate(schedule.actions)]
    return directives


def main() -> None:
    custom = schedules.validate(one_f_one_b_deferred_weights(RANKS, MICROBATCHES))
    preset = schedules.build("1f1b", ranks=RANKS, microbatches=MICROBATCHES)
    for schedule in (preset, custom):
        simulated = schedules.simulate(schedule, COSTS)
        print(schedules.text_grid(schedule), end="")
        print(f"simulated with {COSTS}: makespan {simulated.makespan:.1f}, bubble per rank "
              f"{[round(b, 1) for b in simulated.bubbles]}, peak live microbatches {simulated.peak_activations}\n")
    strategy = {"mesh": {"pp": RANKS}, "directives": as_directives(custom)}
    path = ROOT / "examples" / "strategies" / "pp2_custom.json"
    path.write_text(json.dumps(strategy, indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}; train with it:\n"
          f"  python examples/train_gpt.py --nproc {RANKS} --strategy {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
