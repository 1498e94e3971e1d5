"""The preset schedules, each a short builder of per-rank action lists."""
from __future__ import annotations

from .schedule import Action, Schedule


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


PRESETS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b}


def min_microbatches(name: str, ranks: int, stages_per_rank: int) -> int:
    """The fewest microbatches the preset is defined for."""
    return 1 if name == "gpipe" else ranks
