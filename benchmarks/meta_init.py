"""What a rank holds while it builds a sharded model: built as usual, or on the meta device.

    python benchmarks/meta_init.py [--nproc 2] [--n-layer 16] [--n-embd 512]

Each rank builds the example GPT and lays it out for ZeRO-3, with piper_fx
(`piper_fx.prepare`) and with FSDP2 (`fully_shard` on every block, then the
model), each in fresh processes, in two ways: built as usual (the whole model,
then sharded), and built under `torch.device("meta")`, laid out there,
materialized by `to_empty` and initialised through each module's
`reset_parameters()` (the sharded parameters' attributes are their DTensors
outside a forward, on both sides). Printed: the growth of each rank's peak
RSS (`VmHWM`) over building, laying out and initialising, the largest rank's,
beside the model's size and a rank's share of it. A measurement, not a test.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import piper_fx  # noqa: E402
from examples.gpt import GPT, GPTConfig  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1024


def _lay_out(model: torch.nn.Module, side: str) -> None:
    if side == "piper_fx":
        piper_fx.prepare(model, {"zero": 3})
    else:
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)


def _build(rank: int, world: int, port: int, side: str, on_meta: bool, cfg: GPTConfig, out) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    dist.barrier()  # the group's connections made before the measure starts
    before = _peak_rss_mb()
    torch.manual_seed(0)
    if on_meta:
        with torch.device("meta"):
            model = GPT(cfg)
        _lay_out(model, side)
        model.to_empty(device="cpu")
        for module in model.modules():
            if hasattr(module, "reset_parameters"):
                module.reset_parameters()
    else:
        model = GPT(cfg)
        _lay_out(model, side)
    out.put((rank, _peak_rss_mb() - before))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--n-layer", type=int, default=16)
    parser.add_argument("--n-embd", type=int, default=512)
    args = parser.parse_args()
    cfg = GPTConfig(vocab_size=65, block_size=64, n_layer=args.n_layer, n_head=8, n_embd=args.n_embd)
    with torch.device("meta"):
        params = sum(p.numel() for p in GPT(cfg).parameters())
    model_mb = params * 4 / 2**20
    print(f"GPT {args.n_layer}x{args.n_embd}: {params / 1e6:.1f} M parameters, {model_mb:.0f} MB in fp32, "
          f"{model_mb / args.nproc:.0f} MB a rank under ZeRO-3 over {args.nproc} ranks (gloo, CPU)")
    print(f"{'side':10} {'built':10} {'peak RSS growth, MB (largest rank)':>36}")
    context = mp.get_context("spawn")
    for port, (side, on_meta) in enumerate([(s, m) for s in ("piper_fx", "FSDP2") for m in (False, True)], 29650):
        out = context.SimpleQueue()
        mp.start_processes(_build, args=(args.nproc, port, side, on_meta, cfg, out), nprocs=args.nproc,
                           start_method="spawn")
        growth = max(out.get()[1] for _ in range(args.nproc))
        print(f"{side:10} {'meta' if on_meta else 'as usual':10} {growth:36.0f}")


if __name__ == "__main__":
    main()
