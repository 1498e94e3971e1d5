"""The runtime's own cost per instruction: a program of no-op tasks run by piper_fx's executor.

    python benchmarks/runtime_overhead.py [--microbatches 8 16 32] [--values 4] [--steps 200]

Each program is a stage's shape under a pipeline schedule without its communication: per
microbatch a forward task that reads the microbatch's input and `--values` parameters and
makes `--values` activations, then per microbatch a backward task that reads them and adds
into `--values` accumulated gradients. Every task is a no-op that hands back preallocated
tensors, so the time per step is the executor's alone: its instruction loop, the values'
store, freeing each value after its last reader, the memory accounting and the timeline.
Printed: microseconds per instruction (median over steps, and the spread between the
quartiles), and the same per value the program stores. One process, no process group.
A measurement, not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.fx as fx  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from piper_fx.ir import RankProgram, Run, Task, TaskKind  # noqa: E402
from piper_fx.runtime.executor import ProgramExecutor  # noqa: E402

SHAPE = (64, 64)


def _graph(inputs: int, outputs: int) -> fx.GraphModule:
    """A task graph reading `inputs` tensors and making `outputs` (what the executor reads of it:
    its placeholders' layouts and its memory peak)."""
    def fn(*args):
        return tuple(args[0] + i for i in range(outputs))
    return make_fx(fn)(*[torch.zeros(SHAPE) for _ in range(inputs)])


def _no_op(outputs: list[torch.Tensor]):
    def run(args: list) -> list[torch.Tensor]:
        args.clear()  # boxed, as compiled tasks are: the inputs are the task's to free
        return outputs
    return run


def program(microbatches: int, values: int) -> tuple[RankProgram, dict, dict]:
    """A stage's program with no-op tasks: (program, compiled tasks, step inputs)."""
    params = [f"w{i}" for i in range(values)]
    activations = [f"h{i}" for i in range(values)]
    grads = [f"g{i}" for i in range(values)]
    forward = Task("F0", TaskKind.F, 0, _graph(1 + values, values), ["x", *params], activations)
    backward = Task("B0", TaskKind.B, 0, _graph(values + values, values), [*activations, *params], grads)
    instructions = [Run("F0", m) for m in range(microbatches)] + [Run("B0", m) for m in range(microbatches)]
    built = RankProgram(rank=0, tasks={"F0": forward, "B0": backward}, instructions=instructions,
                        inputs=["x", *params], per_step={*params, *grads}, accumulated=set(grads),
                        outputs=grads, num_microbatches=microbatches)
    compiled = {"F0": _no_op([torch.zeros(SHAPE) for _ in activations]),
                "B0": _no_op([torch.zeros(SHAPE) for _ in grads])}
    inputs = {**{("x", m): torch.zeros(SHAPE) for m in range(microbatches)},
              **{(name, None): torch.zeros(SHAPE) for name in params}}
    return built, compiled, inputs


def measure(microbatches: int, values: int, steps: int) -> tuple[list[float], int, int]:
    """Seconds per step of the no-op program, its instructions, and the values it stores per step."""
    built, compiled, inputs = program(microbatches, values)
    executor = ProgramExecutor(built, compiled, torch.device("cpu"))
    stored = len(built.instructions) * values  # each task run stores `values` outputs
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        executor.run(dict(inputs), call=0)
        times.append(time.perf_counter() - start)
    return times, len(built.instructions), stored


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--values", type=int, default=4, help="parameters, activations and gradients per task")
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"no-op tasks, {args.values} values per task, median of {args.steps} steps (interquartile spread)")
    print(f"{'microbatches':>12} {'instructions':>12} {'step ms':>8} {'us/instr':>9} {'(spread)':>9} {'us/value':>9}")
    for microbatches in args.microbatches:
        times, instructions, stored = measure(microbatches, args.values, args.steps)
        median = statistics.median(times)
        quartiles = statistics.quantiles(times, n=4)
        print(f"{microbatches:>12} {instructions:>12} {median * 1e3:8.3f} {median / instructions * 1e6:9.1f} "
              f"{(quartiles[2] - quartiles[0]) / median:8.0%} {median / stored * 1e6:9.1f}")


if __name__ == "__main__":
    main()
