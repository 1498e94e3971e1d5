"""Code generation: each task of a rank's program -> a boxed callable.

A compiled task takes a list of input tensors (which it may clear, so inputs
die at their last use inside the task) and returns a sequence of outputs.
`eager` runs the FX graph's Python code; `inductor` compiles it with
`compile_fx_inner` (C++ on CPU, Triton on CUDA); collectives stay inside the
compiled graphs as functional collectives. With `time_waits` (option
`profile`), the waits of those collectives are timed as exposed communication
(`runtime.timing`).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..compile_stats import CompileStats
from ..debug import DebugDump
from ..ir import RankProgram, Task
from . import eager, inductor

CompiledTask = Callable[[list], Sequence[torch.Tensor]]


def compile_program(program: RankProgram, codegen: str, dump: DebugDump, stats: CompileStats,
                    time_waits: bool = False) -> dict[str, CompiledTask]:
    """Each task of `program`, compiled; its time and how its code was obtained go into `stats`."""
    compile_task = inductor.compile_task if codegen == "inductor" else eager.compile_task
    compiled: dict[str, CompiledTask] = {}
    for task in program.tasks.values():
        with stats.task(task.name, codegen):
            compiled[task.name], source = compile_task(task, time_waits)
        dump.write(f"codegen/{task.name}.py", source)
    return compiled


__all__ = ["compile_program", "CompiledTask", "Task"]
