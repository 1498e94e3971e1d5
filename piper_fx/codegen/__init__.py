"""Code generation: each task of a rank's program -> a boxed callable.

A compiled task takes a list of input tensors (which it may clear, so inputs
die at their last use inside the task) and returns a sequence of outputs.
`eager` runs the FX graph's Python code; `inductor` compiles it with
`compile_fx_inner` (C++ on CPU, Triton on CUDA), whole or as the layers it runs
(`regions`: each distinct layer's code once; `fewest_regions` says which
tasks); collectives stay inside the compiled graphs as functional
collectives. With `time_waits` (option `profile`), the waits of those
collectives are timed as exposed communication (`runtime.timing`). Under
Inductor, ranks that would compile the same task split the work (`shared`):
each distinct task is compiled by one of them.
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


# Under `regions` "auto" on an accelerator, the fewest layers (regions) a task is cut into.
DEEP = 8


def fewest_regions(setting: str | bool, device: torch.device | None) -> int | None:
    """The fewest regions Inductor cuts a task of repeated layers into (`regions.cut`), or
    None: every task whole; from the option `regions` and the model's device. True: every
    task whose layers repeat is cut. False: none is. "auto": on a CPU, as True: compile time
    goes to each graph's C++ code, and regions compile each distinct layer once. On an
    accelerator, only a task of `DEEP` layers or more: there each region is a call of its
    own to the host, which a step of small, fast kernels waits on, while a deep model's
    compile time grows with its layers, and its step is the device's. (On an H200, one
    process, rounds alternating: the example GPT of 4 layers, width 256, 8 x 128 tokens,
    took 7.22 ms a step cut and 6.63 whole, against 6.34 for `torch.compile`, the host's
    time in the call 5.42 against 4.76 ms; 8 layers of width 512 and 16 x 512 tokens, cut,
    took 34.32 ms against `torch.compile`'s 34.03.)"""
    if setting is False:
        return None
    if setting is True or device is None or device.type in ("cpu", "meta"):
        return regions.FEWEST
    return DEEP


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
                    fewest: int | None = regions.FEWEST, together: bool = True) -> dict[str, CompiledTask]:
    """Each task of `program` (`prepare`d for `codegen`), compiled; its time and how its code
    was obtained go into `stats`. Under Inductor, ranks share the work through the cache
    (`shared`): collective if every rank compiles its program `together` (a model's first
    compile), not otherwise. Each task is compiled whole or as its regions (`regions`) where
    they repeat and number at least `fewest` (`fewest_regions`; None: none cut), each
    distinct code once; `warmed`: the `warm_up` started for it, if any."""
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
            task_regions = regions.cut(task.graph, fewest) if fewest is not None else None
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
        shares = shared.share(units, [key_of[unit.name] for unit in units], together)
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


__all__ = ["compile_program", "CompiledTask", "fewest_regions", "prepare", "Task", "warm_up"]
