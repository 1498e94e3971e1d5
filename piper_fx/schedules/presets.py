"""The preset schedules: each a short builder of per-rank action lists, and
the shapes (ranks, microbatches, stages per rank) it is defined for, stated
next to it as a `Preset`. `options` validates a pipeline by asking its
preset (`Preset.check`), so each rule is written once, here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from .schedule import Action, ActionKind, Schedule, ScheduleError

F, B, I, W = ActionKind.F, ActionKind.B, ActionKind.I, ActionKind.W  # noqa: E741


class ShapeError(ScheduleError):
    """A preset asked for a shape it is not defined for: `parameter` ("ranks",
    "stages_per_rank" or "microbatches") has `value`; `valid` says what would do."""

    def __init__(self, parameter: str, value: Any, valid: str) -> None:
        super().__init__(f"{parameter}={value!r}: {valid}")
        self.parameter, self.value, self.valid = parameter, value, valid


@dataclass(frozen=True)
class Rule:
    """A condition a preset puts on one of its parameters, `holds(value, ranks)`;
    `valid`, formatted with the preset's `name`, `ranks` and `least` microbatches,
    says what meets it."""

    parameter: str
    holds: Callable[[Any, int], bool]
    valid: str


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


_PARAMETERS = ("ranks", "stages_per_rank", "microbatches")  # the order a shape is checked in
_POSITIVE_STAGES = Rule("stages_per_rank", lambda v, ranks: _is_count(v) and v >= 1, "a positive int")
ONE_STAGE_PER_RANK = Rule("stages_per_rank", lambda v, ranks: v == 1,
                          "1 for {name} (use interleaved_1f1b for several stages per rank)")
TWO_STAGES_IN_A_V = Rule("stages_per_rank", lambda v, ranks: v == 2, "2 for {name} (two stages per rank, in a V)")


@dataclass(frozen=True)
class Preset:
    """A named schedule builder and the shapes it is defined for: at least
    `least_microbatches(ranks)` microbatches, and its `rules`."""

    name: str
    build: Callable[[int, int, int], Schedule]
    least_microbatches: Callable[[int], int]
    rules: tuple[Rule, ...]
    stages_per_rank: int = 1  # the default
    splits_backward: bool = False  # whether its backward (partly) runs as I and W

    def __call__(self, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> Schedule:
        return self.build(ranks, microbatches, self.stages_per_rank if stages_per_rank is None else stages_per_rank)

    def all_rules(self) -> list[Rule]:
        """The rules every preset shares, then its own, in the order they are checked."""
        enough = Rule("microbatches", lambda v, ranks: _is_count(v) and v >= self.least_microbatches(ranks),
                      "an int >= {least} for {name} with pp={ranks}")
        return sorted([_POSITIVE_STAGES, enough, *self.rules], key=lambda rule: _PARAMETERS.index(rule.parameter))

    def check(self, ranks: int, microbatches: Any, stages_per_rank: Any) -> None:
        """Raise `ShapeError` naming the first parameter the preset is not defined for."""
        values = {"ranks": ranks, "stages_per_rank": stages_per_rank, "microbatches": microbatches}
        for rule in self.all_rules():
            if not rule.holds(values[rule.parameter], ranks):
                raise ShapeError(rule.parameter, values[rule.parameter], rule.valid.format(
                    name=self.name, ranks=ranks, least=self.least_microbatches(ranks)))


def gpipe(ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """All forwards, then all backwards (GPipe): M microbatches of activations live per rank."""
    actions = [[Action(r, F, m) for m in range(microbatches)] + [Action(r, B, m) for m in range(microbatches)]
               for r in range(ranks)]
    return Schedule("gpipe", ranks, microbatches, tuple(range(ranks)), actions)


GPIPE = Preset("gpipe", gpipe, least_microbatches=lambda ranks: 1, rules=(ONE_STAGE_PER_RANK,))


def one_f_one_b(ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """1F1B (PipeDream-flush): after a warm-up of P-1-r forwards, alternate; at most P-r live."""
    actions = []
    for r in range(ranks):
        warmup = min(ranks - 1 - r, microbatches)
        order = [Action(r, F, m) for m in range(warmup)]
        forward, backward = warmup, 0
        while forward < microbatches:
            order += [Action(r, F, forward), Action(r, B, backward)]
            forward, backward = forward + 1, backward + 1
        order += [Action(r, B, m) for m in range(backward, microbatches)]
        actions.append(order)
    return Schedule("1f1b", ranks, microbatches, tuple(range(ranks)), actions)


ONE_F_ONE_B = Preset("1f1b", one_f_one_b, least_microbatches=lambda ranks: ranks, rules=(ONE_STAGE_PER_RANK,))


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
            order.append(Action(chunk * P + r, F, m))

        def backward(k: int) -> None:
            chunk, m = unit(k, backward=True)
            order.append(Action(chunk * P + r, B, m))

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


INTERLEAVED_1F1B = Preset(
    "interleaved_1f1b", interleaved_1f1b, least_microbatches=lambda ranks: ranks, stages_per_rank=2,
    rules=(Rule("stages_per_rank", lambda v, ranks: v >= 2, "at least 2 for {name}"),
           Rule("microbatches", lambda v, ranks: v % ranks == 0, "a multiple of pp={ranks} for {name}")))


def zb1p(ranks: int, microbatches: int, stages_per_rank: int = 1) -> Schedule:
    """ZB-H1 (zero bubble, 1F1B memory): 1F1B with each backward split into I and W.

    A rank sends the input gradient (I) as soon as it can and postpones weight
    gradients (W): rank r keeps up to r of them pending, then runs the oldest,
    so the W's fill the time 1F1B spends waiting in its cool-down.
    """
    actions = []
    for r in range(ranks):
        warmup = min(ranks - 1 - r, microbatches)
        order = [Action(r, F, m) for m in range(warmup)]
        pending: list[int] = []

        def input_grad(m: int) -> None:
            order.append(Action(r, I, m))
            pending.append(m)
            if len(pending) > r:
                order.append(Action(r, W, pending.pop(0)))

        forward = warmup
        for backward in range(microbatches):
            if forward < microbatches:
                order.append(Action(r, F, forward))
                forward += 1
            input_grad(backward)
        order += [Action(r, W, m) for m in pending]
        actions.append(order)
    return Schedule("zb1p", ranks, microbatches, tuple(range(ranks)), actions)


ZB1P = Preset("zb1p", zb1p, least_microbatches=lambda ranks: ranks, rules=(ONE_STAGE_PER_RANK,), splits_backward=True)


def v_placement(ranks: int) -> tuple[int, ...]:
    """2 stages per rank in a V: rank r holds stage r and stage 2P-1-r (first and last on rank 0)."""
    return tuple(range(ranks)) + tuple(reversed(range(ranks)))


def greedy_zero_bubble(name: str, ranks: int, microbatches: int, stage_to_rank: tuple[int, ...],
                       max_live: int) -> Schedule:
    """Build a split-backward schedule for any placement by simulating unit-time steps.

    Each step every rank takes, among its actions whose inputs were finished in
    an earlier step: an input gradient I (it unblocks an earlier stage), else a
    forward F while it holds fewer than `max_live` microbatch-stages, else a
    pending weight gradient W (filling what would be a bubble). The deepest stage goes first,
    as it is closest to completing a microbatch and freeing its memory. Per
    stage, microbatches go in order.
    """
    greedy = _GreedyZeroBubble(ranks, microbatches, stage_to_rank, max_live)
    total = 3 * len(stage_to_rank) * microbatches
    while sum(map(len, greedy.actions)) < total:
        chosen = [(r, action) for r in range(ranks) if (action := greedy.choose(r)) is not None]
        if not chosen:
            raise ScheduleError(f"{name}: no rank can make progress with at most {max_live} live microbatch-stages")
        for r, action in chosen:
            greedy.take(r, action)
        greedy.done.update((action.kind, action.stage, action.microbatch) for _, action in chosen)
    return Schedule(name, ranks, microbatches, stage_to_rank, greedy.actions)


class _GreedyZeroBubble:
    """The state of `greedy_zero_bubble`'s simulation: per stage the next
    microbatch to run F and I for, per rank its pending W's and live
    microbatch-stages, the events of earlier steps (`done`) and the actions so far."""

    def __init__(self, ranks: int, microbatches: int, stage_to_rank: tuple[int, ...], max_live: int) -> None:
        self.num_stages, self.microbatches, self.max_live = len(stage_to_rank), microbatches, max_live
        # The rank's stages, deepest first.
        self.stages = [[s for s in reversed(range(self.num_stages)) if stage_to_rank[s] == r] for r in range(ranks)]
        self.next_f = [0] * self.num_stages
        self.next_i = [0] * self.num_stages
        self.pending_w: list[list[Action]] = [[] for _ in range(ranks)]
        self.live = [0] * ranks
        self.done: set[tuple[ActionKind, int, int]] = set()
        self.actions: list[list[Action]] = [[] for _ in range(ranks)]

    def choose(self, r: int) -> Action | None:
        """Rank r's action this step: a ready I, else a ready F within `max_live`, else a pending W."""
        for s in self.stages[r]:
            m = self.next_i[s]
            if m < self.microbatches and (F, s, m) in self.done and (
                    s == self.num_stages - 1 or (I, s + 1, m) in self.done):
                return Action(s, I, m)
        if self.live[r] < self.max_live:
            for s in self.stages[r]:
                m = self.next_f[s]
                if m < self.microbatches and (s == 0 or (F, s - 1, m) in self.done):
                    return Action(s, F, m)
        return self.pending_w[r].pop(0) if self.pending_w[r] else None

    def take(self, r: int, action: Action) -> None:
        self.actions[r].append(action)
        if action.kind is F:
            self.next_f[action.stage] += 1
            self.live[r] += 1
        elif action.kind is I:
            self.next_i[action.stage] += 1
            self.pending_w[r].append(Action(action.stage, W, action.microbatch))
        else:
            self.live[r] -= 1


