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


def _dualpipe_row(half_ranks: int, microbatches: int, depth: int, chunk_stage) -> tuple[list[Action], set[int]]:
    """One rank's DualPipe order, in the rank's two chunks: chunk 0 sits `depth`
    stages from its pipeline's start, chunk 1 as far from its end (the V of
    DualPipeV, or the two directions of DualPipe); each chunk sees
    `microbatches` microbatches. `chunk_stage(chunk)` -> (stage, first microbatch).

    Eight phases (DeepSeek's DualPipe): forwards of chunk 0 to fill the pipe,
    then of both chunks; zero-bubble backwards of chunk 1 while its forwards
    finish; the steady state of overlapped F&B pairs, each a forward of one
    chunk with a backward of the other; then the drain, where the second half
    of the backwards defer their weight gradients (W, oldest first) into the
    time the pipeline would otherwise idle.

    One departure from DeepSeek's order: the last backward of the pipeline's
    last stage (chunk 1 of the depth-0 rank) runs as I followed at once by its
    W instead of as one B. It starts the final chain of input gradients that
    every stage waits for in turn, and split it hands that chain on a W sooner
    for the same work; no action waits for the W, so the schedule is never
    slower for any costs (see tests/dualpipe_reference.py).
    """
    row: list[Action] = []
    pairs: set[int] = set()
    next_of = {(kind, chunk): 0 for kind in "FB" for chunk in (0, 1)}
    deferred: list[Action] = []

    def take(kind: str, chunk: int) -> tuple[int, int]:
        stage, first = chunk_stage(chunk)
        m = first + next_of[(kind, chunk)]
        next_of[(kind, chunk)] += 1
        return stage, m

    def forward(chunk: int) -> None:
        stage, m = take("F", chunk)
        row.append(Action(stage, "F", m))

    def backward(chunk: int, defer_weights: bool = False, split: bool = False) -> None:
        """A whole B; or, split, I then at once its W; or I with its W deferred."""
        stage, m = take("B", chunk)
        if defer_weights:
            row.append(Action(stage, "I", m))
            deferred.append(Action(stage, "W", m))
        elif split:
            row.extend((Action(stage, "I", m), Action(stage, "W", m)))
        else:
            row.append(Action(stage, "B", m))

    def weights() -> None:
        row.append(deferred.pop(0))

    def pair(forward_chunk: int, backward_chunk: int) -> None:
        pairs.add(len(row))
        forward(forward_chunk)
        backward(backward_chunk)

    n, h = half_ranks, depth
    for _ in range(2 * (n - h - 1)):
        forward(0)
    for _ in range(h + 1):
        forward(0)
        forward(1)
    for _ in range(n - h - 1):
        backward(1, defer_weights=True)
        weights()
        forward(1)
    for i in range(microbatches - 2 * n + h + 1):
        # The middle rank's first chunk-1 backward runs alone: its input gradient is
        # still on its way back, and a pair would hold this forward until it arrives.
        if i == 0 and h == n - 1:
            forward(0)
            backward(1)
        else:
            pair(0, 1)
        pair(1, 0)
    for _ in range(n - h - 1):
        backward(1)
        pair(1, 0)
    defer = False
    for i in range(h + 1):
        defer = defer or (i == (h + 1) // 2 and h % 2 == 1)
        # On the depth-0 rank this is the last stage's last backward: split, it sends
        # the input gradient that starts the pipeline's final chain a W sooner.
        backward(1, defer, split=h == 0)
        defer = defer or (i == (h + 1) // 2 and h % 2 == 0)
        backward(0, defer)
    for _ in range(n - h - 1):
        weights()
        backward(0, defer_weights=True)
    while deferred:
        weights()
    return row, pairs


def dualpipev(ranks: int, microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """DualPipeV (DualPipe cut in half): two stages per rank in a V, one copy of
    the model; chunk 0 of rank r is stage r, chunk 1 stage 2P-1-r. Needs M >= 2P.

    Against DeepSeek's table, a bubble of (P-1)(F&B + B - 3W) for these 2P
    stages, the simulated bubble is within it whenever neither F nor W costs
    more than I, for any F&B from max(F, B) to F + B. With no gain from
    overlapping (F&B = F + B) it is within it exactly when F + W <= 2I,
    (P-1)(F - I) <= W and (P-1)(W - I) <= F. Past that, when F > I the last
    rank's 2P+1 warm-up forwards, not the input gradient its first backward
    waits for, are the critical path, and when W > I the drain's deferred W's
    outlast the gaps they fill. DeepSeek's own order, which this one follows
    but for splitting the last stage's last backward, has with F&B = F + B
    the bubble table + max((P-1)(F - I), -F) + (P-1) max(0, W - I)
    (tests/test_schedules.py checks these statements).
    """
    rows = [_dualpipe_row(ranks, microbatches, r, lambda chunk, r=r: ((r, 2 * ranks - 1 - r)[chunk], 0))
            for r in range(ranks)]
    return Schedule("dualpipev", ranks, microbatches, v_placement(ranks), [a for a, _ in rows],
                    pairs=[p for _, p in rows])


def dualpipe(ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """DualPipe (bidirectional): two copies of the P stages, copy 0 placed on
    ranks 0..P-1 and fed from rank 0 with the first half of the microbatches,
    copy 1 placed on ranks P-1..0 and fed from rank P-1 with the second half.
    Rank r's chunk 0 is the copy in which it is among the first P/2 stages. The
    copies' gradients are summed. Needs an even P and M >= 2P."""
    half = microbatches // 2

    def chunks(rank: int):
        own = ((0, rank), (1, ranks - 1 - rank))  # (copy, stage in copy) held by the rank
        early, late = own if rank < ranks // 2 else own[::-1]
        return lambda chunk: ((early, late)[chunk][0] * ranks + (early, late)[chunk][1],
                              (early, late)[chunk][0] * half)

    rows = [_dualpipe_row(ranks // 2, half, min(r, ranks - 1 - r), chunks(r)) for r in range(ranks)]
    placement = tuple(range(ranks)) + tuple(reversed(range(ranks)))
    return Schedule("dualpipe", ranks, microbatches, placement, [a for a, _ in rows], copies=2,
                    pairs=[p for _, p in rows])


PRESETS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved_1f1b": interleaved_1f1b, "zb1p": zb1p, "zbv": zbv,
           "dualpipev": dualpipev, "dualpipe": dualpipe}
SPLIT_BACKWARD = {"zb1p", "zbv", "dualpipev", "dualpipe"}  # presets whose backward (partly) runs as I and W
V_SHAPED = {"zbv", "dualpipev"}  # presets with exactly two stages per rank, in a V


def min_microbatches(name: str, ranks: int, stages_per_rank: int) -> int:
    """The fewest microbatches the preset is defined for."""
    if name in ("dualpipev", "dualpipe"):
        return 2 * ranks
    return 1 if name == "gpipe" else ranks
