"""Code generation: each task of a rank's program -> a boxed callable.

A compiled task takes a list of input tensors (which it may clear, so inputs
die at their last use inside the task) and returns a sequence of outputs.
`eager` runs the FX graph's Python code; `inductor` compiles it with
`compile_fx_inner` (C++ on CPU, Triton on CUDA); collectives stay inside the
compiled graphs as functional collectives. With `time_waits` (option
`profile`), the waits of those collectives are timed as exposed communication
(`runtime.timing`). Under Inductor, ranks that would compile the same task
split the work (`shared`): each distinct task is compiled by one of them.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..compile_stats import CompileStats
from ..debug import DebugDump
from ..ir import RankProgram, Task
from . import eager, inductor, shared

CompiledTask = Callable[[list], Sequence[torch.Tensor]]


def warm_up(codegen: str, device: torch.device | None) -> inductor.WarmUp | None:
    """Start what code generation does once per process and can do before the tasks exist
    (`inductor.WarmUp`), for `compile_program` to wait for."""
    return inductor.WarmUp(device) if codegen == "inductor" else None


def compile_program(program: RankProgram, codegen: str, dump: DebugDump, stats: CompileStats,
                    time_waits: bool = False, warmed: inductor.WarmUp | None = None) -> dict[str, CompiledTask]:
    """Each task of `program`, compiled; its time and how its code was obtained go into `stats`.
    Under Inductor, collective: every rank compiles its program at once (`shared`); `warmed`:
    the `warm_up` started for it, if any."""
    compiled: dict[str, CompiledTask] = {}
    tasks = list(program.tasks.values())
    compile_task = inductor.compile_task if codegen == "inductor" else eager.compile_task

    def compile_one(task: Task) -> None:
        with stats.task(task.name, codegen):
            compiled[task.name], source = compile_task(task, time_waits)
        dump.write(f"codegen/{task.name}.py", source)

    if codegen != "inductor":
        for task in tasks:
            compile_one(task)
        return compiled
    if warmed is not None:
        with stats.phase("codegen warm-up"):  # what of it planning did not hide
            warmed.wait()
    for task in tasks:
        inductor.name_by_position(task.graph)
    with stats.phase("codegen exchange"):
        shares = shared.share(tasks)
    shared.compile_shares(shares, compile_one, lambda: stats.phase("codegen wait for peers"))
    return compiled


__all__ = ["compile_program", "CompiledTask", "Task", "warm_up"]
