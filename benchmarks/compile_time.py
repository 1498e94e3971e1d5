"""First-step (compile) time of piper_fx against PyTorch compiled as torchtitan compiles it, each
compile in fresh processes: cold (an empty Inductor cache directory) and warm (a later run
sharing the directory, as a second run of a training job does).

    python benchmarks/compile_time.py [--nproc 2] [--rounds 3] [--n-layer 2] [--n-embd 64] [--steps 5] [--only zero=0 ...]

Per pair and side: the cold first step once, and the warm first step `--rounds` times, each in
new rank processes (the slowest rank's time, median and spread over rounds), with piper_fx's
`compile_stats` of the last warm run (where the plan came from and how each task's code was
obtained), and then, per side, where rank 0's first step went, cold and in the last warm run,
from Dynamo's own timings of its phases (`DYNAMO_PHASES`): its trace of the frames, the backend
(piper_fx's whole compile, which runs on the step's first call, once Dynamo's compile of the
frame is done; AOTAutograd and Inductor for the native side), Inductor within it
(and a backward compiled lazily, outside it), building the guards, and what the step spent
outside Dynamo's compiles (running it and the first optimizer step, and the native side's
eager parts). Beside them, each side's RSS, the largest rank's: its peak over the compile and
`--steps` more steps, and in brackets what it still held after them (median over the warm runs;
a training job's steady state takes a few hundred steps to reach, `--steps 300`):
memory measured in processes of its own, so neither side's count holds the other's (in
`compare.py` both sides share each process). The pairs and models are `compare.py`'s (the example GPT, 8 sequences per rank;
`--n-layer` and `--n-embd` set the data-parallel pairs' depth and width, as there);
the native side is the compiled one (DDP around a compiled model, FSDP2 with each block
`.compile()`d, compiled pipeline stages). A measurement, not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch.multiprocessing as mp  # noqa: E402

import compare  # noqa: E402  (also puts the repository on the path)

PER_RANK = 8
STEPS = 5  # steps after the first, within the peak RSS (`--steps`)
# Where a first step goes: Dynamo's timings (seconds per phase, summed over the process's
# frames), by the name this table gives them. "Dynamo" is each frame's whole compile.
DYNAMO_PHASES = {"Dynamo trace": "bytecode_tracing", "backend": "OutputGraph.call_user_compiler",
                 "Inductor": "compile_fx_inner", "guards": "build_guards", "Dynamo": "_compile.compile_inner"}


def _pairs(world: int, cfg: compare.GPTConfig = compare.CFG) -> dict:
    """name -> (piper_fx's maker, the native compiled maker, model config, data-parallel ranks);
    `cfg`: the data-parallel pairs' model."""
    pipeline_cfg = compare.GPTConfig(vocab_size=compare.CFG.vocab_size, block_size=compare.CFG.block_size,
                                     n_layer=world, n_head=compare.CFG.n_head, n_embd=compare.CFG.n_embd,
                                     tied_embeddings=False)
    return {
        "zero=0 vs DDP": (compare.piper({"zero": 0}), compare.ddp(True), cfg, world),
        "zero=3 vs FSDP2": (compare.piper({"zero": 3}), compare.fsdp2(True, True), cfg, world),
        "1f1b vs pipelining": (compare.piper_pipeline("1f1b", 2 * world, "inductor"),
                               compare.pipelining("1f1b", 2 * world, True), pipeline_cfg, 1),
    }


def _first_step(rank: int, world: int, init_file: str, cache_dir: str, pair: str, side: int, cfg, steps: int,
                results) -> None:
    """One rank: build `pair`'s side, time its first step (barrier to barrier), take `steps`
    more, and report with its RSS."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import torch
    import torch.distributed as dist

    import piper_fx
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    seconds = _train(rank, world, pair, side, cfg, steps)
    # The side's model is gone before its process group: DDP's reducer freed after
    # `destroy_process_group` can hang in the group's destructor at exit.
    gc.collect()
    everyone = [None] * world
    dist.all_gather_object(everyone, (seconds, compare._peak_rss_mb(), compare._peak_rss_mb("VmRSS")))
    if rank == 0:
        from torch._dynamo.utils import compilation_time_metrics  # no public accessor
        phases = {name: sum(compilation_time_metrics.get(key, ())) for name, key in DYNAMO_PHASES.items()}
        phases["outside"] = seconds - phases.pop("Dynamo")
        if side == 0:  # piper_fx plans and compiles on the step's first call, after Dynamo's compile
            compiled_s = piper_fx.last_compile_stats()["total_s"]
            phases["backend"] += compiled_s
            phases["outside"] -= compiled_s
        results.put((max(s for s, _, _ in everyone), (max(p for _, p, _ in everyone), max(h for _, _, h in everyone)),
                     piper_fx.last_compile_stats().get("summary") if side == 0 else None, phases))
    dist.destroy_process_group()


def _train(rank: int, world: int, pair: str, side: int, cfg, steps: int) -> float:
    """Build `pair`'s side and train it `1 + steps` steps; the first step's seconds."""
    import torch
    import torch.distributed as dist

    entry = _pairs(world, cfg)[pair]
    make, cfg, dp = entry[side], entry[2], entry[3]
    torch.manual_seed(0)
    model = compare.GPT(cfg)
    built = make(model)
    step, params = built.step, built.params
    opt = torch.optim.AdamW(list(params), lr=1e-3, foreach=True)
    seconds = 0.0
    for i in range(1 + steps):
        x, y = compare.batch(i, PER_RANK * world)
        x, y = x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp]
        if i == 0:
            dist.barrier()
            start = time.perf_counter()
        loss = step(x, y)
        if loss.requires_grad:
            loss.backward()
        opt.step()
        if i == 0:
            seconds = time.perf_counter() - start
        opt.zero_grad()
    return seconds


def _run(world: int, cache_dir: str, pair: str, side: int, cfg, steps: int
         ) -> tuple[float, tuple[float, float], str | None, dict]:
    """The first step of `pair`'s `side` (0: piper_fx, 1: native) in `world` new processes:
    its time, the largest rank's RSS in MB (peak, held after the steps), piper_fx's
    compile summary, and where rank 0's first step went (`DYNAMO_PHASES`, and `outside`)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=_first_step, args=(r, world, os.path.join(tmp, "rdv"), cache_dir, pair, side, cfg,
                                                       steps, results)) for r in range(world)]
        for p in procs:
            p.start()
        result = compare._results_or_failure(results, procs)
        for p in procs:
            p.join()
    return result


