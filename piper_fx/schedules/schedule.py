"""A pipeline schedule as data: per-rank lists of actions, and its checks.

A schedule places `num_stages` stages on `num_ranks` pipeline ranks (in any
shape: in order, looped, or a V) and lists, for each rank, the compute actions
it runs in order. With `copies=2` (bidirectional DualPipe) the stages are two
copies of the model's stages, `copy * stages_per_copy + s`, each a chain of
its own fed from its own end, and microbatch m goes through copy
`m * copies // num_microbatches` (the first half through copy 0). Two
adjacent actions of a rank can be marked as an overlapped pair (`pairs`): a
forward and a backward of unrelated microbatches that start together, so one's
communication overlaps the other's compute (DualPipe's F&B). Kinds: F (forward), B (whole backward), or the backward
split for zero-bubble schedules into I (input gradient, which the previous
stage waits for) and W (weight gradient, which nothing waits for). The one
happens-before rule every schedule obeys:

    F(s, m) needs F(s-1, m)
    B(s, m) and I(s, m) need F(s, m) and the input gradient of (s+1, m)
    W(s, m) needs I(s, m)

where "the input gradient of (s, m)" is B(s, m) or I(s, m), and a copy's
first stage has no s-1, its last no s+1. `validate` checks
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
    copies: int = 1
    # Per rank, the positions i where actions i and i+1 run as one overlapped F&B pair.
    pairs: list[set[int]] = field(default_factory=list)

    @property
    def num_stages(self) -> int:
        return len(self.stage_to_rank)

    @property
    def stages_per_copy(self) -> int:
        """The model's stages; `num_stages` counts each copy's."""
        return self.num_stages // self.copies

    def model_stage(self, stage: int) -> int:
        return stage % self.stages_per_copy

    def copy_of(self, microbatch: int) -> int:
        return microbatch * self.copies // self.num_microbatches

    def stage_rank(self, model_stage: int, microbatch: int) -> int:
        """The rank that runs `model_stage` for `microbatch` (through its copy)."""
        return self.stage_to_rank[self.copy_of(microbatch) * self.stages_per_copy + model_stage]

    def stages_of(self, rank: int) -> list[int]:
        return [s for s, r in enumerate(self.stage_to_rank) if r == rank]

    def steps(self, rank: int) -> list[list[Action]]:
        """The rank's actions grouped into what starts together: single actions and overlapped pairs."""
        row, grouped, index = self.actions[rank], [], 0
        paired = self.pairs[rank] if rank < len(self.pairs) else set()
        while index < len(row):
            width = 2 if index in paired else 1
            grouped.append(row[index:index + width])
            index += width
        return grouped


KINDS = ("F", "B", "I", "W")


def dependencies(action: Action, schedule: Schedule) -> list[tuple[str, int, int]]:
    """What `action` waits for, as events (kind, stage, microbatch); the event
    ("dX", s, m) is the input gradient of (s, m), made by B or I."""
    s, m, per_copy = action.stage, action.microbatch, schedule.stages_per_copy
    if action.kind == "F":
        return [("F", s - 1, m)] if s % per_copy else []
    if action.kind == "W":
        return [("I", s, m)]
    deps = [("F", s, m)]
    if (s + 1) % per_copy:
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
    per_copy = schedule.stages_per_copy
    if schedule.copies < 1 or schedule.num_stages % schedule.copies:
        raise ScheduleError(f"{schedule.num_stages} stages do not split into {schedule.copies} copies")
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
            if schedule.copy_of(action.microbatch) != action.stage // per_copy:
                raise ScheduleError(f"{where}: microbatch {action.microbatch} goes through copy "
                                    f"{schedule.copy_of(action.microbatch)}, stage {action.stage} is in copy "
                                    f"{action.stage // per_copy}")
            if action in seen:
                raise ScheduleError(f"{where}: {action} already runs as rank {seen[action][0]} action {seen[action][1]}")
            seen[action] = (rank, index)
    for stage in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            if schedule.copy_of(m) != stage // per_copy:
                continue
            split = Action(stage, "I", m) in seen or Action(stage, "W", m) in seen
            if split and Action(stage, "B", m) in seen:
                raise ScheduleError(f"{Action(stage, 'B', m)} and a split backward (I/W) of the same "
                                    f"microbatch both run (rank {seen[Action(stage, 'B', m)][0]})")
            for kind in ("F", "I", "W") if split else ("F", "B"):
                if Action(stage, kind, m) not in seen:
                    raise ScheduleError(
                        f"{Action(stage, kind, m)} (stage {stage}, microbatch {m}) is missing: "
                        f"rank {schedule.stage_to_rank[stage]} never runs it")


def _check_pairs(schedule: Schedule) -> None:
    """An overlapped pair is a forward and a backward (B) of which neither waits for the other."""
    for rank, paired in enumerate(schedule.pairs):
        row = schedule.actions[rank] if rank < len(schedule.actions) else []
        for index in sorted(paired):
            if not 0 <= index < len(row) - 1 or index + 1 in paired:
                raise ScheduleError(f"rank {rank}: pair at action {index} is not two adjacent actions of its own")
            first, second = row[index], row[index + 1]
            where = f"rank {rank} actions {index}-{index + 1} ({first}&{second})"
            if sorted((first.kind, second.kind)) != ["B", "F"]:
                raise ScheduleError(f"{where}: an overlapped pair is one F and one B")
            for a, b in ((first, second), (second, first)):
                if set(events(a)) & set(dependencies(b, schedule)):
                    raise ScheduleError(f"{where}: {b} waits for {a}, so they cannot run overlapped")


def run_order(schedule: Schedule) -> list[tuple[int, int, Action]]:
    """Simulate the ranks: (time step, rank, action) in an order that respects every dependency.

    Each step, every rank whose next action (or overlapped pair) has its inputs
    runs it (unit time); sends never block. Raises `ScheduleError` if some
    ranks can never proceed.
    """
    steps = [schedule.steps(rank) for rank in range(schedule.num_ranks)]
    position = [0] * schedule.num_ranks
    done: set[tuple[str, int, int]] = set()
    order: list[tuple[int, int, Action]] = []
    time = 0
    remaining = sum(len(s) for s in steps)
    while remaining:
        ready = []
        for rank, rank_steps in enumerate(steps):
            if position[rank] < len(rank_steps):
                group = rank_steps[position[rank]]
                if all(d in done for action in group for d in dependencies(action, schedule)):
                    ready.append((rank, group))
        if not ready:
            blocked = []
            for rank, rank_steps in enumerate(steps):
                if position[rank] < len(rank_steps):
                    index = sum(len(g) for g in rank_steps[:position[rank]])
                    for action in rank_steps[position[rank]]:
                        waits = [_event_str(d) for d in dependencies(action, schedule) if d not in done]
                        if waits:
                            blocked.append(f"rank {rank} action {index} {action} waits for {', '.join(waits)}")
                        index += 1
            raise ScheduleError("the schedule deadlocks: " + "; ".join(blocked))
        for rank, group in ready:
            for action in group:
                order.append((time, rank, action))
                done.update(events(action))
            position[rank] += 1
            remaining -= 1
        time += 1
    return order


def validate(schedule: Schedule) -> Schedule:
    """Check coverage, placement, overlapped pairs and freedom from deadlock; returns the schedule."""
    if len(schedule.actions) != schedule.num_ranks:
        raise ScheduleError(f"the schedule lists actions for {len(schedule.actions)} ranks, "
                            f"not {schedule.num_ranks}")
    _check_coverage(schedule)
    _check_pairs(schedule)
    run_order(schedule)
    return schedule
