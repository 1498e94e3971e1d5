"""Expert parallelism in pipelines: DualPipeV against 1F1B, with the exposed all-to-all time of each.

    python benchmarks/expert_parallel.py [--steps 10] [--codegen inductor|eager] [--microbatches 8]
                                         [--capacity-factor F]

Spawns 4 ranks (gloo on CPU) laid out pp=2 x dp=2 with ep=2, and trains the
MoE GPT (every block's MLP an MoE layer) with the same data and initial
weights under 1F1B, DualPipeV, and DualPipeV without overlap (its F&B pairs
run one half after the other), the three alternating step by step. Prints per
schedule, as medians over ranks and steps: step time and its ratio to 1F1B,
tokens/s, the time blocked on all-to-alls (exposed), the all-to-alls' time in
flight, exposed communication of any kind as a fraction of the step, and the
all-to-all bytes a rank sends per step. `profile` is on for all three (it times
the collectives inside tasks). A measurement, not a test.
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

WARMUP = 2
WORLD = 4
MESH = {"pp": 2, "dp": 2, "ep": 2}
SCHEDULES = {"1f1b": ("1f1b", True), "dualpipev": ("dualpipev", True), "dualpipev, no overlap": ("dualpipev", False)}


def batch(cfg: GPTConfig, step: int, rows: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def build(cfg: GPTConfig, schedule: str, overlap: bool, args) -> tuple:
    torch.manual_seed(0)
    model = GPT(cfg)
    model.block_context = lambda: piper_fx.annotate("PP")
    model.expert_context = lambda: piper_fx.annotate("EP")
    for experts in model.experts():
        piper_fx.mark_experts(experts)
    options = {"mesh": MESH, "codegen": args.codegen, "overlap": overlap, "profile": True,
               "pipeline": {"schedule": schedule, "microbatches": args.microbatches}}
    piper_fx.prepare(model, options)
    return torch.compile(model, backend="piper", options=options), torch.optim.AdamW(model.parameters(), lr=1e-3)


def run(rank: int, init_file: str, args, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=args.n_layer, n_head=4, n_embd=args.n_embd,
                    tied_embeddings=False, n_expert=args.experts, top_k=2, capacity_factor=args.capacity_factor)
    runs = {name: build(cfg, schedule, overlap, args) for name, (schedule, overlap) in SCHEDULES.items()}
    samples = {name: [] for name in SCHEDULES}
    dp_index = rank % MESH["dp"]
    for i in range(WARMUP + args.steps):
        x, y = batch(cfg, i, args.per_rank_batch * MESH["dp"])
        x, y = x.chunk(MESH["dp"])[dp_index], y.chunk(MESH["dp"])[dp_index]
        for name, (step, opt) in runs.items():  # alternating, so drift hits all alike
            dist.barrier()
            start = time.perf_counter()
            loss = step(x, y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            elapsed = time.perf_counter() - start
            stats = piper_fx.last_step_stats()
            trace = piper_fx.last_step_trace()["traceEvents"]
            in_flight = sum(e["dur"] for e in trace if e.get("cat") == "comm" and e["name"] == "all_to_all") / 1e6
            if i >= WARMUP:
                samples[name].append({
                    "step_s": elapsed, "a2a_exposed_s": stats["comm_wait_s_by_kind"].get("all_to_all", 0.0),
                    "a2a_in_flight_s": in_flight, "exposed": stats["exposed_comm_fraction"],
                    "a2a_bytes": stats["comm_bytes"].get("all_to_all", 0), "loss": loss.item()})
    everyone = [None] * WORLD
    dist.all_gather_object(everyone, samples)
    if rank == 0:
        results.put(everyone)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--per-rank-batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-embd", type=int, default=128)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="expert slots per sequence = F * seq * top_k / experts (default: room for every token)")
    parser.add_argument("--codegen", choices=["inductor", "eager"], default="inductor")
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=run, args=(r, os.path.join(tmp, "rdv"), args, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        everyone = results.get(timeout=3600)
        for p in procs:
            p.join()

    def median(name: str, key: str) -> float:
        return statistics.median(s[key] for rank in everyone for s in rank[name])

    tokens = args.per_rank_batch * MESH["dp"] * 64
    capacity = "room for every token" if args.capacity_factor is None else f"capacity factor {args.capacity_factor}"
    print(f"{WORLD} CPU ranks (gloo), pp=2 x dp=2, ep=2; MoE GPT {args.n_layer}x{args.n_embd}, {args.experts} "
          f"experts, top-2, {capacity}; {args.microbatches} microbatches; median over ranks of {args.steps} steps after "
          f"{WARMUP} warm-up, schedules alternating; codegen {args.codegen}")
    print(f"{'schedule':<22} {'step ms':>8} {'vs 1f1b':>8} {'tok/s':>8} {'a2a exposed ms':>15} "
          f"{'a2a in flight ms':>17} {'exposed comm':>13} {'a2a MB/step':>12} {'loss':>8}")
    base = median("1f1b", "step_s")
    for name in SCHEDULES:
        step = median(name, "step_s")
        print(f"{name:<22} {step * 1e3:8.1f} {step / base:8.2f} {tokens / step:8.0f} "
              f"{median(name, 'a2a_exposed_s') * 1e3:15.1f} {median(name, 'a2a_in_flight_s') * 1e3:17.1f} "
              f"{median(name, 'exposed'):13.2f} {median(name, 'a2a_bytes') / 1e6:12.2f} "
              f"{statistics.mean(rank[name][-1]['loss'] for rank in everyone):8.4f}")


if __name__ == "__main__":
    main()
