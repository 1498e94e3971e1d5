"""Step time of piper_fx against PyTorch's own DDP, FSDP2 and pipelining, side by side in one run.

    python benchmarks/compare.py [--nproc 2] [--steps 10] [--rounds 3] [--codegen inductor|eager]
                                 [--n-layer 2] [--n-embd 64] [--only zero=0 ...]

Spawns the ranks (gloo on CPU) and trains the example GPT with each pair on the
same data from the same initial weights. The native side runs twice: compiled
the way torchtitan compiles it (each block `.compile()`d, under `fully_shard`
or inside the pipeline stage; DDP around a compiled model), and eager; the
faster of the two is the baseline, and the table says which. The sides' steps
alternate, in an order that is reversed every round; each side's time is the
median over rounds of each round's median step, with the spread of the rounds
((max - min) / median). Beside it: tokens/s, peak tensor memory (parameters,
gradients, optimizer state, what the library keeps between steps besides them
(DDP's gradient buckets, pipeline stages' receive buffers), and the most a step
allocates above them, from the profiler's memory events, the least of 3
steps), peak RSS per rank, compile time (first step with a
cold Inductor cache, and again in a fresh Dynamo with the cache warm), and the
loss after the last step (which must match); and piper_fx's runtime: the share
of its program spent outside tasks and waits (`last_step_stats()["runtime_fraction"]`),
that time per instruction, and the share with the step's own work around its program
added, in the call and in `loss.backward()` (`overhead_fraction`), each the median
over its timed steps (the largest rank's).
Both sides step AdamW with the same implementation: `--adamw fused` by
default, as torchtitan steps it (its `optimizer.implementation` defaults to
"fused"); `foreach` (torch's default on GPUs) dispatches each of its dozen
foreach ops through DTensor where parameters are DTensors (piper_fx's,
FSDP2's), and `for-loop` (torch's CPU default) each op of each parameter.
Pairs: ZeRO-0 vs DDP, ZeRO-1 vs DDP with `ZeroRedundancyOptimizer` (PyTorch's
ZeRO-1), ZeRO-3 vs FSDP2 `fully_shard`, ZeRO-2 vs FSDP2 with
`reshard_after_forward=False`, and each pipeline schedule (gpipe, 1f1b,
interleaved_1f1b, zbv, dualpipev) vs torch.distributed.pipelining's same
schedule (it refuses compiled stages for the zero-bubble schedules, which split
the backward: those run eager only). Pipelines alone use one block per stage and
untied embeddings on both sides. From 4 ranks, 1F1B over pp = world / 2 with
each stage data parallel over dp 2 too, as torchtitan composes them: ZeRO-0, 2
and 3 vs the pipelining stage under DDP, FSDP2 without resharding (torchtitan's
default under a pipeline) and FSDP2, the `--n-layer` blocks split over the
stages. The model is the example GPT (2 blocks of width
64 by default; `--n-layer` and `--n-embd` set the data-parallel pairs' depth and
every pair's width): on a small model the fixed costs of a step (Dynamo's
entry, the optimizer's per-parameter dispatch) weigh more than on a large one.
A measurement, not a test: nothing here asserts a time.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor_cache"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import piper_fx  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from piper_fx.runtime.memory import peak_allocated_bytes, storage_bytes  # noqa: E402
from piper_fx.sharding.holdings import is_stored  # noqa: E402

CFG = GPTConfig(vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=64)
WARMUP = 3
PEAK_STEPS = 3  # steps whose least peak allocation is a side's
_ADAMW_KWARGS = {"fused": {"fused": True}, "foreach": {"foreach": True}, "for-loop": {"foreach": False}}
ADAMW_IMPLEMENTATIONS = tuple(_ADAMW_KWARGS)


def adamw(params, implementation: str) -> torch.optim.AdamW:
    """AdamW with one of `ADAMW_IMPLEMENTATIONS`, as torchtitan names them."""
    return torch.optim.AdamW(params, lr=1e-3, **_ADAMW_KWARGS[implementation])


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, CFG.vocab_size, (rows, CFG.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


class Built(NamedTuple):
    """A side as its maker builds it: the training step, the parameters, the bytes its
    library keeps from one step to the next besides the parameters, their gradients and
    their optimizer state (DDP's gradient buckets, a pipeline stage's receive buffers), and
    the optimizer it steps them with, given the parameters and an AdamW implementation
    (`adamw`'s AdamW over them unless it says otherwise)."""

    step: Callable
    params: Iterable[torch.Tensor]
    kept_bytes: Callable[[], int] = lambda: 0
    optimizer: Callable[[list, str], torch.optim.Optimizer] = adamw


def _resident_bytes(params, opt) -> int:
    """Bytes of the distinct storages of parameters, gradients and optimizer state (none of a
    pipeline stage's parameters this rank released; ZeroRedundancyOptimizer's state: its local
    optimizer's, this rank's shard)."""
    tensors = [p for p in params if is_stored(p)] + [p.grad for p in params if p.grad is not None]
    state = getattr(opt, "optim", opt).state
    tensors += [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return storage_bytes(tensors)


def _reset_peak_rss() -> None:
    try:  # Linux: resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_rss_mb(field: str = "VmHWM") -> float:
    """This process's peak RSS in MB (`VmRSS`: the RSS now)."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith(field))
    return int(line.split()[1]) / 1024


class _Side:
    """One side of a pair on this rank: a model, its compiled step and its optimizer."""

    def __init__(self, make_step, cfg: GPTConfig, cache_dir: str, rank: int, world: int, per_rank: int, dp: int,
                 implementation: str):
        self.make_step, self.cfg, self.cache_dir, self.implementation = make_step, cfg, cache_dir, implementation
        self.rank, self.world, self.per_rank, self.dp = rank, world, per_rank, dp
        self.times: list[float] = []
        self.loss = None

    def build(self) -> None:
        torch.manual_seed(0)
        model = GPT(self.cfg)
        step, params, self.kept_bytes, optimizer = self.make_step(model)
        self.step, self.params = step, list(params)
        self.opt = optimizer(self.params, self.implementation)

    def run(self, i: int) -> float:
        """Step `i` (the global batch's share of this rank), timed between barriers."""
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = self.cache_dir  # each side compiles into its own cache
        x, y = batch(i, self.per_rank * self.world)
        x, y = x.chunk(self.dp)[self.rank % self.dp], y.chunk(self.dp)[self.rank % self.dp]
        dist.barrier()
        start = time.perf_counter()
        loss = self.step(x, y)
        if loss.requires_grad:  # a pipeline schedule's step ran its backward itself
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        self.loss = loss.detach()
        return time.perf_counter() - start


def measure_pair(makers, cfg: GPTConfig, caches, steps: int, rounds: int, rank: int, world: int, per_rank: int,
                 dp: int, implementation: str) -> list[dict]:
    """Every side of a pair on this rank, their timed steps alternating (in an order reversed
    every round), so drifts in the machine's load hit them alike. Per side: the median over
    `rounds` of each round's median step time and the rounds' spread, the last loss averaged
    over ranks, compile times (the first step with a cold Inductor cache, and again after
    `torch._dynamo.reset()` with the cache warm), peak tensor bytes (parameters, gradients
    and optimizer state, plus the most a step allocates above them) and peak RSS while it
    compiled and took its first step.

    The global batch has `per_rank * world` rows; each of the `dp` data-parallel
    replicas (all ranks; 1 for a pipeline over all ranks) gets its share."""
    torch._dynamo.reset()
    sides = [_Side(make, cfg, cache, rank, world, per_rank, dp, implementation) for make, cache in zip(makers, caches)]
    results = [{} for _ in sides]
    for side, result in zip(sides, results):
        _reset_peak_rss()
        side.build()
        result["cold_s"] = side.run(0)
        result["rss_mb"] = _peak_rss_mb()
    for i in range(1, WARMUP):
        for side in sides:
            side.run(i)
    medians: list[list[float]] = [[] for _ in sides]
    # The piper_fx side's timed steps: (runtime share, us per instruction, share with the step's call).
    runtime: list[tuple[float, float, float]] = []
    i = WARMUP
    for r in range(rounds):
        order = list(enumerate(sides)) if r % 2 == 0 else list(enumerate(sides))[::-1]
        times: list[list[float]] = [[] for _ in sides]
        for _ in range(steps):
            for index, side in order:
                times[index].append(side.run(i))
                if index == 0:  # the native sides run no piper_fx program
                    stats = piper_fx.last_step_stats()
                    runtime.append((stats["runtime_fraction"], stats["runtime_s"] / stats["instructions"] * 1e6,
                                    stats["overhead_fraction"]))
            i += 1
        for index in range(len(sides)):
            medians[index].append(statistics.median(times[index]))
    results[0].update(runtime_fraction=statistics.median(share for share, _, _ in runtime),
                      runtime_us_per_instruction=statistics.median(us for _, us, _ in runtime),
                      overhead_fraction=statistics.median(share for _, _, share in runtime))
    for side, result, rounds_s in zip(sides, results, medians):
        loss = side.loss.clone()
        dist.all_reduce(loss)
        dist.barrier()
        step_s = statistics.median(rounds_s)
        # The least of a few steps' peaks: a step allocates the same every time, but gloo's worker
        # threads hold a collective's buffers (its staging copies, a reduce-scatter's input) until
        # they get to run, which on busy cores is sometimes past the step's peak.
        above = min(peak_allocated_bytes(lambda: side.run(i + k))[1] for k in range(PEAK_STEPS))
        result.update(step_s=step_s, spread=(max(rounds_s) - min(rounds_s)) / step_s, loss=loss.item() / world,
                      peak_bytes=_resident_bytes(side.params, side.opt) + side.kept_bytes() + above)
    torch._dynamo.reset()  # compile again: Inductor's caches are warm now
    for side, result in zip(sides, results):
        side.build()
        result["warm_s"] = side.run(0)
    return results


def piper(options):
    def make(model):
        piper_fx.prepare(model, options)
        return Built(torch.compile(model, backend="piper", options=options), model.parameters())
    return make


def ddp(compiled: bool, zero_redundancy: bool = False):
    """DDP; compiled, around a compiled model (DDP's own graph breaks at its buckets, as with
    torch.compile(DDP(model))). With `zero_redundancy`, its parameters stepped by
    `ZeroRedundancyOptimizer` (PyTorch's ZeRO-1: each rank steps and keeps the optimizer state
    of its share of the parameters, and broadcasts them to the others)."""
    def make(model):
        from torch.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model)

        def buckets() -> int:  # its reducer's flat buffers, one per bucket, kept for the model's life
            return sum(map(int, re.findall(r"\d+", str(wrapped._get_ddp_logging_data()["bucket_sizes"]))))
        return Built(torch.compile(wrapped) if compiled else wrapped, wrapped.parameters(), buckets,
                     _zero_redundancy_adamw if zero_redundancy else adamw)
    return make


def _zero_redundancy_adamw(params, implementation: str):
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3,
                                   **_ADAMW_KWARGS[implementation])


def fsdp2(reshard_after_forward: bool, compiled: bool):
    """FSDP2 per block and at the root; compiled as torchtitan does: each block `.compile()`d."""
    def make(model):
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            if compiled:
                block.compile()
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        return Built(model, model.parameters())
    return make


# --- pipelines ---------------------------------------------------------------

PIPELINE_SCHEDULES = {  # ours -> (torch.distributed.pipelining class name, stages per rank, V placement,
    #                         whether it accepts compiled stages)
    "gpipe": ("ScheduleGPipe", 1, False, True),
    "1f1b": ("Schedule1F1B", 1, False, True),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, False, True),
    "zbv": ("ScheduleZBVZeroBubble", 2, True, False),
    "dualpipev": ("ScheduleDualPipeV", 2, True, False),
}


