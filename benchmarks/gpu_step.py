"""One device, world 1: piper_fx's step against `torch.compile` of the same model, and where the difference goes.

    python benchmarks/gpu_step.py [--device cuda] [--steps 50] [--rounds 3] [--sides torch_compile,piper_inductor,piper_eager]
                                  [--same-process] [--profile [--trace-dir DIR]]

The example GPT (4 layers, width 256, 8 sequences of 128 tokens, AdamW with
torch's default implementation for the device) trained by each side:
`torch.compile(model)` (Inductor; Triton on a GPU), piper_fx with Inductor
codegen and piper_fx with eager codegen. Each side runs in processes of its
own, twice: first with an empty Inductor cache (its first step is the cold
compile), then again with that cache (the warm compile), the sides in reversed
order the second time. In each process, after warm-up steps, `--rounds` times
`--steps` steps are timed between device synchronisations; a side's step time is
the median of its rounds (both processes'), with the spread (max - min) / median.
Beside it, the host's time in each phase of a step (the call, `loss.backward()`,
`optimizer.step()`, `zero_grad()`; medians over unsynchronised steps: where the
host's total is about the step time, the step waits on the host, not the
device) and, for piper_fx, `last_step_stats()`: its program's wall time, the
runtime's own share and the step's own work around the program. With
`--profile`, the profiler's view of a few steps of each side (its warm process):
the kernels launched and their device time per step, and the host's time by
operator; with `--trace-dir DIR` too, each side's Chrome trace. With
`--same-process`, every side runs in one process instead, their rounds
alternating (the order reversed every round), for step times and host phases
under the same process state and load (no compile times), and each side's rounds
against the `torch.compile` rounds beside them (the median and quartiles of
those ratios, robust to the host's speed moving within a run): on a CPU with a
small model (`--device cpu --width 64 --block 32 --rows 2 --n-layer 2`) the step
is host-bound like the GPU's, which makes it a proxy for the runtime's own cost
there. A measurement, not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SIDES = ("torch_compile", "piper_inductor", "piper_eager")
WARMUP = 10
PHASES = ("call", "backward", "optimizer", "zero_grad")


class _GcTimes:
    """The garbage collector's collections while active, per generation: (count, seconds). A
    host-bound step pays them, and a full collection's cost grows with every object the
    process keeps (compiled graphs, plans), so a side's rounds can be slower than its median step."""

    def __init__(self) -> None:
        self.times = {0: [0, 0.0], 1: [0, 0.0], 2: [0, 0.0]}
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            entry = self.times[info["generation"]]
            entry[0] += 1
            entry[1] += time.perf_counter() - self._started

    def __enter__(self) -> "_GcTimes":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def _side(side: str, args: argparse.Namespace):
    """One side's training step, `train_step(i, phases=None)` (appending its host phases'
    seconds to `phases`; returns the loss), and a device synchronisation, `sync()`."""
    import torch

    import piper_fx
    from examples.gpt import GPT, GPTConfig

    device = torch.device(args.device)
    cfg = GPTConfig(vocab_size=65, block_size=args.block, n_layer=args.n_layer, n_head=4, n_embd=args.width)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if side == "torch_compile":
        step = torch.compile(model)
    else:
        options = {"codegen": side.removeprefix("piper_")}
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(8):
        x = torch.randint(0, cfg.vocab_size, (args.rows, cfg.block_size), generator=g)
        batches.append((x.to(device), torch.roll(x, -1, dims=1).to(device)))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def train_step(i: int, phases: list | None = None):
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        loss = step(x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        opt.zero_grad()
        t4 = time.perf_counter()
        if phases is not None:
            phases.append((t1 - t0, t2 - t1, t3 - t2, t4 - t3))
        return loss

    return train_step, sync


def _same_process(args: argparse.Namespace) -> int:
    """Every side in this one process, their rounds alternating (the order reversed every
    round), so that both see the same process, caches and load: the step time of each
    (median of its rounds, with their spread), its host phases and its ratio to
    `torch.compile`'s. No compile times (each side compiles in a process warmed by the others)."""
    import torch

    sides = args.sides.split(",")
    steps = {side: _side(side, args) for side in sides}
    # Every side trains its own copy of the same model on the same batches in the same order:
    # their losses agree to fp32 tolerance over the warm-up steps (and drift apart later, if
    # the training is chaotic, by as little as the kernels' summation orders differ).
    losses: dict[str, list[float]] = {}
    for side, (train_step, sync) in steps.items():
        losses[side] = [train_step(i).item() for i in range(WARMUP)]
        sync()
    rounds: dict[str, list[float]] = {side: [] for side in sides}
    phases: dict[str, list] = {side: [] for side in sides}
    collections = {side: _GcTimes() for side in sides}  # those that ran during each side's rounds
    for r in range(args.rounds):
        for side in (sides if r % 2 == 0 else sides[::-1]):
            train_step, sync = steps[side]
            sync()
            with collections[side]:
                start = time.perf_counter()
                for i in range(args.steps):
                    train_step(WARMUP + i, phases[side])
                sync()
                rounds[side].append((time.perf_counter() - start) / args.steps)
    final = {side: train_step(WARMUP + args.steps).item() for side, (train_step, _) in steps.items()}
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {args.device} ({name}), world 1, GPT {args.n_layer}x{args.width}, "
          f"{args.rows} x {args.block} tokens, AdamW; one process, {args.rounds} alternating rounds of "
          f"{args.steps} steps per side")
    first = sides[0]
    for side in sides:
        drift = max(abs(a - b) / abs(b) for a, b in zip(losses[side], losses[first]))
        print(f"{side}: losses of the {WARMUP} warm-up steps {losses[side][0]:.6f} .. {losses[side][-1]:.6f} "
              f"(largest relative difference to {first}'s: {drift:.2e}); after every round: {final[side]:.6f}")
    # Beside each round's mean step, the median step's host time (the phases' sum): on a CPU,
    # where the host's time is the step's, it is robust to the bursts of load that move a
    # round's mean; on a GPU the rounds' time is the step's.
    print(f"{'side':16s} {'step ms':>8s} {'spread':>7s} {'/ torch':>8s} {'host ms':>8s} {'/ torch':>8s} "
          + "".join(f"{'host ' + p:>15s}" for p in PHASES))
    step = {side: statistics.median(rounds[side]) for side in sides}
    host = {side: statistics.median(sum(p) for p in phases[side]) for side in sides}
    for side in sides:
        spread = (max(rounds[side]) - min(rounds[side])) / step[side]
        ratios = [times[side] / times["torch_compile"] if "torch_compile" in times else float("nan")
                  for times in (step, host)]
        print(f"{side:16s} {step[side] * 1e3:8.3f} {spread:7.1%} {ratios[0]:8.3f} {host[side] * 1e3:8.3f} "
              f"{ratios[1]:8.3f} " + "".join(f"{statistics.median(p[k] for p in phases[side]) * 1e3:15.3f}"
                                            for k in range(len(PHASES))))
    # The host's speed moves within a run (the rounds' spreads): each round against the
    # torch.compile round beside it (the same round index, run back to back) is robust to it.
    if "torch_compile" in sides:
        for side in sides:
            if side != "torch_compile":
                paired = sorted(a / b for a, b in zip(rounds[side], rounds["torch_compile"]))
                quartiles = statistics.quantiles(paired, n=4) if len(paired) > 1 else paired * 3
                print(f"{side} / torch_compile, round by round beside each other: median {quartiles[1]:.3f}, "
                      f"quartiles {quartiles[0]:.3f} .. {quartiles[2]:.3f} ({len(paired)} pairs)")
    print(f"{len(gc.get_objects())} objects tracked; garbage collections during each side's rounds (count, ms): "
          + "; ".join(f"{side} " + ", ".join(f"gen{g} {n} {t * 1e3:.1f}" for g, (n, t) in collections[side].times.items())
                      for side in sides))
    for side in sides:
        if side.startswith("piper"):
            train_step, sync = steps[side]
            train_step(0)
            sync()
            print(f"{side} last_step_stats: " + _render_stats(_piper_stats()))
    if args.profile:
        for side in sides:
            train_step, sync = steps[side]
            print(f"{side} profile ({PROFILED_STEPS} steps): " + _profile(side, train_step, sync, 0, args))
    return 0