def zbv(ranks: int, microbatches: int, stages_per_rank: int = 2) -> Schedule:
    """ZB-V: two stages per rank in a V, split backward, at most 2P microbatch-stages live per rank
    (1F1B's activation memory, since each stage is half a rank's layers)."""
    return greedy_zero_bubble("zbv", ranks, microbatches, v_placement(ranks), max_live=2 * ranks)


ZBV = Preset("zbv", zbv, least_microbatches=lambda ranks: ranks, rules=(TWO_STAGES_IN_A_V,), stages_per_rank=2,
             splits_backward=True)


class _DualPipeOrder:
    """One rank's DualPipe order as it is built, in the rank's two chunks:
    chunk 0 sits `depth` stages from its pipeline's start, chunk 1 as far from
    its end (the V of DualPipeV, or the two directions of DualPipe); each chunk
    sees `microbatches` microbatches of a pipeline of 2 * `half_ranks` stages.
    `chunk_stage(chunk)` -> (stage, first microbatch).

    The eight phases are DeepSeek's (`DualPipeV.step`), each a method below in
    the order they run; `n` is `half_ranks` and `h` is `depth`.
    """

    def __init__(self, half_ranks: int, microbatches: int, depth: int, chunk_stage) -> None:
        self.n, self.h, self.microbatches, self.chunk_stage = half_ranks, depth, microbatches, chunk_stage
        self.row: list[Action] = []
        self.pairs: set[int] = set()  # positions i where row[i], row[i + 1] run as one F&B pair
        self.next_of = {(kind, chunk): 0 for kind in (F, B) for chunk in (0, 1)}
        self.deferred: list[Action] = []  # W's waiting for a bubble, oldest first

    def take(self, kind: ActionKind, chunk: int) -> tuple[int, int]:
        """The stage and next microbatch of `chunk` for a forward (F) or a backward (B)."""
        stage, first = self.chunk_stage(chunk)
        m = first + self.next_of[(kind, chunk)]
        self.next_of[(kind, chunk)] += 1
        return stage, m

    def forward(self, chunk: int) -> None:
        stage, m = self.take(F, chunk)
        self.row.append(Action(stage, F, m))

    def backward(self, chunk: int, defer_weights: bool = False, split: bool = False) -> None:
        """A whole B; or, split, I then at once its W; or I with its W deferred."""
        stage, m = self.take(B, chunk)
        if defer_weights:
            self.row.append(Action(stage, I, m))
            self.deferred.append(Action(stage, W, m))
        elif split:
            self.row.extend((Action(stage, I, m), Action(stage, W, m)))
        else:
            self.row.append(Action(stage, B, m))

    def weights(self) -> None:
        """The oldest deferred W."""
        self.row.append(self.deferred.pop(0))

    def pair(self, forward_chunk: int, backward_chunk: int) -> None:
        self.pairs.add(len(self.row))
        self.forward(forward_chunk)
        self.backward(backward_chunk)

    def warm_up_forwards(self) -> None:  # phases 1 and 2
        for _ in range(2 * (self.n - self.h - 1)):
            self.forward(0)
        for _ in range(self.h + 1):
            self.forward(0)
            self.forward(1)

    def first_chunk1_backwards(self) -> None:  # phase 3: zero-bubble B1 while F1 finishes
        for _ in range(self.n - self.h - 1):
            self.backward(1, defer_weights=True)
            self.weights()
            self.forward(1)

    def steady_state_pairs(self) -> None:  # phases 4 and 5
        n, h = self.n, self.h
        for i in range(self.microbatches - 2 * n + h + 1):
            # The middle rank's first chunk-1 backward runs alone: its input gradient is
            # still on its way back, and a pair would hold this forward until it arrives.
            if i == 0 and h == n - 1:
                self.forward(0)
                self.backward(1)
            else:
                self.pair(0, 1)
            self.pair(1, 0)
        for _ in range(n - h - 1):
            self.backward(1)
            self.pair(1, 0)

    def drain_deferring_weights(self) -> None:  # phases 6, 7 and 8
        h, defer = self.h, False
        for i in range(h + 1):
            defer = defer or (i == (h + 1) // 2 and h % 2 == 1)
            # On the depth-0 rank this is the last stage's last backward: split, it sends
            # the input gradient that starts the pipeline's final chain a W sooner.
            self.backward(1, defer, split=h == 0)
            defer = defer or (i == (h + 1) // 2 and h % 2 == 0)
            self.backward(0, defer)
        for _ in range(self.n - h - 1):
            self.weights()
            self.backward(0, defer_weights=True)
        while self.deferred:
            self.weights()


def _dualpipe_row(half_ranks: int, microbatches: int, depth: int, chunk_stage) -> tuple[list[Action], set[int]]:
    """One rank's DualPipe order and its overlapped pairs (see `_DualPipeOrder` for the arguments).

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
    order = _DualPipeOrder(half_ranks, microbatches, depth, chunk_stage)
    order.warm_up_forwards()
    order.first_chunk1_backwards()
    order.steady_state_pairs()
    order.drain_deferring_weights()
    return order.row, order.pairs


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


DUALPIPEV = Preset("dualpipev", dualpipev, least_microbatches=lambda ranks: 2 * ranks, rules=(TWO_STAGES_IN_A_V,),
                   stages_per_rank=2, splits_backward=True)


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


DUALPIPE = Preset(
    "dualpipe", dualpipe, least_microbatches=lambda ranks: 2 * ranks, splits_backward=True,
    rules=(Rule("ranks", lambda v, ranks: v % 2 == 0, "an even number of pipeline ranks for {name} (two copies of "
                                                       "the stages meet in the middle); dualpipev runs on any number"),
           ONE_STAGE_PER_RANK,
           Rule("microbatches", lambda v, ranks: v % 2 == 0,
                "an even number for {name} (half of them enter from each end)")))


PRESETS = {preset.name: preset for preset in (GPIPE, ONE_F_ONE_B, INTERLEAVED_1F1B, ZB1P, ZBV, DUALPIPEV, DUALPIPE)}
SPLIT_BACKWARD = {name for name, preset in PRESETS.items() if preset.splits_backward}
# The presets with exactly two stages per rank, in a V.
V_SHAPED = {name for name, preset in PRESETS.items() if TWO_STAGES_IN_A_V in preset.rules}


def min_microbatches(name: str, ranks: int, stages_per_rank: int) -> int:
    """The fewest microbatches the preset is defined for."""
    return PRESETS[name].least_microbatches(ranks)