def _rss(sides: list[tuple[float, float]]) -> str:
    """Peak (held) RSS of piper_fx / native, and their ratios."""
    (peak, held), (native_peak, native_held) = sides
    return (f"{peak:5.0f} ({held:3.0f}) / {native_peak:5.0f} ({native_held:3.0f}) "
            f"{peak / native_peak:5.2f} ({held / native_held:4.2f})")


def _phases(runs: list[dict]) -> str:
    """Cold and last warm seconds of each phase of rank 0's first step, piper_fx | native."""
    (cold, native_cold), (warm, native_warm) = runs
    return "  ".join(f"{name} {cold[name]:.2f}|{native_cold[name]:.2f}; {warm[name]:.2f}|{native_warm[name]:.2f}"
                     for name in cold)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="warm runs per side")
    parser.add_argument("--only", nargs="*", help="run only the pairs whose name contains one of these words")
    parser.add_argument("--n-layer", type=int, default=compare.CFG.n_layer, help="the data-parallel pairs' depth")
    parser.add_argument("--n-embd", type=int, default=compare.CFG.n_embd, help="the data-parallel pairs' width")
    parser.add_argument("--steps", type=int, default=STEPS, help="steps after the first, within the peak RSS")
    args = parser.parse_args()
    cfg = dataclasses.replace(compare.CFG, n_layer=args.n_layer, n_embd=args.n_embd)
    print(f"{args.nproc} CPU ranks (gloo), data-parallel GPT {args.n_layer}x{args.n_embd}, first step (compile + one step) in new processes; cold: empty "
          f"Inductor cache directory, warm: a later run sharing it (median of {args.rounds} (spread)); "
          f"RSS: the largest rank's peak over the compile and {args.steps + 1} steps (and held after them); ratio = "
          f"piper / native compiled")
    print(f"{'pair':<20} {'cold s piper/native':>20} {'ratio':>5} {'warm s piper (spread)':>22} "
          f"{'warm s native (spread)':>23} {'ratio':>5} {'cold RSS MB peak (held)':>27} {'ratio':>11} "
          f"{'warm RSS MB peak (held)':>27} {'ratio':>11}  piper's last warm compile_stats")
    phases = {}  # pair -> ((piper cold, native cold), (piper warm, native warm)), each phase's seconds
    with tempfile.TemporaryDirectory() as tmp:
        for index, pair in enumerate(_pairs(args.nproc, cfg)):
            if args.only and not any(word in pair for word in args.only):
                continue
            cold, warm, cold_rss, warm_rss, summary, split = [], [], [], [], None, ([], [])
            for side in (0, 1):
                cache_dir = os.path.join(tmp, f"pair{index}_side{side}")
                seconds, rss, _, cold_phases = _run(args.nproc, cache_dir, pair, side, cfg, args.steps)
                cold.append(seconds)
                cold_rss.append(rss)
                runs = [_run(args.nproc, cache_dir, pair, side, cfg, args.steps) for _ in range(args.rounds)]
                warm.append([seconds for seconds, _, _, _ in runs])
                warm_rss.append(tuple(statistics.median(rss[k] for _, rss, _, _ in runs) for k in (0, 1)))
                summary = summary or runs[-1][2]
                split[0].append(cold_phases)
                split[1].append(runs[-1][3])
            phases[pair] = split
            medians = [statistics.median(w) for w in warm]
            spreads = [(max(w) - min(w)) / statistics.median(w) for w in warm]
            print(f"{pair:<20} {cold[0]:9.1f}/{cold[1]:<10.1f} {cold[0] / cold[1]:5.2f} "
                  f"{medians[0]:14.2f} ({spreads[0]:3.0%}) {medians[1]:15.2f} ({spreads[1]:3.0%}) "
                  f"{medians[0] / medians[1]:5.2f} {_rss(cold_rss)} {_rss(warm_rss)}  {summary}", flush=True)
    print("\nwhere rank 0's first step went, s, piper_fx|native, cold; last warm run (Dynamo's timings: its trace, "
          "the backend, Inductor (within it, or a lazy backward outside it), the guards; outside: the rest of the "
          "step, outside Dynamo's compiles)")
    for pair, runs in phases.items():
        print(f"{pair:<20} {_phases(runs)}")


if __name__ == "__main__":
    main()
