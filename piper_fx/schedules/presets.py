"""The preset schedules, each a short builder of per-rank action lists."""
from __future__ import annotations

from .schedule import Action, Schedule, ScheduleError


def gpipe(ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """All forwards, then all backwards (GPipe): M microbatches of activations live per rank."""
    actions = [[Action(r, "F", m) for m in range(microbatches)] + [Action(r, "B", m) for m in range(microbatches)]
               for r in range(ranks)]
    return Schedule("gpipe", ranks, microbatches, tuple(range(ranks)), actions)


def one_f_one_b(ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): after a warm-up of P-1-r forwards, alternate; at most P-r live."""
    actions = []
    for r in range(ranks):
        warmup = min(ranks - 1 - r, microbatches)
        order = [Action(r, "F", m) for m in range(warmup)]
        forward, backward = warmup, 0
        while forward < microbatches:
            order += [Action(r, "F", forward), Action(r, "B", backward)]
            forward, backward = forward + 1, backward + 1
        order += [Action(r, "B", m) for m in range(backward, microbatches)]
        actions.append(order)
    return Schedule("1f1b", ranks, microbatches, tuple(range(ranks)), actions)


def interleaved_1f1b(ranks: int, microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """Interleaved 1F1B (Megatron): V stages per rank placed round robin (stage c*P + r on rank r).

    Forwards run in rounds of P microbatches through the rank's stages in order,
    backwards likewise through its stages in reverse; after a warm-up of
    (P-1-r)*2 + (V-1)*P forwards, forwards and backwards alternate.
    """
    P, M, V = ranks, microbatches, stages_per_rank
    total = M * V

    def unit(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // P) % V
        if backward:
            chunk = V - 1 - chunk
        return chunk, (k // (P * V)) * P + k % P

    actions = []
    for r in range(P):
        warmup = min((P - 1 - r) * 2 + (V - 1) * P, total)
        order: list[Action] = []

        def forward(k: int) -> None:
            chunk, m = unit(k, backward=False)
            order.append(Action(chunk * P + r, "F", m))

        def backward(k: int) -> None:
            chunk, m = unit(k, backward=True)
            order.append(Action(chunk * P + r, "B", m))

        for k in range(warmup):
            forward(k)
        for k in range(total - warmup):
            forward(warmup + k)
            backward(k)
        for k in range(total - warmup, total):
            backward(k)
        actions.append(order)
    stage_to_rank = tuple(s % P for s in range(P * V))
    return Schedule("interleaved_1f1b", P, M, stage_to_rank, actions)


def zb1p(ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """ZB-H1 (zero bubble, 1F1B memory): 1F1B with each backward split into I and W.

    A rank sends the input gradient (I) as soon as it can and postpones weight
    gradients (W): rank r keeps up to r of them pending, then runs the oldest,
    so the W's fill the time 1F1B spends waiting in its cool-down.
    """
    actions = []
    for r in range(ranks):
        warmup = min(ranks - 1 - r, microbatches)
        order = [Action(r, "F", m) for m in range(warmup)]
        pending: list[int] = []

        def input_grad(m: int) -> None:
            order.append(Action(r, "I", m))
            pending.append(m)
            if len(pending) > r:
                order.append(Action(r, "W", pending.pop(0)))

        forward = warmup
        for backward in range(microbatches):
            if forward < microbatches:
                order.append(Action(r, "F", forward))
                forward += 1
            input_grad(backward)
        order += [Action(r, "W", m) for m in pending]
        actions.append(order)
    return Schedule("zb1p", ranks, microbatches, tuple(range(ranks)), actions)


def v_placement(ranks: int) -> tuple[int, ...]:
    """2 stages per rank in a V: rank r holds stage r and stage 2P-1-r (first and last on rank 0)."""
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


def greedy_zero_bubble(name: str, ranks: int, microbatches: int, stage_to_rank: tuple[int, ...],
                       max_live: int) -> Schedule:
    """Build a split-backward schedule for any placement by simulating unit-time steps.

    Each step every rank takes, among its actions whose inputs were finished in
    an earlier step: an input gradient I (it unblocks an earlier stage), else a
    forward F while it holds fewer than `max_live` microbatch-stages, else a
    pending weight
    gradient W (filling what would be a bubble). The deepest stage goes first,
    as it is closest to completing a microbatch and freeing its memory. Per
    stage, microbatches go in order.
    """
    num_stages = len(stage_to_rank)
    stages = [[s for s in range(num_stages) if stage_to_rank[s] == r] for r in range(ranks)]
    next_f = [0] * num_stages
    next_i = [0] * num_stages
    pending_w: list[list[Action]] = [[] for _ in range(ranks)]
    live = [0] * ranks
    done: set[tuple[str, int, int]] = set()
    actions: list[list[Action]] = [[] for _ in range(ranks)]
    total = 3 * num_stages * microbatches
    emitted = 0
    while emitted < total:
        finished_now = []
        for r in range(ranks):
            choice = None
            for s in sorted(stages[r], reverse=True):
                m = next_i[s]
                if m < microbatches and ("F", s, m) in done and (s == num_stages - 1 or ("I", s + 1, m) in done):
                    choice = Action(s, "I", m)
                    break
            if choice is None and live[r] < max_live:
                for s in sorted(stages[r], reverse=True):
                    m = next_f[s]
                    if m < microbatches and (s == 0 or ("F", s - 1, m) in done):
                        choice = Action(s, "F", m)
                        break
            if choice is None and pending_w[r]:
                choice = pending_w[r].pop(0)
            if choice is None:
                continue
            actions[r].append(choice)
            finished_now.append((choice.kind, choice.stage, choice.microbatch))
            emitted += 1
            if choice.kind == "F":
                next_f[choice.stage] += 1
                live[r] += 1
            elif choice.kind == "I":
                next_i[choice.stage] += 1
                pending_w[r].append(Action(choice.stage, "W", choice.microbatch))
            else:
                live[r] -= 1
        if not finished_now:
            raise ScheduleError(f"{name}: no rank can make progress with at most {max_live} live microbatch-stages")
        done.update(finished_now)
    return Schedule(name, ranks, microbatches, stage_to_rank, actions)


def zbv(ranks: int, microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """ZB-V: two stages per rank in a V, split backward, at most 2P microbatch-stages live per rank
    (1F1B's activation memory, since each stage is half a rank's layers)."""
    return greedy_zero_bubble("zbv", ranks, microbatches, v_placement(ranks), max_live=2 * ranks)


PRESETS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "zb1p": zb1p, "zbv": zbv}
SPLIT_BACKWARD = {"zb1p", "zbv"}  # presets whose backward runs as I and W
V_SHAPED = {"zbv"}  # presets with exactly two stages per rank, in a V


def min_microbatches(name: str, ranks: int, stages_per_rank: int) -> int:
    """The fewest microbatches the preset is defined for."""
    return 1 if name == "gpipe" else ranks