# What each piper_fx side reports of `last_step_stats()`.
PIPER_STATS = ("step_s", "runtime_s", "runtime_fraction", "step_call_s", "overhead_fraction", "instructions")


def _piper_stats() -> dict:
    import piper_fx

    stats = piper_fx.last_step_stats()
    return {key: stats[key] for key in PIPER_STATS}


def _render_stats(stats: dict) -> str:
    return ", ".join(f"{k}={v * 1e3:.3f} ms" if k.endswith("_s") else f"{k}={v:.3g}" for k, v in stats.items())


def _worker(args: argparse.Namespace) -> dict:
    train_step, sync = _side(args.side, args)
    sync()
    start = time.perf_counter()
    train_step(0)
    sync()
    result = {"side": args.side, "compile_s": time.perf_counter() - start}
    for i in range(1, WARMUP):
        train_step(i)
    sync()
    rounds, phases, i = [], [], WARMUP
    with _GcTimes() as collections:
        for _ in range(args.rounds):
            sync()
            start = time.perf_counter()
            for _ in range(args.steps):
                train_step(i, phases)
                i += 1
            sync()
            rounds.append((time.perf_counter() - start) / args.steps)
    result["rounds_s"] = rounds
    result["host_s"] = {phase: statistics.median(p[k] for p in phases) for k, phase in enumerate(PHASES)}
    result["host_step_s"] = {"median": statistics.median(map(sum, phases)), "mean": statistics.mean(map(sum, phases)),
                             "max": max(map(sum, phases))}
    result["gc"] = {"objects": len(gc.get_objects()), "collections": {f"gen{g}": v for g, v in collections.times.items()}}
    loss = train_step(i)
    result["loss"] = loss.item()
    if args.side.startswith("piper"):
        result["piper"] = _piper_stats()
    if args.profile:
        result["profile"] = _profile(args.side, train_step, sync, i + 1, args)
    return result


