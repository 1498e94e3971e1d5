"""A pipeline schedule as data: per-rank lists of actions, and its checks.

A schedule places `num_stages` stages on `num_ranks` pipeline ranks and lists,
for each rank, the compute actions it runs in order. The one happens-before
rule every schedule obeys:

    F(s, m) needs F(s-1, m)        B(s, m) needs F(s, m) and B(s+1, m)

(for the last stage, B needs only its own F). `validate` checks that every
(stage, microbatch) has exactly one F and one B on the rank that holds the
stage, and simulates the ranks running their lists with non-blocking sends and
blocking receives, which proves the schedule cannot deadlock or names the
first action that can never run.
"""
from __future__ import annotations

from dataclasses import dataclass, field


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the first bad action."""


@dataclass(frozen=True, order=True)
class Action:
    stage: int
    kind: str          # "F" (forward) or "B" (backward)
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


def dependencies(action: Action, num_stages: int) -> list[Action]:
    """The actions whose results `action` reads."""
    s, m = action.stage, action.microbatch
    if action.kind == "F":
        return [Action(s - 1, "F", m)] if s > 0 else []
    deps = [Action(s, "F", m)]
    if s < num_stages - 1:
        deps.append(Action(s + 1, "B", m))
    return deps


def _check_coverage(schedule: Schedule) -> None:
    seen: dict[Action, tuple[int, int]] = {}
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            where = f"rank {rank} action {index} {action}"
            if action.kind not in ("F", "B"):
                raise ScheduleError(f"{where}: unknown kind {action.kind!r} (valid: F, B)")
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
            for kind in ("F", "B"):
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
    done: set[Action] = set()
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
                    waits = [str(d) for d in dependencies(action, schedule.num_stages) if d not in done]
                    blocked.append(f"rank {rank} action {position[rank]} {action} waits for {', '.join(waits)}")
            raise ScheduleError("the schedule deadlocks: " + "; ".join(blocked))
        for rank, action in ready:
            order.append((step, rank, action))
            done.add(action)
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
