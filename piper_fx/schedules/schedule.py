"""A pipeline schedule as data: per-rank lists of actions, and its checks.

A schedule places `num_stages` stages on `num_ranks` pipeline ranks (in any
shape: in order, looped, or a V) and lists, for each rank, the compute actions
it runs in order. With `copies=2` (bidirectional DualPipe) the stages are two
copies of the model's stages, `copy * stages_per_copy + s`, each a chain of
its own fed from its own end, and microbatch m goes through copy
`m * copies // num_microbatches` (the first half through copy 0). Two
adjacent actions of a rank can be marked as an overlapped pair (`pairs`): a
forward and a backward of unrelated microbatches that start together, so one's
communication overlaps the other's compute (DualPipe's F&B).

Kinds (`ActionKind`, the one vocabulary of presets, directives, the
simulator, the pictures, torch's format and the rank programs): F (forward),
B (whole backward), or the backward split for zero-bubble schedules into I
(input gradient, which the previous stage waits for) and W (weight gradient,
which nothing waits for); OVERLAP_F_B is the kind of an overlapped pair. An
action reads and prints as `<kind><stage>.<microbatch>` (`F0.1`), a pair as
`F0.1&B3.0`.

The one happens-before rule every schedule obeys:

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

import enum
import re
from dataclasses import dataclass, field


class ScheduleError(ValueError):
    """A schedule that cannot run; the message names the first bad action."""


class ActionKind(str, enum.Enum):
    """What a schedule action computes. The value is the kind's letter in every
    text form of a schedule (`F0.1` here, `0F1` in torch's format); it equals
    the value of the `ir.TaskKind` of the task that runs it."""

    F = "F"  # forward
    B = "B"  # whole backward: input and weight gradients
    I = "I"  # noqa: E741 - input gradient, which the previous stage waits for
    W = "W"  # weight gradient, which nothing waits for
    OVERLAP_F_B = "OVERLAP_F_B"  # an F and a B that start together: a step's kind, never one action's

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def from_str(cls, text: object) -> "ActionKind":
        try:
            return cls(text)
        except ValueError:
            raise ScheduleError(f"unknown action kind {text!r} (valid: {', '.join(map(str, cls))})") from None


COMPUTE_KINDS = (ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W)  # the kinds of a single action
PAIR_SEPARATOR = "&"
_ACTION_TEXT = re.compile(rf"^({'|'.join(COMPUTE_KINDS)})(\d+)\.(\d+)$")


@dataclass(frozen=True, order=True)
class Action:
    """One compute action of a rank: `kind` of `stage` for `microbatch`. The kind
    may be given as its letter; it is held as an `ActionKind`."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        kind = ActionKind.from_str(self.kind)
        if kind not in COMPUTE_KINDS:
            raise ScheduleError(f"{kind} is the kind of a pair of actions, not of one")
        object.__setattr__(self, "kind", kind)

    def __str__(self) -> str:
        return f"{self.kind}{self.stage}.{self.microbatch}"

    @classmethod
    def from_str(cls, text: object) -> "Action":
        """The action `str` prints: `<kind><stage>.<microbatch>`, e.g. `F0.1`."""
        match = _ACTION_TEXT.match(text) if isinstance(text, str) else None
        if match is None:
            kinds = ", ".join(COMPUTE_KINDS[:-1]) + f" or {COMPUTE_KINDS[-1]}"
            raise ScheduleError(f"action {text!r} is not <kind><stage>.<microbatch> with kind {kinds}")
        return cls(int(match[2]), ActionKind(match[1]), int(match[3]))


def step_kind(step: list[Action]) -> ActionKind:
    """The kind of what a rank starts at once: its one action's, or OVERLAP_F_B for a pair."""
    return step[0].kind if len(step) == 1 else ActionKind.OVERLAP_F_B


def step_str(step: list[Action]) -> str:
    """`F0.1`, or `F0.1&B3.0` for an overlapped pair."""
    return PAIR_SEPARATOR.join(map(str, step))


def step_from_str(text: object) -> list[Action]:
    """The actions of a step as `step_str` prints it: one action, or a pair."""
    parts = text.split(PAIR_SEPARATOR) if isinstance(text, str) else [text]
    if len(parts) > 2:
        raise ScheduleError(f"{text!r} pairs more than two actions")
    return [Action.from_str(part) for part in parts]


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


# An event is (kind, stage, microbatch): an action's kind when that action is
# done, or INPUT_GRADIENT when the input gradient of (stage, microbatch) is,
# made by B or by I.
INPUT_GRADIENT = "dX"
Event = tuple[str, int, int]


def dependencies(action: Action, schedule: Schedule) -> list[Event]:
    """What `action` waits for, as events."""
    s, m, per_copy = action.stage, action.microbatch, schedule.stages_per_copy
    if action.kind is ActionKind.F:
        return [(ActionKind.F, s - 1, m)] if s % per_copy else []
    if action.kind is ActionKind.W:
        return [(ActionKind.I, s, m)]
    deps: list[Event] = [(ActionKind.F, s, m)]
    if (s + 1) % per_copy:
        deps.append((INPUT_GRADIENT, s + 1, m))
    return deps


def events(action: Action) -> list[Event]:
    """The events an action completes."""
    done: list[Event] = [(action.kind, action.stage, action.microbatch)]
    if action.kind in (ActionKind.B, ActionKind.I):
        done.append((INPUT_GRADIENT, action.stage, action.microbatch))
    return done


def _event_str(event: Event) -> str:
    kind, stage, microbatch = event
    return f"{f'{ActionKind.B}/{ActionKind.I}' if kind == INPUT_GRADIENT else kind}{stage}.{microbatch}"


def _check_coverage(schedule: Schedule, training: bool) -> None:
    seen: dict[Action, tuple[int, int]] = {}
    per_copy = schedule.stages_per_copy
    if schedule.copies < 1 or schedule.num_stages % schedule.copies:
        raise ScheduleError(f"{schedule.num_stages} stages do not split into {schedule.copies} copies")
    for rank, actions in enumerate(schedule.actions):
        for index, action in enumerate(actions):
            _check_action(schedule, f"rank {rank} action {index} {action}", rank, action)
            if action in seen:
                raise ScheduleError(f"rank {rank} action {index} {action}: {action} already runs as "
                                    f"rank {seen[action][0]} action {seen[action][1]}")
            seen[action] = (rank, index)
    for stage in range(schedule.num_stages):
        for m in range(schedule.num_microbatches):
            if schedule.copy_of(m) == stage // per_copy:
                _check_one_backward(schedule, seen, stage, m, training)


def _check_action(schedule: Schedule, where: str, rank: int, action: Action) -> None:
    """The action's stage and microbatch exist, and it runs on the rank (and copy) holding them."""
    if not 0 <= action.stage < schedule.num_stages:
        raise ScheduleError(f"{where}: stage {action.stage} is not in 0..{schedule.num_stages - 1}")
    if not 0 <= action.microbatch < schedule.num_microbatches:
        raise ScheduleError(f"{where}: microbatch {action.microbatch} is not in 0..{schedule.num_microbatches - 1}")
    if schedule.stage_to_rank[action.stage] != rank:
        raise ScheduleError(f"{where}: stage {action.stage} is placed on rank {schedule.stage_to_rank[action.stage]}")
    copy = action.stage // schedule.stages_per_copy
    if schedule.copy_of(action.microbatch) != copy:
        raise ScheduleError(f"{where}: microbatch {action.microbatch} goes through copy "
                            f"{schedule.copy_of(action.microbatch)}, stage {action.stage} is in copy {copy}")


def _check_one_backward(schedule: Schedule, seen: dict[Action, tuple[int, int]], stage: int, m: int,
                        training: bool) -> None:
    """(stage, m) runs one F and, when `training`, either one B or a split backward (one I and one W)."""
    F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741
    split = Action(stage, I, m) in seen or Action(stage, W, m) in seen
    if split and Action(stage, B, m) in seen:
        raise ScheduleError(f"{Action(stage, B, m)} and a split backward ({I}/{W}) of the same "
                            f"microbatch both run (rank {seen[Action(stage, B, m)][0]})")
    for kind in ((F, I, W) if split else (F, B)) if training else (F,):
        if Action(stage, kind, m) not in seen:
            raise ScheduleError(f"{Action(stage, kind, m)} (stage {stage}, microbatch {m}) is missing: "
                                f"rank {schedule.stage_to_rank[stage]} never runs it")


def _check_pairs(schedule: Schedule) -> None:
    """An overlapped pair is a forward and a backward (B) of which neither waits for the other."""
    for rank, paired in enumerate(schedule.pairs):
        row = schedule.actions[rank] if rank < len(schedule.actions) else []
        for index in sorted(paired):
            if not 0 <= index < len(row) - 1 or index + 1 in paired:
                raise ScheduleError(f"rank {rank}: pair at action {index} is not two adjacent actions of its own")
            first, second = row[index], row[index + 1]
            where = f"rank {rank} actions {index}-{index + 1} ({step_str([first, second])})"
            if {first.kind, second.kind} != {ActionKind.F, ActionKind.B}:
                raise ScheduleError(f"{where}: an overlapped pair is one {ActionKind.F} and one {ActionKind.B}")
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
    done: set[Event] = set()
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


def validate(schedule: Schedule, training: bool = True) -> Schedule:
    """Check coverage, placement, overlapped pairs and freedom from deadlock; returns the schedule.
    Without `training` (the forward-only schedule of an inference step), no backward is expected."""
    if len(schedule.actions) != schedule.num_ranks:
        raise ScheduleError(f"the schedule lists actions for {len(schedule.actions)} ranks, "
                            f"not {schedule.num_ranks}")
    _check_coverage(schedule, training)
    _check_pairs(schedule)
    run_order(schedule)
    return schedule
