"""DeepSeek's DualPipeV order, rebuilt from the eight phases of `DualPipeV.step`
(deepseek-ai/DualPipe, dualpipe/dualpipev.py) as a piper_fx `Schedule`.

A test-only oracle: the preset `dualpipev` must never simulate worse than the
schedule DeepSeek ships. This module is written from the published phase
structure, independently of `piper_fx.schedules.presets`, so that a bug in the
preset's builder cannot hide in a shared helper.

Mapping of DeepSeek's terms onto ours, for `P` ranks and `M` microbatches
(DeepSeek's "chunks"):

* rank r's phase 0 module is stage r, its phase 1 module stage 2P-1-r (the V);
* `_forward_chunk(p)` is `F` of the next microbatch of phase p's stage;
* `_backward_chunk(p)` is a whole backward `B`, and with `enable_zb=True` an
  input gradient `I` whose weight gradient joins a FIFO queue;
* `_weight_chunk()` is the `W` at the head of that queue;
* `_forward_backward_chunk(p, q)` is an overlapped pair: `F` of phase p's
  stage and `B` of phase q's stage, starting together (`Schedule.pairs`).

Send and receive placement in DeepSeek's code only decides when data moves,
not the order of compute, so it has no counterpart here.
"""
from __future__ import annotations

from collections import deque

from piper_fx.schedules import Action, Schedule, v_placement


class _RankProgram:
    """One rank's compute stream as DeepSeek's step() issues it."""

    def __init__(self, ranks: int, rank: int) -> None:
        self.stage = (rank, 2 * ranks - 1 - rank)  # phase -> stage
        self.next_forward = [0, 0]                 # phase -> next microbatch to run forward
        self.next_backward = [0, 0]                # phase -> next microbatch to run backward
        self.weight_queue: deque[Action] = deque()  # DeepSeek's WeightGradStore: FIFO of deferred W's
        self.actions: list[Action] = []
        self.pairs: set[int] = set()

    def forward(self, phase: int) -> None:
        self.actions.append(Action(self.stage[phase], "F", self.next_forward[phase]))
        self.next_forward[phase] += 1

    def backward(self, phase: int, zero_bubble: bool = False) -> None:
        stage, microbatch = self.stage[phase], self.next_backward[phase]
        self.next_backward[phase] += 1
        if zero_bubble:
            self.actions.append(Action(stage, "I", microbatch))
            self.weight_queue.append(Action(stage, "W", microbatch))
        else:
            self.actions.append(Action(stage, "B", microbatch))

    def weight(self) -> None:
        self.actions.append(self.weight_queue.popleft())

    def forward_backward(self, forward_phase: int, backward_phase: int) -> None:
        self.pairs.add(len(self.actions))
        self.forward(forward_phase)
        self.backward(backward_phase)


def _rank_program(ranks: int, microbatches: int, rank: int) -> _RankProgram:
    program = _RankProgram(ranks, rank)
    last_rank = rank == ranks - 1

    # Phase 1 (nF0): fill the pipe with forwards of the first stage.
    for _ in range((ranks - rank - 1) * 2):
        program.forward(0)
    # Phase 2 (nF0F1): forwards of both stages, alternating.
    for _ in range(rank + 1):
        program.forward(0)
        program.forward(1)
    # Phase 3 (nB1W1F1): zero-bubble backwards of the second stage, each W run at once.
    for _ in range(ranks - rank - 1):
        program.backward(1, zero_bubble=True)
        program.weight()
        program.forward(1)
    # Phase 4 (nF0B1F1B0): the steady state of overlapped pairs. DeepSeek runs the
    # last rank's first pair as two separate actions.
    for i in range(microbatches - ranks * 2 + rank + 1):
        if i == 0 and last_rank:
            program.forward(0)
            program.backward(1)
        else:
            program.forward_backward(0, 1)
        program.forward_backward(1, 0)
    # Phase 5 (nB1F1B0): the second stage's forwards run out.
    for _ in range(ranks - rank - 1):
        program.backward(1)
        program.forward_backward(1, 0)
    # Phase 6 (nB1B0): backwards of both stages; from the middle on they defer their W's.
    count = rank + 1
    zero_bubble = False
    for i in range(count):
        if i == count // 2 and rank % 2 == 1:
            zero_bubble = True
        program.backward(1, zero_bubble)
        if i == count // 2 and rank % 2 == 0:
            zero_bubble = True
        program.backward(0, zero_bubble)
    # Phase 7 (nWB0): one deferred W, then a zero-bubble backward of the first stage.
    for _ in range(ranks - rank - 1):
        program.weight()
        program.backward(0, zero_bubble=True)
    # Phase 8 (nW): the remaining deferred W's.
    for _ in range(rank + 1):
        program.weight()
    assert not program.weight_queue, "every deferred weight gradient runs"
    return program


def dualpipev_reference(ranks: int, microbatches: int) -> Schedule:
    """DeepSeek's DualPipeV order for `ranks` ranks and `microbatches` microbatches.

    DeepSeek's step() asserts M >= 2P, and so does this builder. The schedule is
    not validated here; callers pass it to `schedules.validate`.
    """
    if microbatches < 2 * ranks:
        raise ValueError(f"DualPipeV needs at least 2P = {2 * ranks} microbatches, got {microbatches}")
    programs = [_rank_program(ranks, microbatches, rank) for rank in range(ranks)]
    return Schedule("dualpipev_reference", ranks, microbatches, v_placement(ranks),
                    [p.actions for p in programs], pairs=[p.pairs for p in programs])
