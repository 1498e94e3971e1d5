"""How large a batch fits a per-rank memory budget, per strategy, piper_fx beside PyTorch.

    python benchmarks/memory.py [--budget-mb 120] [--layers 4] [--width 256] [--block 128] [--rows 4] [--verbose]

Spawns 4 ranks (gloo on CPU) and trains the example GPT (untied embeddings) with
each strategy, with and without activation checkpointing, and with PyTorch's
native equivalent configured the same way:

    piper_fx                         PyTorch
    dp4 ZeRO-0                       DDP
    dp4 ZeRO-1                       DDP + ZeroRedundancyOptimizer
    dp4 ZeRO-2                       FSDP2, reshard_after_forward=False
    dp4 ZeRO-3                       FSDP2
    pp2 x dp2 1F1B                   torch.distributed.pipelining 1F1B, DDP stages
    pp2 x dp2 ZeRO-3 1F1B            torch.distributed.pipelining 1F1B, FSDP2 stages

Activation checkpointing is piper_fx's `{"mode": "full"}` and, natively,
`checkpoint_wrapper` around every block (as torchtitan's full AC). Both sides
run eagerly (piper_fx's eager codegen), so neither gains from fusion.

A rank's memory for a step is what it holds before the step (parameters and
optimizer state) plus the most the step (forward, backward, optimizer step)
allocates above that, from the CPU allocator (`peak_allocated_bytes`), the
worst of 3 steps; a strategy's is its largest rank's. Memory is affine in the
batch (activations grow with it; model state, and what a step allocates
whatever the batch, do not): measured at two global batches (4 and 16
sequences per replica), the fit gives the fixed part and the bytes per
sequence, and from them the largest global batch within the budget (a multiple
of what the strategy splits the batch into). Printed as a table, with the
ratios piper_fx / PyTorch and each
strategy's batch against the unsharded pipeline's. A measurement, not a test.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

import piper_fx  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from compare import Stage, cross_entropy  # noqa: E402  (the native pipelines' stage, as compare.py splits it)
from piper_fx.runtime.memory import peak_allocated_bytes, storage_bytes  # noqa: E402
from piper_fx.sharding.holdings import is_stored  # noqa: E402

WORLD = 4
MICROBATCHES = 4
MEASURED_STEPS = 3
STRATEGIES = ("dp4 zero0", "dp4 zero1", "dp4 zero2", "dp4 zero3", "pp2 x dp2 1f1b", "pp2 x dp2 zero3 1f1b")
NATIVE = {"dp4 zero0": "DDP", "dp4 zero1": "DDP + ZeroRedundancyOptimizer", "dp4 zero2": "FSDP2 no-reshard",
          "dp4 zero3": "FSDP2", "pp2 x dp2 1f1b": "pipelining 1F1B, DDP",
          "pp2 x dp2 zero3 1f1b": "pipelining 1F1B, FSDP2"}


def _pipelined(strategy: str) -> bool:
    return strategy.startswith("pp2")


def _replicas(strategy: str) -> int:
    return 2 if _pipelined(strategy) else WORLD


def _granule(strategy: str) -> int:
    """What a global batch must be a multiple of: a sequence per replica (and microbatch)."""
    return _replicas(strategy) * (MICROBATCHES if _pipelined(strategy) else 1)


def _batch(step: int, rows: int, cfg: GPTConfig):
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g)
    return x, torch.roll(x, -1, dims=1)


def _checkpointed(model: GPT) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    for index, block in enumerate(model.blocks):
        model.blocks[index] = checkpoint_wrapper(block)


# --- piper_fx ----------------------------------------------------------------

def piper(strategy: str, checkpointing: bool):
    options = {"codegen": "eager"}
    if _pipelined(strategy):
        options.update(mesh={"pp": 2, "dp": 2}, pipeline={"schedule": "1f1b", "microbatches": MICROBATCHES},
                       zero=3 if "zero3" in strategy else 0)
    else:
        options["zero"] = int(strategy[-1])
    if checkpointing:
        options["activation_checkpointing"] = {"mode": "full"}

    def make(model: GPT):
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
        return step, list(model.parameters()), torch.optim.AdamW(model.parameters(), lr=1e-3)
    return make


# --- PyTorch -----------------------------------------------------------------

def native(strategy: str, checkpointing: bool):
    def make(model: GPT):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.optim import ZeroRedundancyOptimizer
        from torch.nn.parallel import DistributedDataParallel

        if checkpointing:
            _checkpointed(model)
        if _pipelined(strategy):
            return _native_pipeline(model, "zero3" in strategy)
        if strategy.endswith(("zero0", "zero1")):
            wrapped = DistributedDataParallel(model)
            params = list(wrapped.parameters())
            opt = (ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=1e-3)
                   if strategy.endswith("zero1") else torch.optim.AdamW(params, lr=1e-3))
            return (lambda x, y: wrapped(x, y)), params, opt
        mesh = init_device_mesh("cpu", (WORLD,))
        reshard = strategy.endswith("zero3")
        for block in model.blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        params = list(model.parameters())
        return (lambda x, y: model(x, y)), params, torch.optim.AdamW(params, lr=1e-3)
    return make


def _native_pipeline(model: GPT, sharded: bool):
    """1F1B over pp2, each stage's module replicated (DDP) or sharded (FSDP2) over dp2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B
    from torch.nn.parallel import DistributedDataParallel

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp = mesh.get_local_rank("pp")
    module = Stage(model, pp, 2)
    params = list(module.parameters())
    if sharded:
        for block in module.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(module, mesh=mesh["dp"])
        params = list(module.parameters())
    else:
        module = DistributedDataParallel(module, process_group=mesh.get_group("dp"))
    stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh.get_group("pp"))
    schedule = Schedule1F1B(stage, n_microbatches=MICROBATCHES, loss_fn=cross_entropy)

    def step(x, y):
        losses = []
        if pp == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=losses)
        return torch.stack(losses).mean().detach() if losses else torch.zeros(())
    return step, params, torch.optim.AdamW(params, lr=1e-3)


