"""Overlap on vs off: step time and exposed communication, DDP-style and ZeRO-3, in one run.

    python benchmarks/overlap.py [--nproc 2] [--steps 10] [--codegen inductor|eager] [--n-layer 4]

Spawns the ranks (gloo on CPU) and trains the example GPT with `overlap` on and
off (otherwise the same options, data and initial weights), alternating, and
prints per strategy: median step time, median exposed communication (time
blocked on communication, from `piper_fx.last_step_stats()`) as a fraction of
the step, and the on/off ratios. Small buckets make several collectives per
step, so there is something to overlap. A measurement, not a test.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor_cache"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import piper_fx  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402

WARMUP = 3
STRATEGIES = {"DDP-style (zero=0)": {"zero": 0}, "ZeRO-3": {"zero": 3}}


def batch(cfg: GPTConfig, step: int, rows: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def measure(cfg: GPTConfig, options: dict, steps: int, rank: int, world: int, per_rank: int) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times, exposed, loss = [], [], None
    for i in range(WARMUP + steps):
        x, y = batch(cfg, i, per_rank * world)
        dist.barrier()
        start = time.perf_counter()
        loss = step(x.chunk(world)[rank], y.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
            exposed.append(piper_fx.last_step_stats()["exposed_comm_fraction"])
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return {"step_s": statistics.median(times), "exposed": statistics.median(exposed), "loss": loss.item() / world}


def run(rank: int, world: int, init_file: str, args, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd)
    rows = []
    for name, options in STRATEGIES.items():
        # `profile` times the waits inside tasks (both sides pay its small cost).
        base = {**options, "codegen": args.codegen, "bucket_mb": args.bucket_mb, "profile": True}
        on = measure(cfg, {**base, "overlap": True}, args.steps, rank, world, args.per_rank_batch)
        off = measure(cfg, {**base, "overlap": False}, args.steps, rank, world, args.per_rank_batch)
        rows.append((name, on, off))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--per-rank-batch", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    parser.add_argument("--codegen", choices=["inductor", "eager"], default="inductor")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=run, args=(r, args.nproc, os.path.join(tmp, "rdv"), args, results))
                 for r in range(args.nproc)]
        for p in procs:
            p.start()
        rows = results.get(timeout=1800)
        for p in procs:
            p.join()
    print(f"{args.nproc} CPU ranks (gloo), GPT {args.n_layer}x{args.n_embd}, buckets {args.bucket_mb} MB, "
          f"median of {args.steps} steps after {WARMUP} warm-up, codegen {args.codegen}")
    print(f"{'strategy':<20} {'on ms':>7} {'off ms':>7} {'on/off':>7} {'exposed on':>11} {'exposed off':>12} "
          f"{'on/off':>7} {'loss on':>9} {'loss off':>9}")
    for name, on, off in rows:
        print(f"{name:<20} {on['step_s'] * 1e3:7.1f} {off['step_s'] * 1e3:7.1f} {on['step_s'] / off['step_s']:7.2f} "
              f"{on['exposed']:11.2f} {off['exposed']:12.2f} {on['exposed'] / max(off['exposed'], 1e-9):7.2f} "
              f"{on['loss']:9.5f} {off['loss']:9.5f}")


if __name__ == "__main__":
    main()
