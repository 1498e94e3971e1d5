"""A pipeline schedule as data: per-rank lists of actions, and its checks.

A schedule places `num_stages` stages on `num_ranks` pipeline ranks (in any
shape: in order, looped, or a V) and lists, for each rank, the compute actions
it runs in order. Kinds: F (forward), B (whole backward), or the backward
split for zero-bubble schedules into I (input gradient, which the previous
stage waits for) and W (weight gradient, which nothing waits for). The one
happens-before rule every schedule obeys:

    F(s, m) needs F(s-1, m)
    B(s, m) and I(s, m) need F(s, m) and the input gradient of (s+1, m)
    W(s, m) needs I(s, m)

where "the input gradient of (s, m)" is B(s, m) or I(s, m). `validate` checks
that every (stage, microbatch) has one F and either one B or one I and one W,
on the rank that holds the stage, and simulates the ranks running their lists
with non-blocking sends and blocking receives, which proves the schedule
cannot deadlock or names the first action that can never run.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the first bad action."""


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str          # "F", "B", "I" (input gradient) or "W" (weight gradient)
    microbatch: int

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"


@dataclass
class Schedule:
    name: str
    num_ranks: int
    num_microbatches: int
    stage_to_rank: tuple[int, ...]
    actions: list[list[Action]] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]


KINDS = ("F", "B", "I", "W")


def dependencies(action: Action, num_stages: int) -> list[tuple[str, int, int]]:
    """What `action` waits for, as events (kind, stage, microbatch); the event
    ("dX", s, m) is the input gradient of (s, m), made by B or I."""
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return [("F", s - 1, m)] if s > 0 else []
    if action.kind == "W":
        return [("I", s, m)]
    deps = [("F", s, m)]
    if s < num_stages - 1:
        deps.append(("dX", s + 1, m))
    return deps


def events(action: Action) -> list[tuple[str, int, int]]:
    """The events an action completes."""
    done = [(action.kind, action.stage, action.microbatch)]
    if action.kind in ("B", "I"):
        done.append(("dX", action.stage, action.microbatch))
    return done


def _event_str(event: tuple[str, int, int]) -> str:
    kind, stage, microbatch = event
    return f"{'B/I' if kind == 'dX' else kind}{stage}.{microbatch}"


def _check_coverage(schedule: Schedule) -> None:
    seen: dict[Action, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            where = f"rank {rank} action {index} {action}"
            if action.kind not in KINDS:
                raise ScheduleError(f"{where}: unknown kind {action.kind!r} (valid: {', '.join(KINDS)})")
            if not 0 <= action.stage < schedule.num_stages:
                raise ScheduleError(f"{where}: stage {action.stage} is not in 0..{schedule.num_stages - 1}")
            if not 0 <= action.microbatch < schedule.num_microbatches:
                raise ScheduleError(
                    f"{where}: microbatch {action.microbatch} is not in 0..{schedule.num_microbatches - 1}")
            if schedule.stage_to_rank[action.stage] != rank:
                raise ScheduleError(
                    f"{where}: stage {action.stage} is placed on rank {schedule.stage_to_rank[action.stage]}")
            if action in seen:
                raise ScheduleError(f"{where}: {action} already runs as rank {seen[action][0]} action {seen[action][1]}")
            seen[action] = (rank, index)
    for stage in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            split = Action(stage, "I", m) in seen or Action(stage, "W", m) in seen
            if split and Action(stage, "B", m) in seen:
                raise ScheduleError(f"{Action(stage, 'B', m)} and a split backward (I/W) of the same "
                                    f"microbatch both run (rank {seen[Action(stage, 'B', m)][0]})")
            for kind in ("F", "I", "W") if split else ("F", "B"):
                if Action(stage, kind, m) not in seen:
                    raise ScheduleError(
                        f"{Action(stage, kind, m)} (stage {stage}, microbatch {m}) is missing: "
                        f"rank {schedule.stage_to_rank[stage]} never runs it")


def run_order(schedule: Schedule) -> list[tuple[int, int, Action]]:
    """Simulate the ranks: (time step, rank, action) in an order that respects every dependency.

    Each step, every rank whose next action has its inputs runs it (unit time);
    sends never block. Raises `ScheduleError` if some ranks can never proceed.
    """
    position = [0] * schedule.num_ranks
    done: set[tuple[str, int, int]] = set()
    order: list[tuple[int, int, Action]] = []
    step = 0
    remaining = sum(len(a) for a in schedule.actions)
    while remaining:
        ready = []
        for rank, actions in enumerate(schedule.actions):
            if position[rank] < len(actions):
                action = actions[position[rank]]
                if all(d in done for d in dependencies(action, schedule.num_stages)):
                    ready.append((rank, action))
        if not ready:
            blocked = []
            for rank, actions in enumerate(schedule.actions):
                if position[rank] < len(actions):
                    action = actions[position[rank]]
                    waits = [_event_str(d) for d in dependencies(action, schedule.num_stages) if d not in done]
                    blocked.append(f"rank {rank} action {position[rank]} {action} waits for {', '.join(waits)}")
            raise ScheduleError("the schedule deadlocks: " + "; ".join(blocked))
        for rank, action in ready:
            order.append((step, rank, action))
            done.update(events(action))
            position[rank] += 1
            remaining -= 1
        step += 1
    return order


def validate(schedule: Schedule) -> Schedule:
    """Check coverage, placement and freedom from deadlock; returns the schedule."""
    if len(schedule.actions) != schedule.num_ranks:
        raise ScheduleError(f"the schedule lists actions for {len(schedule.actions)} ranks, "
                            f"not {schedule.num_ranks}")
    _check_coverage(schedule)
    run_order(schedule)
    return schedule