# --- measuring ---------------------------------------------------------------

def measure(make, cfg: GPTConfig, strategy: str, rows: int, rank: int) -> int:
    """This rank's memory for a step on a global batch of `rows` sequences: what it holds
    before the step (parameters, optimizer state) plus the most the step allocates."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    step, params, opt = make(GPT(cfg))
    replicas = _replicas(strategy)
    replica = rank % replicas if not _pipelined(strategy) else rank % 2  # pp2 x dp2: rank = pp * 2 + dp

    def train(i: int) -> None:
        x, y = _batch(i, rows, cfg)
        loss = step(x.chunk(replicas)[replica], y.chunk(replicas)[replica])
        if loss.requires_grad:  # a pipeline schedule ran its backward itself
            loss.backward()
        opt.step()
        opt.zero_grad()

    for i in range(2):  # compile, and make the optimizer's state
        train(i)
    state = getattr(opt, "optim", opt).state  # ZeroRedundancyOptimizer: its local optimizer's, this rank's shard
    held = storage_bytes([*(p for p in params if is_stored(p)), *(t for s in state.values() for t in s.values())])
    # The worst of a few steps: when a collective's buffers come and go varies from step to step.
    peak = max(peak_allocated_bytes(lambda: train(i))[1] for i in range(2, 2 + MEASURED_STEPS))
    dist.barrier()
    return held + peak


def run(rank: int, init_file: str, args, results) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=600))
    torch.set_num_threads(1)
    cfg = GPTConfig(vocab_size=65, block_size=args.block, n_layer=args.layers, n_head=4, n_embd=args.width,
                    tied_embeddings=False)
    rows = []
    for strategy in STRATEGIES:
        if args.only and not any(word in strategy for word in args.only):
            continue
        for checkpointing in (False, True):
            sizes = (args.rows * _replicas(strategy), 4 * args.rows * _replicas(strategy))
            for side, maker in (("piper_fx", piper), ("native", native)):
                mine = [measure(maker(strategy, checkpointing), cfg, strategy, size, rank) for size in sizes]
                everyone: list = [None] * WORLD
                dist.all_gather_object(everyone, mine)
                rows.append((strategy, checkpointing, side, sizes, [max(m[i] for m in everyone) for i in range(2)]))
                if rank == 0 and args.verbose:
                    print(f"measured {strategy}, AC {checkpointing}, {side}: {rows[-1][-1]} bytes at batches {sizes}",
                          flush=True)
    if rank == 0:
        results.put(rows)
    dist.destroy_process_group()


def largest_batch(sizes, measured, budget: int, granule: int) -> tuple[float, float, int]:
    """From memory at two batch sizes: the fixed part (MB: model state, and what a step allocates
    whatever the batch), MB per sequence, and the largest batch in the budget."""
    per_row = (measured[1] - measured[0]) / (sizes[1] - sizes[0])
    fixed = measured[0] - per_row * sizes[0]
    fits = max(0, math.floor((budget - fixed) / per_row / granule) * granule) if per_row > 0 else 0
    return fixed / 2**20, per_row / 2**20, fits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget-mb", type=float, default=120)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--block", type=int, default=128)
    parser.add_argument("--rows", type=int, default=4,
                        help="sequences per replica of the first measured batch (the second: four times as many)")
    parser.add_argument("--verbose", action="store_true", help="print each measurement as it is taken")
    parser.add_argument("--only", nargs="*", help="run only the strategies whose name contains one of these words")
    args = parser.parse_args()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor_cache"))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [ctx.Process(target=run, args=(r, os.path.join(tmp, "rdv"), args, results)) for r in range(WORLD)]
        for p in procs:
            p.start()
        rows = results.get()
        for p in procs:
            p.join()
    budget = int(args.budget_mb * 2**20)
    print(f"{WORLD} CPU ranks (gloo), GPT {args.layers}x{args.width}, {args.block} tokens per sequence, AdamW, "
          f"eager; budget {args.budget_mb:.0f} MB per rank; memory = the largest rank's parameters and optimizer "
          f"state plus the most a step allocates; batch in sequences (global), fitted from two measured batches")
    print(f"{'strategy':<22} {'AC':<5} {'side':<9} {'fixed MB':>8} {'MB/seq':>7} {'max batch':>9} {'vs native':>9} "
          f"{'vs pp2 x dp2':>12}  native")
    fitted = {(strategy, checkpointing, side): largest_batch(sizes, measured, budget, _granule(strategy))
              for strategy, checkpointing, side, sizes, measured in rows}
    for (strategy, checkpointing, side), (fixed, per_row, batch) in fitted.items():
        native_batch = fitted.get((strategy, checkpointing, "native"), (0, 0, 0))[2]
        pipeline_batch = fitted.get(("pp2 x dp2 1f1b", checkpointing, side), (0, 0, 0))[2]
        ratio = f"{batch / native_batch:.2f}" if side == "piper_fx" and native_batch else ""
        versus = f"{batch / pipeline_batch:.2f}" if pipeline_batch else ""
        print(f"{strategy:<22} {'full' if checkpointing else 'none':<5} {side:<9} {fixed:8.1f} {per_row:7.2f} "
              f"{batch:9d} {ratio:>9} {versus:>12}  {NATIVE[strategy] if side == 'native' else ''}")

if __name__ == "__main__":
    main()
