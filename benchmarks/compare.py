"""Step time of piper_fx against PyTorch's own DDP and FSDP2, side by side in one run.

    python benchmarks/compare.py [--nproc 2] [--steps 10] [--codegen inductor|eager]

Spawns the ranks (gloo on CPU), trains the example GPT with each pair on the
same data from the same initial weights, and prints median step times, the
piper_fx / native ratio, and the loss after the last step (which must match).
Pairs: ZeRO-0 vs DDP (with torch.compile), ZeRO-3 vs FSDP2 `fully_shard`,
ZeRO-2 vs FSDP2 with `reshard_after_forward=False`, and each pipeline schedule
(gpipe, 1f1b, interleaved_1f1b, zbv, dualpipev) vs torch.distributed.pipelining's
same schedule: its stages compiled with torch.compile where PyTorch allows it
(gpipe, 1f1b, interleaved), eager where it refuses compiled stages (the
zero-bubble schedules, which split the backward). Pipelines use one block per
stage and untied embeddings on both sides.
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


def train(make_step, steps: int, rank: int, world: int, per_rank: int, cfg: GPTConfig = CFG, dp: int | None = None):
    """Median step time (s) after warm-up, and the last loss averaged over ranks.

    The global batch has `per_rank * world` rows; each of the `dp` data-parallel
    replicas (all ranks by default; 1 for a pipeline over all ranks) gets its share.
    A step whose loss needs no backward ran its backward itself (a pipeline schedule)."""
    dp = world if dp is None else dp
    torch.manual_seed(0)
    model = GPT(cfg)
    step, params = make_step(model)
    opt = torch.optim.AdamW(params, lr=1e-3)
    times, loss = [], None
    for i in range(WARMUP + steps):
        x, y = batch(i, per_rank * world)
        x, y = x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp]
        dist.barrier()
        start = time.perf_counter()
        loss = step(x, y)
        if loss.requires_grad:
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


def fsdp2(reshard_after_forward: bool = True):
    def make(model):
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard_after_forward)
        fully_shard(model, reshard_after_forward=reshard_after_forward)
        return model, model.parameters()
    return make


# --- pipelines ---------------------------------------------------------------

PIPELINE_SCHEDULES = {  # ours -> (torch.distributed.pipelining class name, stages per rank, V placement, compiled)
    "gpipe": ("ScheduleGPipe", 1, False, True),
    "1f1b": ("Schedule1F1B", 1, False, True),
    "interleaved_1f1b": ("ScheduleInterleaved1F1B", 2, False, True),
    "zbv": ("ScheduleZBVZeroBubble", 2, True, False),
    "dualpipev": ("ScheduleDualPipeV", 2, True, False),
}


class _Stage(torch.nn.Module):
    """One block of the GPT; the first stage embeds, the last returns logits."""

    def __init__(self, model: GPT, index: int, num_stages: int):
        super().__init__()
        self.first, self.last = index == 0, index == num_stages - 1
        self.embed = torch.nn.ModuleList([model.wte, model.wpe]) if self.first else None
        self.block = model.blocks[index]
        self.head = torch.nn.ModuleList([model.ln_f, model.lm_head]) if self.last else None

    def forward(self, x):
        if self.first:
            x = self.embed[0](x) + self.embed[1](torch.arange(x.shape[1]))
        x = self.block(x)
        return self.head[1](self.head[0](x)) if self.last else x


def _cross_entropy(logits, targets):
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def pipelining(schedule: str, microbatches: int):
    """torch.distributed.pipelining's `schedule` over all ranks, one block per stage."""
    import torch.distributed.pipelining as pipelining_api

    class_name, per_rank, v_shape, compiled = PIPELINE_SCHEDULES[schedule]

    def make(model):
        world, rank = dist.get_world_size(), dist.get_rank()
        num_stages = world * per_rank
        if v_shape:
            mine = [rank, 2 * world - 1 - rank]
        else:
            mine = [rank + k * world for k in range(per_rank)]
        stages = []
        for index in mine:
            module = _Stage(model, index, num_stages)
            stages.append(pipelining_api.PipelineStage(torch.compile(module) if compiled else module, index,
                                                       num_stages, torch.device("cpu")))
        cls = getattr(pipelining_api, class_name)
        runner = cls(stages if per_rank > 1 else stages[0], n_microbatches=microbatches, loss_fn=_cross_entropy)
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
            # Every rank returns the batch's loss, as piper_fx does.
            loss = torch.stack(losses).mean().detach() if losses else torch.zeros(())
            dist.all_reduce(loss)
            return loss
        return step, params
    return make


def piper_pipeline(schedule: str, microbatches: int, codegen: str):
    def make(model):
        opts = {"mesh": {"pp": dist.get_world_size()}, "codegen": codegen,
                "pipeline": {"schedule": schedule, "microbatches": microbatches}}
        model.block_context = lambda: piper_fx.annotate("PP")
        piper_fx.prepare(model, opts)
        return torch.compile(model, backend="piper", options=opts), model.parameters()
    return make


def run(rank: int, world: int, init_file: str, args, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    torch.set_num_threads(1)
    pairs = [
        ("zero=0 vs DDP+compile", piper({"zero": 0, "codegen": args.codegen}), ddp_compiled, CFG, world),
        ("zero=3 vs FSDP2", piper({"zero": 3, "codegen": args.codegen}), fsdp2(True), CFG, world),
        ("zero=2 vs FSDP2 no-reshard", piper({"zero": 2, "codegen": args.codegen}), fsdp2(False), CFG, world),
    ]
    microbatches = 2 * world
    for schedule, (_, per_rank, _, _) in PIPELINE_SCHEDULES.items():
        cfg = GPTConfig(vocab_size=CFG.vocab_size, block_size=CFG.block_size, n_layer=world * per_rank,
                        n_head=CFG.n_head, n_embd=CFG.n_embd, tied_embeddings=False)
        # The whole global batch enters the pipeline on every rank (dp = 1).
        pairs.append((f"{schedule} vs pipelining", piper_pipeline(schedule, microbatches, args.codegen),
                      pipelining(schedule, microbatches), cfg, 1))
    rows = []
    for name, ours, theirs, cfg, dp in pairs:
        if args.only and not any(word in name for word in args.only):
            continue
        ours_time, ours_loss = train(ours, args.steps, rank, world, args.per_rank_batch, cfg, dp)
        theirs_time, theirs_loss = train(theirs, args.steps, rank, world, args.per_rank_batch, cfg, dp)
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
    parser.add_argument("--only", nargs="*", help="run only the pairs whose name contains one of these words")
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
    print(f"{'pair':<30} {'piper ms':>9} {'native ms':>10} {'ratio':>6} {'piper tok/s':>12} "
          f"{'piper loss':>11} {'native loss':>12}")
    for name, ours, theirs, ours_loss, theirs_loss in rows:
        print(f"{name:<30} {ours * 1e3:9.1f} {theirs * 1e3:10.1f} {ours / theirs:6.2f} {tokens / ours:12.0f} "
              f"{ours_loss:11.5f} {theirs_loss:12.5f}")


if __name__ == "__main__":
    main()
