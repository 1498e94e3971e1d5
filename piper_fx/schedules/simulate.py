"""Simulate a schedule with per-action costs: timelines, makespan, bubbles, live activations.

Ranks run their action lists in order; an action starts when its rank is
free and its dependencies have finished (plus `p2p` when a dependency ran on
another rank). Sends never block. This is the timing model of the closed
forms in DeepSeek's DualPipe table, e.g. 1F1B's bubble (P-1)(F+B).
"""
from __future__ import annotations

from dataclasses import dataclass

from .schedule import Action, ActionKind, Schedule, ScheduleError, dependencies, events, step_kind


@dataclass(frozen=True)
class Costs:
    F: float = 1.0
    B: float = 2.0
    I: float = 1.0  # noqa: E741 - the name is the action kind
    W: float = 1.0
    p2p: float = 0.0
    FB: float | None = None  # an overlapped F&B pair; by default F + B (no gain from overlap)

    def of(self, step: list[Action]) -> float:
        """The cost of what a rank starts at once: one action, or an overlapped pair."""
        kind = step_kind(step)
        if kind is ActionKind.OVERLAP_F_B:
            return self.F + self.B if self.FB is None else self.FB
        return getattr(self, kind.value)


@dataclass
class Simulation:
    timelines: list[list[tuple[float, float, Action]]]  # per rank: (start, end, action); a pair's share both
    makespan: float
    bubbles: list[float]            # per rank: makespan minus busy time
    bubble_fraction: float          # idle share of all ranks' time
    peak_activations: list[int]     # per rank: most microbatches whose activations are held at once


def simulate(schedule: Schedule, costs: Costs | None = None) -> Simulation:
    costs = costs or Costs()
    finished: dict[tuple[str, int, int], tuple[float, int]] = {}  # event -> (end time, rank)
    steps = [schedule.steps(rank) for rank in range(schedule.num_ranks)]
    free = [0.0] * schedule.num_ranks
    busy = [0.0] * schedule.num_ranks
    position = [0] * schedule.num_ranks
    timelines: list[list[tuple[float, float, Action]]] = [[] for _ in range(schedule.num_ranks)]
    remaining = sum(len(s) for s in steps)
    while remaining:
        best = None
        for rank, rank_steps in enumerate(steps):
            if position[rank] == len(rank_steps):
                continue
            group = rank_steps[position[rank]]
            deps = [d for action in group for d in dependencies(action, schedule)]
            if not all(d in finished for d in deps):
                continue
            start = max([free[rank]] + [finished[d][0] + (costs.p2p if finished[d][1] != rank else 0.0)
                                        for d in deps])
            if best is None or start < best[0]:
                best = (start, rank, group)
        if best is None:
            raise ScheduleError("the schedule deadlocks (see validate for the blocked actions)")
        start, rank, group = best
        end = start + costs.of(group)
        for action in group:
            timelines[rank].append((start, end, action))
            for event in events(action):
                finished[event] = (end, rank)
        free[rank] = end
        busy[rank] += end - start
        position[rank] += 1
        remaining -= 1
    makespan = max(free)
    bubbles = [makespan - b for b in busy]
    return Simulation(timelines, makespan, bubbles, sum(bubbles) / (makespan * schedule.num_ranks),
                      [_peak_live(line) for line in timelines])


def _peak_live(timeline: list[tuple[float, float, Action]]) -> int:
    """Microbatch-stages held: from a forward until its weight gradient (or whole backward) is done."""
    live = peak = 0
    for _, _, action in timeline:
        if action.kind is ActionKind.F:
            live += 1
            peak = max(peak, live)
        elif action.kind in (ActionKind.B, ActionKind.W):
            live -= 1
    return peak
