"""Piper-style directives: a pipeline schedule written as data in the options.

    options["directives"] = [
        {"split": {"microbatches": 4}},
        {"place": {"stage": 0, "rank": 0}},
        {"place": {"stage": 1, "rank": 1}},
        {"order": {"rank": 0, "actions": ["F0.0", "F0.1", "F0.2", "F0.3", "B0.0", "B0.1", "B0.2", "B0.3"]}},
        {"order": {"rank": 1, "actions": ["F1.0", "B1.0", "F1.1", "B1.1", "F1.2", "B1.2", "F1.3", "B1.3"]}},
    ]

`split` sets the microbatches, `place` puts a stage on a pipeline rank, `order`
lists a rank's actions (`<kind><stage>.<microbatch>`, kinds F, B, I, W; an
overlapped F&B pair as `F<s>.<m>&B<s>.<m>`: `schedules.Action.from_str` and
`schedules.step_from_str` read them). The
result is a `schedules.Schedule`, validated like every preset. Piper's
`replicate` and `shard` directives map to `options["zero"]` and mesh
dimensions here and are refused in this list with a message saying so.
"""
from __future__ import annotations

from typing import Any, Sequence

from .schedules import Action, Schedule, ScheduleError, step_from_str


def schedule_from_directives(directives: Sequence[Any], pp: int) -> Schedule:
    if not isinstance(directives, (list, tuple)):
        raise ValueError("directives must be a list of {'split'|'place'|'order': {...}} dicts")
    microbatches = None
    placement: dict[int, int] = {}
    orders: dict[int, list[Action]] = {}
    pairs: dict[int, set[int]] = {}
    for index, directive in enumerate(directives):
        if not isinstance(directive, dict) or len(directive) != 1:
            raise ValueError(f"directive {index} ({directive!r}) must be a dict with exactly one key")
        (verb, body), = directive.items()
        where = f"directive {index} ({verb})"
        if verb == "split":
            microbatches = body["microbatches"]
        elif verb == "place":
            placement[body["stage"]] = body["rank"]
        elif verb == "order":
            orders[body["rank"]], pairs[body["rank"]] = _order(where, body["actions"])
        elif verb in ("replicate", "shard"):
            raise ValueError(f"{where}: use options['zero'] and options['mesh'] for data-parallel "
                             "replication and sharding; directives here describe the pipeline")
        else:
            raise ValueError(f"{where}: unknown directive; valid are split, place, order")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"a 'split' directive with a positive number of microbatches is required, got {microbatches!r}")
    stages = sorted(placement)
    if stages != list(range(len(stages))) or not stages:
        raise ValueError(f"'place' directives must place stages 0..S-1, got stages {stages}")
    return Schedule("directives", pp, microbatches, tuple(placement[s] for s in stages),
                    [orders.get(rank, []) for rank in range(pp)], pairs=[pairs.get(rank, set()) for rank in range(pp)])


def _order(where: str, steps: Sequence[Any]) -> tuple[list[Action], set[int]]:
    """A rank's actions and the positions of its overlapped pairs, from its steps' text."""
    row: list[Action] = []
    paired: set[int] = set()
    for text in steps:
        try:
            step = step_from_str(text)
        except ScheduleError as e:
            raise ValueError(f"{where}: {e}") from None
        if len(step) == 2:
            paired.add(len(row))
        row += step
    return row, paired
