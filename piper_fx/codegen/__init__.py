"""Code generation: each task of a rank's program -> a boxed callable.

A compiled task takes a list of input tensors (which it may clear, so inputs
die at their last use inside the task) and returns a sequence of outputs.
`eager` runs the FX graph's Python code; `inductor` compiles it with
`compile_fx_inner` (C++ on CPU, Triton on CUDA), whole or as the layers it runs
(`regions`: each distinct layer's code once; `cuts_regions` says which);
collectives stay inside the
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
from . import eager, inductor, regions, shared

CompiledTask = Callable[[list], Sequence[torch.Tensor]]


def warm_up(codegen: str, device: torch.device | None) -> inductor.WarmUp | None:
    """Start what code generation does once per process and can do before the tasks exist
    (`inductor.WarmUp`), for `compile_program` to wait for."""
    return inductor.WarmUp(device) if codegen == "inductor" else None


def cuts_regions(setting: str | bool, device: torch.device | None) -> bool:
    """Whether Inductor compiles a task of repeated layers as its regions (`regions`), given
    the option `regions` and the model's device. True or False: as the option says. "auto":
    on a CPU, yes: compile time goes to the C++ code of each graph, and regions compile each
    distinct layer once (the middle layers of a deep model cost nothing more). On an
    accelerator, no: there a region is a call of its own to the host, which is what a step
    of small, fast kernels waits on, and the tasks are whole as in `torch.compile(model)`.
    (On an H200, one process, rounds alternating: the example GPT of 4 layers, width 256,
    8 x 128 tokens, took 7.22 ms a step compiled as regions and 6.63 whole, against 6.34
    for `torch.compile`; the host's time in the call, 5.42 against 4.76 ms.)"""
    if isinstance(setting, bool):
        return setting
    return device is None or device.type in ("cpu", "meta")


def prepare(program: RankProgram, codegen: str) -> None:
    """What code generation does to the task graphs of a plan, done when the step is planned,
    so that the plan cache keeps it and a warm compile finds it done: under Inductor, each
    graph's values named by position (`inductor.name_by_position`: rewriting a task's code,
    0.15 s a rank on a GPT of 12 blocks under ZeRO-3)."""
    if codegen == "inductor":
        for task in program.tasks.values():
            inductor.name_by_position(task.graph)


def compile_program(program: RankProgram, codegen: str, dump: DebugDump, stats: CompileStats,
                    time_waits: bool = False, warmed: inductor.WarmUp | None = None,
                    cut_regions: bool = True) -> dict[str, CompiledTask]:
    """Each task of `program` (`prepare`d for `codegen`), compiled; its time and how its code
    was obtained go into `stats`. Under Inductor, collective: every rank compiles its program
    at once (`shared`), each task whole or, with `cut_regions` (`cuts_regions`), as its
    regions (`regions`) where they repeat, each distinct code once; `warmed`: the `warm_up`
    started for it, if any."""
    tasks = list(program.tasks.values())
    if codegen != "inductor":
        compiled: dict[str, CompiledTask] = {}
        for task in tasks:
            with stats.task(task.name, codegen):
                compiled[task.name], source = eager.compile_task(task, time_waits)
            dump.write(f"codegen/{task.name}.py", source)
        return compiled
    if warmed is not None:
        with stats.phase("codegen warm-up"):  # what of it planning did not hide
            warmed.wait()
    # What Inductor compiles: each task whole, or each of its regions.
    units: list[Task] = []
    key_of: dict[str, str] = {}  # each unit's `shared.code_key`, by its name
    cut: dict[str, regions.Regions] = {}
    with stats.phase("codegen regions"):
        for task in tasks:
            task_regions = regions.cut(task.graph) if cut_regions else None
            if task_regions is None:
                units.append(task)
                key_of[task.name] = shared.code_key(task.graph)
                continue
            cut[task.name] = task_regions
            for index, region in enumerate(task_regions.regions):
                units.append(Task(f"{task.name}.r{index}", task.kind, task.stage, region.graph, [], []))
                key_of[units[-1].name] = region.key
    code: dict[str, tuple[CompiledTask, str]] = {}  # by code key: (code, source), shared by repeats

    def compile_one(unit: Task) -> None:
        key = key_of[unit.name]
        if key in code:
            stats.tasks["repeated"] += 1
            return
        with stats.task(unit.name, codegen):
            code[key] = inductor.compile_task(unit)

    with stats.phase("codegen exchange"):
        shares = shared.share(units, [key_of[unit.name] for unit in units])
    shared.compile_shares(shares, compile_one, lambda: stats.phase("codegen wait for peers"))
    compiled = {}
    for task in tasks:
        if task.name in cut:
            names = [f"{task.name}.r{index}" for index in range(len(cut[task.name].regions))]
            run = cut[task.name].runner([code[key_of[name]][0] for name in names])
            if dump.enabled:
                dump.write(f"codegen/{task.name}.py", _regions_source(task.name, [key_of[n] for n in names], code))
        else:
            run, source = code[key_of[task.name]]
            dump.write(f"codegen/{task.name}.py", source)
        # The same code may serve tasks with and without timing: timed around the task.
        compiled[task.name] = inductor.timing_waits(run) if time_waits and inductor.has_waits(task) else run
    return compiled


def _regions_source(task: str, keys: list[str], code: dict[str, tuple[CompiledTask, str]]) -> str:
    """The dump of a task compiled as regions: each region's code, once; a repeat names the first."""
    parts, first = [], {}
    for index, key in enumerate(keys):
        if key in first:
            parts.append(f"# {task} region {index}: same code as region {first[key]}\n")
        else:
            first[key] = index
            parts.append(f"# {task} region {index}\n{code[key][1]}\n")
    return "".join(parts)


__all__ = ["compile_program", "CompiledTask", "cuts_regions", "prepare", "Task", "warm_up"]