class Stage(torch.nn.Module):
    """Stage `index` of `num_stages`: its share of the GPT's blocks, in order; the first
    stage embeds, the last returns logits."""

    def __init__(self, model: GPT, index: int, num_stages: int):
        super().__init__()
        self.first, self.last = index == 0, index == num_stages - 1
        self.embed = torch.nn.ModuleList([model.wte, model.wpe]) if self.first else None
        n = len(model.blocks)  # as evenly as they split, the later stages taking the remainder
        self.blocks = torch.nn.ModuleList(model.blocks[index * n // num_stages:(index + 1) * n // num_stages])
        self.head = torch.nn.ModuleList([model.ln_f, model.lm_head]) if self.last else None

    def forward(self, x):
        if self.first:
            x = self.embed[0](x) + self.embed[1](torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x, _ = block(x)  # a dense block's auxiliary loss is None
        return self.head[1](self.head[0](x)) if self.last else x


def cross_entropy(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def pipelining(schedule: str, microbatches: int, compiled: bool, dp: int = 1, replicas: str = "DDP"):
    """torch.distributed.pipelining's `schedule` over pp = world / dp ranks, the GPT's blocks
    split evenly over the stages; compiled: each stage module `torch.compile`d.

    With dp > 1 the ranks form the mesh (pp, dp), rank = its pp index * dp + its dp index (as
    piper_fx orders its mesh {"pp": pp, "dp": dp}), and each stage module is replicated over
    its dp group (`replicas`, a key of `STAGE_REPLICAS`: by DDP, or sharded by FSDP2 as
    torchtitan applies it to a stage, each block and then the stage, resharding after the
    forward or not); compiled, each block `.compile()`d as torchtitan compiles a stage's
    blocks."""
    import torch.distributed.pipelining as pipelining_api

    class_name, per_rank, v_shape, _ = PIPELINE_SCHEDULES[schedule]

    def make(model):
        world = dist.get_world_size()
        pp, group, dp_mesh = world // dp, None, None
        if dp > 1:
            from torch.distributed.device_mesh import init_device_mesh
            mesh = init_device_mesh("cpu", (pp, dp), mesh_dim_names=("pp", "dp"))
            group, dp_mesh = mesh.get_group("pp"), mesh["dp"]
        rank = dist.get_rank(group)
        num_stages = pp * per_rank
        if v_shape:
            mine = [rank, 2 * pp - 1 - rank]
        else:
            mine = [rank + k * pp for k in range(per_rank)]
        stages = []
        for index in mine:
            module = Stage(model, index, num_stages)
            if dp > 1:
                module = _data_parallel_stage(module, dp_mesh, compiled, replicas)
            elif compiled:
                module = torch.compile(module)
            stages.append(pipelining_api.PipelineStage(module, index, num_stages, torch.device("cpu"), group=group))
        cls = getattr(pipelining_api, class_name)
        runner = cls(stages if per_rank > 1 else stages[0], n_microbatches=microbatches, loss_fn=cross_entropy)
        holds_first, holds_last = 0 in mine, num_stages - 1 in mine
        params = [p for stage in stages for p in stage.submod.parameters()]

        def step(x, y):
            losses = []
            if holds_first and holds_last:
                runner.step(x, target=y, losses=losses)
            elif holds_first:
                runner.step(x)
            elif holds_last:
                runner.step(target=y, losses=losses)
            else:
                runner.step()
            # Every rank returns its replica's loss, as piper_fx does.
            loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
            dist.all_reduce(loss, group=group)
            return loss

        def receive_buffers() -> int:  # each stage's, per microbatch, made by its first step and kept
            infos = [info for stage in stages for table in (stage.args_recv_info, stage.grad_recv_info)
                     for infos in table.values() for info in infos]
            return storage_bytes(info.buffer for info in infos if getattr(info, "buffer", None) is not None)
        return Built(step, params, receive_buffers)
    return make


# How a pipeline stage's module is data parallel over its dp group (`pipelining`'s `replicas`)
# -> piper_fx's ZeRO level that does the same.
STAGE_REPLICAS = {"DDP": 0, "FSDP2 no-reshard": 2, "FSDP2": 3}


def _data_parallel_stage(module: Stage, dp_mesh, compiled: bool, replicas: str) -> torch.nn.Module:
    """`module` over its dp group: each block compiled (`compiled`), then replicated by DDP or
    sharded by FSDP2 block by block and as a whole (`replicas`, a key of `STAGE_REPLICAS`)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel
    for block in module.blocks if compiled else ():
        block.compile()
    if replicas == "DDP":
        return DistributedDataParallel(module, process_group=dp_mesh.get_group())
    reshard = replicas == "FSDP2"
    for block in module.blocks:
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard)
    return fully_shard(module, mesh=dp_mesh, reshard_after_forward=reshard)


def piper_pipeline(schedule: str, microbatches: int, codegen: str, dp: int = 1, zero: int = 0):
    def make(model):
        mesh = {"pp": dist.get_world_size() // dp, **({"dp": dp} if dp > 1 else {})}
        opts = {"mesh": mesh, "codegen": codegen, "zero": zero,
                "pipeline": {"schedule": schedule, "microbatches": microbatches}}
        model.block_context = lambda: piper_fx.annotate("PP")
        piper_fx.prepare(model, opts)
        return Built(torch.compile(model, backend="piper", options=opts), model.parameters())
    return make


def run(rank: int, world: int, init_file: str, args, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    # Per pair: piper_fx's side, then the native side as {"compiled": maker, "eager": maker}.
    pairs = [
        ("zero=0 vs DDP", piper({"zero": 0, "codegen": args.codegen}),
         {"compiled": ddp(True), "eager": ddp(False)}, args.cfg, world),
        ("zero=1 vs DDP + ZeRO optimizer", piper({"zero": 1, "codegen": args.codegen}),
         {"compiled": ddp(True, zero_redundancy=True), "eager": ddp(False, zero_redundancy=True)}, args.cfg, world),
        ("zero=3 vs FSDP2", piper({"zero": 3, "codegen": args.codegen}),
         {"compiled": fsdp2(True, True), "eager": fsdp2(True, False)}, args.cfg, world),
        ("zero=2 vs FSDP2 no-reshard", piper({"zero": 2, "codegen": args.codegen}),
         {"compiled": fsdp2(False, True), "eager": fsdp2(False, False)}, args.cfg, world),
    ]
    microbatches = 2 * world
    for schedule, (_, per_rank, _, accepts_compiled) in PIPELINE_SCHEDULES.items():
        cfg = dataclasses.replace(args.cfg, n_layer=world * per_rank, tied_embeddings=False)
        native = {"eager": pipelining(schedule, microbatches, False)}
        if accepts_compiled:
            native = {"compiled": pipelining(schedule, microbatches, True), **native}
        # The whole global batch enters the pipeline on every rank (dp = 1).
        pairs.append((f"{schedule} vs pipelining", piper_pipeline(schedule, microbatches, args.codegen),
                      native, cfg, 1))
    if world >= 4 and world % 2 == 0:  # 1F1B over pp = world / 2 ranks, each stage over dp 2, as torchtitan's 2D
        dp, pp = 2, world // 2
        cfg = dataclasses.replace(args.cfg, n_layer=pp * max(1, args.cfg.n_layer // pp), tied_embeddings=False)
        for replicas, zero in STAGE_REPLICAS.items():
            native = {"compiled": pipelining("1f1b", 2 * pp, True, dp, replicas),
                      "eager": pipelining("1f1b", 2 * pp, False, dp, replicas)}
            pairs.append((f"pp{pp}xdp{dp} 1f1b zero={zero} vs {replicas}",
                          piper_pipeline("1f1b", 2 * pp, args.codegen, dp, zero), native, cfg, dp))
    rows = []
    for index, (name, ours, native, cfg, dp) in enumerate(pairs):
        if args.only and not any(word in name for word in args.only):
            continue
        kinds = list(native)
        caches = [os.path.join(args.tmp_dir, "inductor_caches", f"pair{index}_{side}") for side in ("piper", *kinds)]
        measured = measure_pair((ours, *native.values()), cfg, caches, args.steps, args.rounds, rank, world,
                                args.per_rank_batch, dp, args.adamw)
        everyone: list = [None] * world
        dist.all_gather_object(everyone, measured)
        # Per side, the slowest rank's times and the largest rank's memory.
        sides = [{key: max(m[side][key] for m in everyone) for key in measured[side]} for side in range(len(measured))]
        for kind, side in zip(kinds, sides[1:]):
            side["kind"] = kind
        rows.append((name, sides[0], min(sides[1:], key=lambda side: side["step_s"]), sides[1:]))
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def _results_or_failure(results, procs):
    """Rank 0's rows; if a rank dies first, stop the others and say which."""
    import queue
    while True:
        try:
            return results.get(timeout=5)
        except queue.Empty:
            failed = [p for p in procs if p.exitcode not in (None, 0)]
            if failed:
                for p in procs:
                    p.terminate()
                sys.exit(f"{failed[0].name} failed with exit code {failed[0].exitcode}")


def spawn_ranks(target, nproc: int, args):
    """Rank 0's results of `target(rank, nproc, init_file, args, results)` run on `nproc` spawned
    ranks (it puts them in `results`), with `args.tmp_dir` a directory that lasts the run; if a
    rank dies first, the others are stopped and the run exits naming it."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        args.tmp_dir = tmp
        procs = [ctx.Process(target=target, args=(r, nproc, os.path.join(tmp, "rdv"), args, results),
                             name=f"rank {r}") for r in range(nproc)]
        for p in procs:
            p.start()
        rows = _results_or_failure(results, procs)
        for p in procs:
            p.join()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-rank-batch", type=int, default=8)
    parser.add_argument("--codegen", choices=["inductor", "eager"], default="inductor")
    parser.add_argument("--n-layer", type=int, default=CFG.n_layer,
                        help="blocks of the data-parallel pairs' GPT (pipelines alone: one block per stage; pp x dp: "
                             "these blocks split over the stages)")
    parser.add_argument("--n-embd", type=int, default=CFG.n_embd, help="every pair's GPT's width")
    parser.add_argument("--only", nargs="*", help="run only the pairs whose name contains one of these words")
    parser.add_argument("--adamw", choices=ADAMW_IMPLEMENTATIONS, default="fused",
                        help="AdamW's implementation on both sides (fused: torchtitan's default; foreach: torch's "
                             "default on GPUs; for-loop: its default on CPUs, which pays DTensor's dispatch per "
                             "parameter and op where parameters are DTensors)")
    args = parser.parse_args()
    args.cfg = dataclasses.replace(CFG, n_layer=args.n_layer, n_embd=args.n_embd)
    rows = spawn_ranks(run, args.nproc, args)
    tokens = args.per_rank_batch * args.nproc * CFG.block_size
    print(f"{args.nproc} CPU ranks (gloo), GPT {args.n_layer}x{args.n_embd} (pipelines alone: one block per stage), "
          f"{tokens} tokens/step, {args.rounds} rounds of {args.steps} steps after {WARMUP} warm-up, piper_fx "
          f"codegen {args.codegen}, AdamW {args.adamw}; per pair the slowest rank's time and the largest rank's memory; native: the "
          f"faster of compiled and eager; ms: median of the rounds' medians (spread of the rounds); "
          f"ratio = piper / native")
    width = max([31, *(len(name) for name, *_ in rows)])
    header = (f"{'pair':<{width}} {'piper ms':>13} {'native ms':>13} {'native':>8} {'ratio':>5} {'piper tok/s':>11} "
              f"{'piper MB':>8} {'native MB':>9} {'piper RSS':>9} {'native RSS':>10} "
              f"{'cold s':>11} {'warm s':>11} {'runtime':>7} {'us/instr':>8} {'+call':>6} {'piper loss':>10} "
              f"{'native loss':>11}"
              f"  other native")
    print(header)
    for name, ours, theirs, natives in rows:
        others = ", ".join(f"{n['kind']} {n['step_s'] * 1e3:.1f} ms, cold {n['cold_s']:.1f} s"
                           for n in natives if n is not theirs)
        print(f"{name:<{width}} {ours['step_s'] * 1e3:7.1f} ({ours['spread']:3.0%}) "
              f"{theirs['step_s'] * 1e3:7.1f} ({theirs['spread']:3.0%}) {theirs['kind']:>8} "
              f"{ours['step_s'] / theirs['step_s']:5.2f} {tokens / ours['step_s']:11.0f} "
              f"{ours['peak_bytes'] / 2**20:8.2f} {theirs['peak_bytes'] / 2**20:9.2f} "
              f"{ours['rss_mb']:9.0f} {theirs['rss_mb']:10.0f} "
              f"{ours['cold_s']:5.1f}/{theirs['cold_s']:<5.1f} {ours['warm_s']:5.1f}/{theirs['warm_s']:<5.1f} "
              f"{ours['runtime_fraction']:7.1%} {ours['runtime_us_per_instruction']:8.0f} "
              f"{ours['overhead_fraction']:6.1%} "
              f"{ours['loss']:10.5f} {theirs['loss']:11.5f}  {others}")

if __name__ == "__main__":
    main()
