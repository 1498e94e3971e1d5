"""Pictures of a schedule: a text grid and an SVG timeline, from the same simulation."""
from __future__ import annotations

from html import escape

from .schedule import ActionKind, Schedule, run_order, step_kind, step_str

_COLORS = {ActionKind.F: "#6fa8dc", ActionKind.B: "#93c47d", ActionKind.I: "#b6d7a8", ActionKind.W: "#ffd966",
           ActionKind.OVERLAP_F_B: "#c27ba0"}


def _cells(schedule: Schedule) -> dict[tuple[int, int], list]:
    """(time step, rank) -> the actions run then: one, or an overlapped F&B pair."""
    cells: dict[tuple[int, int], list] = {}
    for step, rank, action in run_order(schedule):
        cells.setdefault((step, rank), []).append(action)
    return cells


def text_grid(schedule: Schedule) -> str:
    """One row per rank, one column per simulated time step; cells `F<stage>.<microbatch>`,
    overlapped pairs `F<s>.<m>&B<s>.<m>`."""
    by_step = _cells(schedule)
    steps = 1 + max(step for step, _ in by_step)
    cells = [["." for _ in range(steps)] for _ in range(schedule.num_ranks)]
    for (step, rank), actions in by_step.items():
        cells[rank][step] = step_str(actions)
    width = max(len(c) for row in cells for c in row)
    lines = [f"# {schedule.name}: {schedule.num_ranks} ranks, {schedule.num_stages} stages, "
             f"{schedule.num_microbatches} microbatches (unit time per action)"]
    for rank, row in enumerate(cells):
        lines.append(f"rank {rank}: " + " ".join(c.ljust(width) for c in row))
    return "\n".join(lines) + "\n"


def svg(schedule: Schedule, cell: int = 34, row: int = 26) -> str:
    by_step = _cells(schedule)
    steps = 1 + max(step for step, _ in by_step)
    cell *= max(len(actions) for actions in by_step.values())
    left, top = 60, 24
    width, height = left + steps * cell + 10, top + schedule.num_ranks * row + 10
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
             f'font-family="monospace" font-size="10">',
             f'<text x="4" y="14">{escape(schedule.name)}: {schedule.num_stages} stages, '
             f'{schedule.num_microbatches} microbatches</text>']
    for rank in range(schedule.num_ranks):
        parts.append(f'<text x="4" y="{top + rank * row + 16}">rank {rank}</text>')
    for (step, rank), actions in by_step.items():
        x, y = left + step * cell, top + rank * row
        label = step_str(actions)
        fill = _COLORS[step_kind(actions)]
        parts.append(f'<rect x="{x}" y="{y}" width="{cell - 2}" height="{row - 4}" '
                     f'fill="{fill}"><title>{label}</title></rect>')
        parts.append(f'<text x="{x + 3}" y="{y + 15}">{escape(label)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"
