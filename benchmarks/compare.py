"""Step time of piper_fx against PyTorch's own DDP and FSDP2, side by side in one run.

    python benchmarks/compare.py [--nproc 2] [--steps 10] [--codegen inductor|eager]

Spawns the ranks (gloo on CPU), trains the example GPT with each pair on the
same data from the same initial weights, and prints median step times, the
piper_fx / native ratio, and the loss after the last step (which must match).
Pairs: ZeRO-0 vs DDP (with torch.compile), ZeRO-3 vs FSDP2 `fully_shard`.
A measurement, not a test: nothing here asserts a time.
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

CFG = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64)
WARMUP = 3


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (rows, CFG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def train(make_step, steps: int, rank: int, world: int, per_rank: int):
    """Median step time (s) after warm-up, and the last loss averaged over ranks."""
    torch.manual_seed(0)
    model = GPT(CFG)
    step, params = make_step(model)
    opt = torch.optim.AdamW(params, lr=1e-3)
    times, loss = [], None
    for i in range(WARMUP + steps):
        x, y = batch(i, per_rank * world)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        dist.barrier()
        start = time.perf_counter()
        loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    loss = loss.detach().clone()
    dist.all_reduce(loss)
    return statistics.median(times), loss.item() / world


def piper(options):
    def make(model):
        piper_fx.prepare(model, options)
        return torch.compile(model, backend="piper", options=options), model.parameters()
    return make


def ddp_compiled(model):
    from torch.nn.parallel import DistributedDataParallel
    wrapped = DistributedDataParallel(model)
    return torch.compile(wrapped), wrapped.parameters()


def fsdp2(model):
    from torch.distributed.fsdp import fully_shard
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, model.parameters()


def run(rank: int, world: int, init_file: str, args, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    pairs = [
        ("zero=0 vs DDP+compile", piper({"zero": 0, "codegen": args.codegen}), ddp_compiled),
        ("zero=3 vs FSDP2", piper({"zero": 3, "codegen": args.codegen}), fsdp2),
    ]
    rows = []
    for name, ours, theirs in pairs:
        ours_time, ours_loss = train(ours, args.steps, rank, world, args.per_rank_batch)
        theirs_time, theirs_loss = train(theirs, args.steps, rank, world, args.per_rank_batch)
        rows.append((name, ours_time, theirs_time, ours_loss, theirs_loss))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--per-rank-batch", type=int, default=8)
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
    tokens = args.per_rank_batch * args.nproc * CFG.block_size
    print(f"{args.nproc} CPU ranks (gloo), GPT {CFG.n_layer}x{CFG.n_embd}, {tokens} tokens/step, "
          f"median of {args.steps} steps after {WARMUP} warm-up, piper_fx codegen {args.codegen}")
    print(f"{'pair':<24} {'piper ms':>9} {'native ms':>10} {'ratio':>6} {'piper tok/s':>12} "
          f"{'piper loss':>11} {'native loss':>12}")
    for name, ours, theirs, ours_loss, theirs_loss in rows:
        print(f"{name:<24} {ours * 1e3:9.1f} {theirs * 1e3:10.1f} {ours / theirs:6.2f} {tokens / ours:12.0f} "
              f"{ours_loss:11.5f} {theirs_loss:12.5f}")


if __name__ == "__main__":
    main()
