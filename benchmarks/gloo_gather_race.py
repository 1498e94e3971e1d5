"""Two all-gathers in flight at once on one gloo process group corrupt the heap: a
reproduction with functional collectives and nothing of piper_fx.

    python benchmarks/gloo_gather_race.py [--runs 12] [--iters 2000] [--gathers concurrent|one-at-a-time]
                                          [--ops all_gather|reduce_scatter|both|all_to_all|mixed] [--groups 1]

Each run starts 2 gloo ranks in fresh processes. Every iteration issues 1 to 12 small
collectives (16 to 256 floats a rank, of the kinds `--ops` names) on one group, computes a
matmul after each, then waits for all and checks their results; rank 0 sometimes
sleeps a little, so the ranks drift apart. With `--gathers one-at-a-time` each
all-gather is issued only after the previous one was waited for (what
`passes.limit_gathers_in_flight` makes of piper_fx's tasks under gloo). A run that
dies with a signal or a heap error ("malloc(): unaligned tcache chunk detected",
"free(): invalid pointer", a segfault) is counted as crashed. Run it on an otherwise
busy machine (busy loops on its cores, as a loaded CI runner is) to see it sooner.

Seen on this project's machine (2 cores, torch 2.13.0+cpu, 12 runs of 2000 iterations
each, both cores kept busy by other processes: two busy loops, three for the
one-at-a-time runs): all-gathers in flight together (the defaults) crashed
6 runs of 12; `--gathers one-at-a-time --ops both` (all-gathers one at a time,
reduce-scatters in flight beside them) 0 of 12; `--ops all_to_all` 0 of 12. Earlier
variants of the same loop: with reduce-scatters beside the concurrent all-gathers, 4
of 15; reduce-scatters alone, or one collective in flight at a time, 0 of 12. Later
(2026-12-08, two busy loops): `--gathers one-at-a-time --ops mixed --groups 2` (all four
kinds, over two groups of the same ranks, so all-gathers of different groups do run
together) 0 of 6. A measurement, not a test.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from datetime import timedelta


def _rank(rank: int, world: int, init_file: str, args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    fc = torch.ops._c10d_functional
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    # Every group spans both ranks; the iteration's collectives go round them in turn.
    names = [dist.group.WORLD.group_name, *(dist.new_group(list(range(world))).group_name
                                            for _ in range(args.groups - 1))]
    sizes = random.Random(1234)  # the same collectives on every rank
    drift = random.Random(rank)
    x = torch.randn(64, 64)
    for _ in range(args.iters):
        issued = []
        for k in range(sizes.randint(1, 12)):
            n = sizes.choice((16, 64, 128, 256))
            name = names[k % len(names)]
            ops = args.ops
            if ops == "mixed":
                ops = sizes.choice(("all_gather", "reduce_scatter", "all_reduce", "all_to_all"))
            gather = ops == "all_gather" or (ops == "both" and sizes.random() < 0.5)
            if ops == "all_to_all":
                issued.append(("all_to_all", n, k, fc.all_to_all_single(
                    torch.full((n * world,), float(rank + k)), [n] * world, [n] * world, name)))
            elif ops == "all_reduce":
                issued.append(("all_reduce", n, k, fc.all_reduce(torch.full((n,), float(rank + k)), "sum", name)))
            elif gather:
                if args.gathers == "one-at-a-time":  # one at a time on each group
                    for kind, _, j, earlier in reversed(issued):
                        if kind == "all_gather" and names[j % len(names)] == name:
                            fc.wait_tensor(earlier)  # a second wait of it later returns at once
                            break
                issued.append(("all_gather", n, k, fc.all_gather_into_tensor(
                    torch.full((n,), float(rank + k)), world, name)))
            else:
                issued.append(("reduce_scatter", n, k, fc.reduce_scatter_tensor(
                    torch.arange(n * world, dtype=torch.float32) + k, "sum", world, name)))
            if rank == 0 and drift.random() < 0.3:
                time.sleep(drift.random() * 0.006)
            x @ x  # compute while the collectives are in flight
        for kind, n, k, result in issued:
            result = fc.wait_tensor(result)
            if kind == "all_to_all":
                expected = torch.cat([torch.full((n,), float(r + k)) for r in range(world)])
            elif kind == "all_reduce":
                expected = torch.full((n,), float(sum(r + k for r in range(world))))
            elif kind == "all_gather":
                expected = torch.cat([torch.full((n,), float(r + k)) for r in range(world)])
            else:
                expected = world * (torch.arange(n * world, dtype=torch.float32) + k)[rank * n:(rank + 1) * n]
            assert torch.equal(result, expected), (kind, n, k)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=12)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--gathers", choices=("concurrent", "one-at-a-time"), default="concurrent")
    parser.add_argument("--ops", choices=("all_gather", "reduce_scatter", "both", "all_to_all", "mixed"),
                        default="all_gather")
    parser.add_argument("--groups", type=int, default=1)
    args = parser.parse_args()

    import torch
    import torch.multiprocessing as mp

    print(f"torch {torch.__version__}; {args.runs} runs of {args.iters} iterations, ops {args.ops}, "
          f"all-gathers {args.gathers}, over {args.groups} group(s)", flush=True)
    crashed = 0
    for run in range(args.runs):
        with tempfile.TemporaryDirectory() as tmp:
            procs = [mp.get_context("spawn").Process(target=_rank, args=(r, 2, os.path.join(tmp, "rdv"), args))
                     for r in range(2)]
            for proc in procs:
                proc.start()
            for proc in procs:
                proc.join()
            codes = [proc.exitcode for proc in procs]
        # A rank that crashes dies of a signal (negative code); its peer then fails on the lost connection.
        died = [rank for rank, code in enumerate(codes) if code is not None and code < 0]
        crashed += bool(died)
        print(f"run {run + 1}: exit codes {codes}{'  <- crashed' if died else ''}", flush=True)
    print(f"crashed {crashed} of {args.runs} runs")
    sys.exit(0)


if __name__ == "__main__":
    main()