PROFILED_STEPS = 5


def _profile(side: str, train_step, sync, first: int, args: argparse.Namespace) -> str:
    """The profiler's view of `PROFILED_STEPS` steps of one side: per step, the kernels
    launched and the device's time in them, then the host's time by operator. With
    `--trace-dir`, the Chrome trace too (`<side>.json`), to read the host's gaps between
    launches."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda" else [])
    sync()
    with profile(activities=activities) as prof:
        for k in range(PROFILED_STEPS):
            train_step(first + k)
        sync()
    if args.trace_dir:
        os.makedirs(args.trace_dir, exist_ok=True)
        prof.export_chrome_trace(os.path.join(args.trace_dir, f"{side}.json"))
    events = prof.key_averages()
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC"))
    device_us = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    return (f"per step: {launches / PROFILED_STEPS:.0f} kernel launches, {device_us / PROFILED_STEPS / 1e3:.3f} ms "
            f"of kernels\n" + events.table(sort_by="self_cpu_time_total", row_limit=30))


def _spawn(side: str, cache: str, args: argparse.Namespace, profile: bool) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PYTHONUNBUFFERED="1")
    command = [sys.executable, __file__, "--worker", side, "--device", args.device, "--steps", str(args.steps),
               "--rounds", str(args.rounds), "--n-layer", str(args.n_layer), "--width", str(args.width),
               "--block", str(args.block), "--rows", str(args.rows)] + (["--profile"] if profile else []) \
        + (["--trace-dir", args.trace_dir] if profile and args.trace_dir else [])
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"{side}: exit {done.returncode}\n{done.stdout}{done.stderr[-6000:]}", flush=True)
        return {"side": side, "error": done.returncode}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="default: cuda if torch sees a GPU, else cpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--profile", action="store_true", help="print the profiler's view of a few steps of "
                        "each side (its warm process; with --same-process, after the rounds)")
    parser.add_argument("--trace-dir", default=None, help="with --profile, write each side's Chrome trace "
                        "there (<side>.json)")
    parser.add_argument("--same-process", action="store_true", help="run every side in one process, "
                        "alternating rounds (step times and host phases only; no compile times)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        import torch  # noqa: F401  (after the parent set the cache directory)
        args.side = args.worker
        print(json.dumps(_worker(args)))
        return 0
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.same_process:
        return _same_process(args)
    sides = args.sides.split(",")
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {args.device} ({name}), world 1, GPT {args.n_layer}x{args.width}, "
          f"{args.rows} x {args.block} tokens, AdamW; {args.rounds} rounds of {args.steps} steps per process, "
          f"two processes per side (cold, then warm Inductor cache)", flush=True)
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    with tempfile.TemporaryDirectory() as tmp:
        for attempt, order in enumerate((sides, sides[::-1])):
            for side in order:
                profile = args.profile and attempt == 1
                runs[side].append(_spawn(side, os.path.join(tmp, side), args, profile))
    print(f"{'side':16s} {'step ms':>8s} {'spread':>7s} {'/ torch':>8s} {'cold s':>7s} {'warm s':>7s} "
          + "".join(f"{'host ' + p:>14s}" for p in PHASES) + f" {'loss':>8s}")
    base = None
    for side, results in runs.items():
        if any("error" in r for r in results):
            print(f"{side:16s} failed")
            continue
        rounds = [s for r in results for s in r["rounds_s"]]
        step = statistics.median(rounds)
        base = step if side == "torch_compile" else base
        host = results[-1]["host_s"]
        print(f"{side:16s} {step * 1e3:8.2f} {(max(rounds) - min(rounds)) / step:7.1%} "
              f"{step / base if base else float('nan'):8.2f} {results[0]['compile_s']:7.1f} "
              f"{results[1]['compile_s']:7.1f} " + "".join(f"{host[p] * 1e3:14.3f}" for p in PHASES)
              + f" {results[-1]['loss']:8.4f}")
    for side, results in runs.items():
        for r in results:
            if "error" in r:
                continue
            host, collected = r["host_step_s"], r["gc"]
            print(f"{side} rounds ms: " + ", ".join(f"{t * 1e3:.2f}" for t in r["rounds_s"])
                  + f"; host step ms: median {host['median'] * 1e3:.3f}, mean {host['mean'] * 1e3:.3f}, "
                  f"max {host['max'] * 1e3:.1f}; garbage collections over the rounds (count, ms): "
                  + ", ".join(f"{g} {n} {t * 1e3:.1f}" for g, (n, t) in collected["collections"].items())
                  + f"; {collected['objects']} objects tracked")
        for r in results:
            if "piper" in r:
                print(f"{side} last_step_stats: " + _render_stats(r["piper"]))
            if "profile" in r:
                print(f"{side} profile ({PROFILED_STEPS} steps): {r['profile']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
