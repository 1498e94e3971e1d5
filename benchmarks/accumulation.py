"""Gradient accumulation without communication: a window of calls, piper_fx against DDP and FSDP2.

    python benchmarks/accumulation.py [--nproc 2] [--calls 4] [--windows 5] [--rounds 3]
                                      [--n-layer 4] [--n-embd 128] [--codegen inductor|eager]

Spawns the ranks (gloo on CPU) and trains the example GPT in windows of `--calls`
calls, each call's loss divided by their number, the optimizer stepped once a
window (AdamW, fused). Sides, per pair: piper_fx with all calls but the last in
`piper_fx.no_sync`; piper_fx reducing at every call (no window), to show what a
window saves; and PyTorch compiled as torchtitan compiles it with its own way of
holding back the reductions (DDP around a compiled model, in `model.no_sync()`;
FSDP2 per block, each block `.compile()`d, with `set_requires_gradient_sync(False)`).
The sides' windows alternate, in an order reversed every round; each side's time
is the median over rounds of each round's median window, with the spread of the
rounds ((max - min) / median), and the loss of the last window's last call
averaged over ranks (which must match). A measurement, not a test.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor_cache"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import piper_fx  # noqa: E402
from compare import CFG, adamw, batch, ddp, fsdp2, piper, spawn_ranks  # noqa: E402
from examples.gpt import GPT  # noqa: E402


def piper_window(step):
    return piper_fx.no_sync(step)


def ddp_window(step):
    return step._orig_mod.no_sync()  # the compiled model's DDP module


@contextlib.contextmanager
def fsdp2_window(model):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class _Side:
    """One side on this rank: its model, step, optimizer and how it holds back its reductions
    (None: it reduces at every call)."""

    def __init__(self, make, window, cfg, rank: int, world: int, per_rank: int, calls: int):
        torch.manual_seed(0)
        model = GPT(cfg)
        built = make(model)
        self.step, self.params = built.step, list(built.params)
        self.opt = adamw(self.params, "fused")
        self.window = (lambda: window(model if window is fsdp2_window else self.step)) if window else None
        self.rank, self.world, self.per_rank, self.calls = rank, world, per_rank, calls
        self.loss = None

    def run(self, w: int) -> float:
        """Window `w`, timed between barriers."""
        dist.barrier()
        start = time.perf_counter()
        for call in range(self.calls):
            x, y = batch(w * self.calls + call, self.per_rank * self.world)
            x, y = x.chunk(self.world)[self.rank], y.chunk(self.world)[self.rank]
            held = self.window is not None and call < self.calls - 1
            with self.window() if held else contextlib.nullcontext():
                loss = self.step(x, y)
                (loss / self.calls).backward()
        self.opt.step()
        self.opt.zero_grad()
        self.loss = loss.detach()
        return time.perf_counter() - start


def run(rank: int, world: int, init_file: str, args, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    pairs = [
        ("zero=0 vs DDP", [("piper no_sync", piper({"zero": 0, "codegen": args.codegen}), piper_window),
                           ("piper every call", piper({"zero": 0, "codegen": args.codegen}), None),
                           ("DDP + compile no_sync", ddp(True), ddp_window)]),
        ("zero=3 vs FSDP2", [("piper no_sync", piper({"zero": 3, "codegen": args.codegen}), piper_window),
                             ("piper every call", piper({"zero": 3, "codegen": args.codegen}), None),
                             ("FSDP2 + compile no sync", fsdp2(True, True), fsdp2_window)]),
    ]
    rows = []
    for name, sides in pairs:
        torch._dynamo.reset()
        built = [(label, _Side(make, window, args.cfg, rank, world, args.per_rank_batch, args.calls))
                 for label, make, window in sides]
        for _, side in built:  # compile (both programs of a window) and warm up
            side.run(0)
            side.run(1)
        medians: list[list[float]] = [[] for _ in built]
        w = 2
        for r in range(args.rounds):
            order = list(enumerate(built)) if r % 2 == 0 else list(enumerate(built))[::-1]
            times: list[list[float]] = [[] for _ in built]
            for _ in range(args.windows):
                for index, (_, side) in order:
                    times[index].append(side.run(w))
                w += 1
            for index in range(len(built)):
                medians[index].append(statistics.median(times[index]))
        measured = []
        for (label, side), rounds_s in zip(built, medians):
            loss = side.loss.clone()
            dist.all_reduce(loss)
            window_s = statistics.median(rounds_s)
            measured.append({"label": label, "window_s": window_s, "spread": (max(rounds_s) - min(rounds_s)) / window_s,
                             "loss": loss.item() / world})
        everyone: list = [None] * world
        dist.all_gather_object(everyone, measured)
        slowest = [{**m, "window_s": max(e[i]["window_s"] for e in everyone)} for i, m in enumerate(measured)]
        rows.append((name, slowest))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--calls", type=int, default=4, help="calls a window (an optimizer step)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-rank-batch", type=int, default=8)
    parser.add_argument("--codegen", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    args = parser.parse_args()
    args.cfg = dataclasses.replace(CFG, n_layer=args.n_layer, n_embd=args.n_embd)
    rows = spawn_ranks(run, args.nproc, args)
    print(f"{args.nproc} ranks, GPT {args.n_layer}x{args.n_embd}, {args.per_rank_batch} sequences a rank and call, "
          f"{args.calls} calls a window, {args.codegen}; median of {args.rounds} rounds of {args.windows} windows")
    print("| pair | side | ms a window (spread) | / piper no_sync | loss |")
    print("|---|---|---|---|---|")
    for name, sides in rows:
        base = sides[0]["window_s"]
        for side in sides:
            print(f"| {name} | {side['label']} | {side['window_s'] * 1e3:.1f} ({side['spread']:.0%}) | "
                  f"{side['window_s'] / base:.2f} | {side['loss']:.4f} |")


if __name__ == "__main__":
    main()
