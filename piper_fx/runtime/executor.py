"""Runs a `RankProgram`: tasks in order over a store of named values."""
from __future__ import annotations

import contextlib
import contextvars
from typing import Callable, Iterator, Sequence

import torch

from ..ir import RankProgram


# Context managers entered around every task run, e.g. a dispatch mode that
# measures memory. Entered here, inside the compiled step, because Dynamo runs
# a frame eagerly when a dispatch mode is active around `step(...)` itself.
_TASK_CONTEXTS: contextvars.ContextVar[tuple] = contextvars.ContextVar("piper_task_contexts", default=())


@contextlib.contextmanager
def around_tasks(*contexts) -> Iterator[None]:
    """Enter `contexts` around each task the runtime runs while this is active."""
    token = _TASK_CONTEXTS.set(_TASK_CONTEXTS.get() + contexts)
    try:
        yield
    finally:
        _TASK_CONTEXTS.reset(token)


class ProgramExecutor:
    """Runs one rank's program; each value is dropped after the last task that reads it."""

    def __init__(self, program: RankProgram, compiled: dict[str, Callable[[list], Sequence[torch.Tensor]]]):
        self.program = program
        self.compiled = compiled
        kept = set(program.outputs)
        last_read: dict[str, int] = {}
        for index, task in enumerate(program.tasks):
            for name in task.inputs:
                last_read[name] = index
        self.drop_before: list[list[str]] = [[] for _ in program.tasks]
        for name, index in last_read.items():
            if name not in kept:
                self.drop_before[index].append(name)

    def run(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Run every task; `values` holds the program inputs and is consumed."""
        for index, task in enumerate(self.program.tasks):
            args = [values[name] for name in task.inputs]
            # Drop our references first, so the boxed task frees each input at its last use.
            for name in self.drop_before[index]:
                del values[name]
            try:
                with contextlib.ExitStack() as stack:
                    for context in _TASK_CONTEXTS.get():
                        stack.enter_context(context)
                    results = self.compiled[task.name](args)
            except Exception as e:
                raise RuntimeError(f"piper_fx rank {self.program.rank}: task {task.name} failed: {e}") from e
            del args
            values.update(zip(task.outputs, results))
        return {name: values[name] for name in self.program.outputs}
