"""torch.distributed.pipelining's schedule format, read and written.

torch writes a schedule as one CSV row per pipeline rank and a cell per
action: `<stage><kind><microbatch>` for compute actions (`0F1`, `3I0`, `2W3`,
`1B2`), `(<action>;<action>)OVERLAP_F_B` for an overlapped F&B pair, and, in
its lowered form (what `PipelineScheduleMulti._dump_csv` writes after
lowering), communication and FSDP actions (`0SEND_F1`, `2RECV_B0`,
`0UNSHARD`, `1REDUCE_GRAD`) and empty cells for idle steps. Stage indices are
global, as ours are (rank r of a V holds stages r and 2P-1-r in both).

piper_fx plans its own communication from the schedule's dependencies, so
reading keeps the compute actions and drops the rest; writing produces the
compute-only form, which torch's `_load_csv` reads. A schedule read is
validated like any other. Bidirectional DualPipe's two copies of the stages
have no counterpart in torch's format.
"""
from __future__ import annotations

import csv
import io
import re
from typing import Iterable, Sequence

from .schedule import COMPUTE_KINDS, Action, ActionKind, Schedule, ScheduleError, validate

_COMPUTE = re.compile(rf"^(\d+)({'|'.join(COMPUTE_KINDS)})(\d+)$")
# torch's actions that move data or shard parameters: piper_fx derives its own.
_NOT_COMPUTE = re.compile(r"^(\d+)(SEND_F|RECV_F|SEND_B|RECV_B|UNSHARD|RESHARD|REDUCE_GRAD)(\d*)$")
_PAIR = re.compile(rf"^\((.*)\){ActionKind.OVERLAP_F_B}$")


def _cell(action: Action) -> str:
    """torch's `str` of the action: `<stage><kind><microbatch>`."""
    return f"{action.stage}{action.kind}{action.microbatch}"


def _pair_cell(step: list[Action]) -> str:
    """torch's `str` of an overlapped pair: `(<action>;<action>)OVERLAP_F_B`."""
    return f"({';'.join(map(_cell, step))}){ActionKind.OVERLAP_F_B}"


def to_torch_rows(schedule: Schedule) -> list[list[str]]:
    """Per rank, its actions as torch's action strings (compute only; a pair is one cell)."""
    if schedule.copies != 1:
        raise ValueError(f"{schedule.name} runs {schedule.copies} copies of the stages, which "
                         "torch.distributed.pipelining's schedule format cannot express")
    return [[_cell(step[0]) if len(step) == 1 else _pair_cell(step) for step in schedule.steps(rank)]
            for rank in range(schedule.num_ranks)]


def to_torch_csv(schedule: Schedule) -> str:
    """The schedule as torch's CSV: a row per rank."""
    out = io.StringIO()
    csv.writer(out, lineterminator="\n").writerows(to_torch_rows(schedule))
    return out.getvalue()


def _compute_action(text: str, rank: int) -> Action:
    match = _COMPUTE.match(text)
    if match is None:
        raise ScheduleError(f"rank {rank}: {text!r} is not a compute action of torch's format "
                            f"(<stage><{'|'.join(COMPUTE_KINDS)}><microbatch>, e.g. 0F1)")
    stage, kind, microbatch = match.groups()
    return Action(int(stage), ActionKind(kind), int(microbatch))


def from_torch_rows(rows: Sequence[Iterable[object]], name: str = "torch") -> Schedule:
    """A validated `Schedule` from torch's per-rank action lists: strings, or torch's
    `_Action` objects (read through their `str`), with None or "" for idle steps."""
    read = [_read_row(row, rank) for rank, row in enumerate(rows)]
    actions = [mine for mine, _ in read]
    stage_to_rank = _placement(actions)
    microbatches = 1 + max((a.microbatch for row in actions for a in row), default=-1)
    return validate(Schedule(name, len(actions), microbatches, stage_to_rank, actions,
                             pairs=[paired for _, paired in read]))


def _read_row(row: Iterable[object], rank: int) -> tuple[list[Action], set[int]]:
    """A rank's compute actions and the positions of its overlapped pairs."""
    mine: list[Action] = []
    paired: set[int] = set()
    for cell in row:
        text = "" if cell is None else str(cell).strip()
        if not text or _NOT_COMPUTE.match(text):
            continue
        pair = _PAIR.match(text)
        if pair is not None:
            parts = [_compute_action(part.strip(), rank) for part in pair.group(1).split(";")]
            if len(parts) != 2:
                raise ScheduleError(f"rank {rank}: {text!r} overlaps {len(parts)} actions; a pair is two")
            paired.add(len(mine))
            mine.extend(parts)
        else:
            mine.append(_compute_action(text, rank))
    return mine, paired


def _placement(actions: list[list[Action]]) -> tuple[int, ...]:
    """The rank of each stage, from the rank whose row runs it."""
    stage_to_rank: dict[int, int] = {}
    for rank, row in enumerate(actions):
        for action in row:
            if stage_to_rank.setdefault(action.stage, rank) != rank:
                raise ScheduleError(f"stage {action.stage} has actions on ranks {stage_to_rank[action.stage]} "
                                    f"and {rank}; a stage runs on one rank")
    stages = sorted(stage_to_rank)
    if stages != list(range(len(stages))):
        raise ScheduleError(f"the stages are {stages}: they must be 0..{len(stages) - 1}")
    return tuple(stage_to_rank[s] for s in stages)


def from_torch_csv(text: str, name: str = "torch") -> Schedule:
    """A validated `Schedule` from torch's CSV (compute-only or lowered)."""
    return from_torch_rows(list(csv.reader(io.StringIO(text))), name)
