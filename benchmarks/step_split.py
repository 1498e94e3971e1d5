"""Where one rank's data-parallel step goes: piper_fx ZeRO-0 against DDP + torch.compile, phase by phase.

    python benchmarks/step_split.py [--nproc 2] [--steps 150] [--n-layer 2] [--n-embd 64] [--skip-guards] [--alone]

Builds both sides as `compare.py` does (the example GPT, AdamW fused unless `--adamw` says otherwise) in
the same ranks and alternates their steps one by one, then prints, per side,
the median over the steps (after 5 warm-up steps) of each phase of rank 0's
step: the model call, `loss.backward()`, `optimizer.step()`, `zero_grad()`
and their total; for piper_fx also its program's own time inside the call
(`last_step_stats()["step_s"]`; the rest of the call is Dynamo's entry and
guards and the step's set-up) and the step's own work around the program, in
the call and in `loss.backward()` (`step_call_s`). DDP's call is its forward;
its backward holds the gradient all-reduces. `--n-layer` sets the model's depth
(12 parameters a block), to see what grows with the parameters, and `--n-embd` its
width, to see what grows with the compute. `--alone` makes each rank a world of its
own, with the same batch per rank and nothing to reduce, and compares piper_fx with
`torch.compile(model)`: the compute of the step, beside the other ranks' as in the
data-parallel run, without its communication. A measurement,
not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor_cache"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import compare  # noqa: E402
import piper_fx  # noqa: E402

WARMUP = 5
PHASES = ("call", "backward", "optimizer", "zero_grad", "total")


def run(rank: int, world: int, init_file: str, steps: int, per_rank: int, skip_guards: bool, n_layer: int,
        n_embd: int, adamw: str, alone: bool) -> None:
    if alone:  # a world of one per rank
        dist.init_process_group("gloo", init_method=f"file://{init_file}.{rank}", rank=0, world_size=1,
                                timeout=timedelta(seconds=300))
    else:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    makers = {"piper_fx zero=0": compare.piper({"zero": 0, "codegen": "inductor"}),
              **({"torch.compile": lambda model: compare.Built(torch.compile(model), model.parameters())} if alone
                 else {"DDP + compile": compare.ddp(True)})}
    cfg = dataclasses.replace(compare.CFG, n_layer=n_layer, n_embd=n_embd)
    sides = {}
    for name, make in makers.items():
        torch.manual_seed(0)
        built = make(compare.GPT(cfg))
        params = list(built.params)
        sides[name] = (built.step, built.optimizer(params, adamw))
    times = {name: {phase: [] for phase in (*PHASES, "program", "own")} for name in sides}
    for i in range(WARMUP + steps):
        x, y = compare.batch(i, per_rank * world)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        for name in (list(sides) if i % 2 else list(sides)[::-1]):
            step, opt = sides[name]
            dist.barrier()
            skip = skip_guards and i >= WARMUP and name.startswith("piper_fx")
            t0 = time.perf_counter()
            with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip):
                loss = step(x, y)
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            t3 = time.perf_counter()
            opt.zero_grad()
            t4 = time.perf_counter()
            if i < WARMUP:
                continue
            for phase, seconds in zip(PHASES, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t4 - t0)):
                times[name][phase].append(seconds)
            if name.startswith("piper_fx"):
                stats = piper_fx.last_step_stats()
                times[name]["program"].append(stats["step_s"])
                times[name]["own"].append(stats["step_call_s"])
    if rank == 0:
        print(f"{world} CPU ranks (gloo{', each a world of its own' if alone else ''}), "
              f"GPT {cfg.n_layer}x{cfg.n_embd} ({len(params)} parameters), "
              f"{per_rank} sequences per rank, AdamW {adamw}, rank 0's phases, median of {steps} alternating steps, ms"
              + (", piper_fx's Dynamo guards skipped after warm-up" if skip_guards else ""))
        print(f"{'side':18s}" + "".join(f"{phase:>11s}" for phase in (*PHASES, "program", "own")))
        for name, phases in times.items():
            print(f"{name:18s}" + "".join(f"{statistics.median(v) * 1e3:11.2f}" if v else f"{'':>11s}"
                                          for v in phases.values()))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--per-rank-batch", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=compare.CFG.n_layer)
    parser.add_argument("--n-embd", type=int, default=compare.CFG.n_embd)
    parser.add_argument("--adamw", choices=compare.ADAMW_IMPLEMENTATIONS, default="fused")
    parser.add_argument("--skip-guards", action="store_true",
                        help="after the warm-up, call piper_fx's step under torch.compiler.set_stance("
                             "skip_guard_eval_unsafe=True): how much of its call is Dynamo's guards (DDP's "
                             "compiled frames recompile under that stance)")
    parser.add_argument("--alone", action="store_true",
                        help="each rank a world of its own: the step's compute, against torch.compile(model)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(run, args=(args.nproc, os.path.join(tmp, "rendezvous"), args.steps, args.per_rank_batch,
                               args.skip_guards, args.n_layer, args.n_embd, args.adamw, args.alone),
                 nprocs=args.nproc)


if __name__ == "__main__":
    main()
