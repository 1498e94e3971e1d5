"""Check that piper_fx trains exactly like single-device PyTorch on this machine's device.

    make gpu-check                                            # every case that fits the GPUs here
    python examples/device_check.py --device cpu --nproc 2    # the same cases on CPU ranks (gloo)
    python examples/device_check.py --cases dp2_zero3,pp2_1f1b

Each case spawns its ranks (NCCL with one GPU per rank, `cuda:LOCAL_RANK`;
gloo on CPU), trains the example GPT with piper_fx for a few AdamW steps, each
rank on its data-parallel shard of a fixed global batch, and beside it, on
rank 0, the same model in plain single-device PyTorch on the whole batch. It
prints per case the largest relative error of the losses and of the final
parameters, and exits non-zero if any is above fp32 tolerance (TF32 is turned
off on both sides, so the two runs differ only by summation order).

A case of `WINDOWS` trains each step as a `piper_fx.no_sync` window of calls on
parts of the rank's shard, its last call reducing what the window held.

A case under `mixed_precision` is compared with FSDP2 instead (`fully_shard`
per block and at the root, over every rank, under the same
`MixedPrecisionPolicy`, each rank on the same shard of the batch): with eager
codegen the two must be equal bit for bit, as the CPU tests have them. With
Inductor, whose fused kernels round bf16 otherwise than eager PyTorch's ops (and
AdamW's normalised steps carry that into every parameter), the yardstick is
FSDP2 with its blocks compiled, as torchtitan compiles them: piper_fx must be
at most twice as far from eager FSDP2 as it is (its bf16 loss at least one ulp).

A case runs when the machine has its world size: NCCL gives each rank a GPU
of its own, so one GPU runs the world-1 cases only. With `--plan`, a case that
needs more ranks than the machine has runs as rank 0 of a fake process group of
its world size instead: its step is planned for this device's kernels (a GPU's
attention kernels are not a CPU's), compiled and run twice, the fake group's
collectives moving nothing, so no numbers are compared. `--plan` adds
Hugging Face models (where transformers is installed) called with a padded
batch's attention mask, as a tokenizer's batch is: Llama and BERT in fp32 and
Llama in bf16 (the attention kernels of each differ on a GPU), under data
parallelism and a pipeline.

    python examples/device_check.py --plan          # on one GPU: every case, the larger ones planned
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runnable from a checkout without `pip install`
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(ROOT / ".inductor_cache"))

import argparse
import contextlib
import copy
import json
import tempfile
from datetime import timedelta
from multiprocessing.connection import wait

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

import piper_fx
from examples.gpt import GPT, GPTConfig

STEPS = 4
ROWS_PER_RANK = 4
# Losses and parameters after STEPS AdamW steps, relative to their largest magnitude. Summing in
# another order (microbatches, reductions over ranks, fused kernels) moves fp32 results by ~1e-6;
# AdamW's eps (1e-4, as in tests/training.py) keeps that from being amplified into a whole step.
RTOL = 1e-4
BF16_FP32 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
CONFIG = dict(vocab_size=37, block_size=16, n_layer=4, n_head=2, n_embd=32)
COLLECTIVE_TIMEOUT = timedelta(seconds=120)

PIPELINE = {"microbatches": 4}
CASES: dict[str, tuple[int, dict]] = {
    "single_eager": (1, {"codegen": "eager"}),
    "single_inductor": (1, {"codegen": "inductor"}),
    "dp2_zero0": (2, {"mesh": {"dp": 2}, "zero": 0, "codegen": "inductor"}),
    "dp2_zero1": (2, {"mesh": {"dp": 2}, "zero": 1, "codegen": "eager"}),
    "dp2_zero2": (2, {"mesh": {"dp": 2}, "zero": 2, "codegen": "eager"}),
    "dp2_zero3": (2, {"mesh": {"dp": 2}, "zero": 3, "codegen": "inductor"}),
    "pp2_gpipe": (2, {"mesh": {"pp": 2}, "pipeline": {**PIPELINE, "schedule": "gpipe"}, "codegen": "eager"}),
    "pp2_1f1b": (2, {"mesh": {"pp": 2}, "pipeline": {**PIPELINE, "schedule": "1f1b"}, "codegen": "inductor"}),
    "pp2_interleaved_1f1b": (2, {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {
        **PIPELINE, "schedule": "interleaved_1f1b", "stages_per_rank": 2}}),
    "pp2_zb1p": (2, {"mesh": {"pp": 2}, "pipeline": {**PIPELINE, "schedule": "zb1p"}, "codegen": "eager"}),
    "pp2_zbv": (2, {"mesh": {"pp": 2}, "pipeline": {**PIPELINE, "schedule": "zbv"}, "codegen": "eager"}),
    "pp2_dualpipev": (2, {"mesh": {"pp": 2}, "pipeline": {**PIPELINE, "schedule": "dualpipev"},
                          "codegen": "eager"}),
    "pp2_dp2_zero3_1f1b": (4, {"mesh": {"pp": 2, "dp": 2}, "zero": 3, "codegen": "inductor",
                               "pipeline": {**PIPELINE, "schedule": "1f1b"}}),
    "single_checkpointing": (1, {"codegen": "inductor", "activation_checkpointing": {"mode": "selective"}}),
    "single_bf16_eager": (1, {"codegen": "eager", "mixed_precision": BF16_FP32}),
    "single_bf16_inductor": (1, {"codegen": "inductor", "mixed_precision": BF16_FP32}),
    "dp2_zero3_bf16": (2, {"mesh": {"dp": 2}, "zero": 3, "codegen": "eager", "mixed_precision": BF16_FP32}),
    "pp2_dp2_zero1_dualpipev": (4, {"mesh": {"pp": 2, "dp": 2}, "zero": 1, "codegen": "eager",
                                    "pipeline": {**PIPELINE, "schedule": "dualpipev"}}),
    "dp2_zero3_window": (2, {"mesh": {"dp": 2}, "zero": 3, "codegen": "eager"}),
}
# Cases whose every step is a `piper_fx.no_sync` window of this many calls, each on its part of
# the rank's shard and its loss scaled by 1/calls (DDP's `no_sync()`): the last call reduces what
# the window held in its backward. The reference trains on the whole batch, as before.
WINDOWS = {"dp2_zero3_window": 2}


# Hugging Face models for `--plan`: (model, world, options), each called with a padded batch's mask.
PLAN_HUGGING_FACE: dict[str, tuple[str, int, dict]] = {
    "hf_llama_dp2_zero3": ("llama", 2, {"mesh": {"dp": 2}, "zero": 3, "codegen": "inductor"}),
    "hf_llama_dp2_zero3_bf16": ("llama", 2, {"mesh": {"dp": 2}, "zero": 3, "codegen": "inductor",
                                             "mixed_precision": BF16_FP32}),
    "hf_llama_pp2_1f1b": ("llama", 2, {"mesh": {"pp": 2}, "codegen": "eager",
                                       "pipeline": {**PIPELINE, "schedule": "1f1b"}}),
    "hf_bert_dp2_zero2": ("bert", 2, {"mesh": {"dp": 2}, "zero": 2, "codegen": "eager"}),
}


class LossOf(torch.nn.Module):
    """A Hugging Face model called on token ids, labels and an attention mask, returning its loss."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, y: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=x, attention_mask=attention_mask, labels=y).loss


def hugging_face(name: str) -> LossOf:
    """A tiny Hugging Face model, built from its config."""
    import transformers

    sizes = dict(vocab_size=CONFIG["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=2, max_position_embeddings=CONFIG["block_size"])
    if name == "llama":
        return LossOf(transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes)))
    return LossOf(transformers.BertForMaskedLM(transformers.BertConfig(
        **sizes, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)))


def global_batch(step: int, rows: int, cfg: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return (torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g),
            torch.randint(0, cfg.vocab_size, (rows, cfg.block_size), generator=g))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-12)).item()


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)


def fsdp2(model: GPT, options: dict, compiled: bool = False) -> GPT:
    """`model` under FSDP2 over every rank, each block and the root, with the options' mixed
    precision; each block `Module.compile()`d when `compiled`, as torchtitan compiles it."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(**{key: getattr(torch, value) if isinstance(value, str) else value
                                     for key, value in options["mixed_precision"].items()})
    for block in model.blocks:
        fully_shard(block, mp_policy=policy)
        if compiled:
            block.compile()
    return fully_shard(model, mp_policy=policy)


def passes(result: dict, options: dict) -> bool:
    """Whether a case's errors are within its tolerance: fp32's; under mixed precision none with
    eager codegen (the ops FSDP2 runs, in its order), and with Inductor at most twice as far
    from eager FSDP2 as the same FSDP2 with its blocks compiled (Inductor's own bf16 rounding,
    which AdamW's normalised steps carry into the parameters)."""
    errors = (result["loss"], result["params"])
    if "mixed_precision" not in options:
        return max(errors) <= RTOL
    if options.get("codegen") == "eager":
        return max(errors) == 0.0
    loss_yardstick, param_yardstick = result["yardstick"]
    # The loss is bf16: one ulp of it (2^-8 to 2^-7 relative) is the least that can differ.
    return result["loss"] <= max(2 * loss_yardstick, 2 ** -7) and result["params"] <= max(2 * param_yardstick, RTOL)


def train_call(step, x: torch.Tensor, y: torch.Tensor, calls: int) -> torch.Tensor:
    """Backward of `step` on `x`, `y`, as one call or as a `piper_fx.no_sync` window of `calls`
    calls on their parts (`WINDOWS`); the loss, detached (the mean of the calls')."""
    losses = []
    for index, (xs, ys) in enumerate(zip(x.chunk(calls), y.chunk(calls))):
        with piper_fx.no_sync(step) if index < calls - 1 else contextlib.nullcontext():
            loss = step(xs, ys)
            (loss / calls).backward()
        losses.append(loss.detach())
    return torch.stack(losses).mean()


def run_case(rank: int, world: int, device: torch.device, options: dict, calls: int = 1) -> dict | None:
    """Train piper_fx on this rank (each step in `calls` calls, `WINDOWS`) and beside it the
    reference (single-device PyTorch on rank 0 on the whole batch; under mixed precision FSDP2 on
    every rank on its shard, and with Inductor also FSDP2 with its blocks compiled, the
    yardstick); rank 0 returns the errors."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    strategy = piper_fx.parse_options(options)
    mixed = "mixed_precision" in options
    if mixed and strategy.dp != world:
        raise ValueError("a mixed-precision case is data parallel only: FSDP2 is its reference")
    cfg = GPTConfig(**CONFIG)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    if strategy.pp > 1:
        model.block_context = lambda: piper_fx.annotate("PP")
    references: dict[str, GPT] = {}  # reference, then the yardstick if any
    if mixed:
        references["fsdp2"] = fsdp2(copy.deepcopy(model), options)
        if options.get("codegen") != "eager":
            references["fsdp2_compiled"] = fsdp2(copy.deepcopy(model), options, compiled=True)
    elif rank == 0:
        references["single"] = copy.deepcopy(model)
    piper_fx.prepare(model, options)
    optimizers = [adamw(m.parameters()) for m in (model, *references.values())]
    step = torch.compile(model, backend="piper", options=options)
    losses: dict[str, list[float]] = {name: [] for name in ("piper", *references)}
    for i in range(STEPS):
        x, y = (t.to(device) for t in global_batch(i, ROWS_PER_RANK * strategy.dp, cfg))
        shard = x.chunk(strategy.dp)[strategy.dp_index], y.chunk(strategy.dp)[strategy.dp_index]
        step_losses = {"piper": train_call(step, *shard, calls)}
        step_losses.update({name: ref(*shard) if mixed else ref(x, y) for name, ref in references.items()})
        for name, loss in step_losses.items():
            if name != "piper":
                loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad()
        for name, loss in step_losses.items():
            loss = loss.detach().float().clone()
            if name == "piper" or mixed:  # each replica's loss is its shard's mean; every pipeline rank reports it
                dist.all_reduce(loss)
                loss /= world
            losses[name].append(loss.item())
    params = {"piper": piper_fx.full_state_dict(model)}  # collective: every rank takes part
    params.update({name: {key: value.full_tensor() if isinstance(value, DTensor) else value
                          for key, value in ref.state_dict().items()} for name, ref in references.items()})
    if rank != 0:
        return None

    def errors(name: str, expected: str) -> tuple[float, float]:
        return (max(abs(a - e) / abs(e) for a, e in zip(losses[name], losses[expected])),
                max(relative_error(params[name][key].to(device), value) for key, value in params[expected].items()))

    reference, *yardstick = references
    loss_error, param_error = errors("piper", reference)
    return {"loss": loss_error, "params": param_error,
            "yardstick": errors(yardstick[0], reference) if yardstick else None}


def plan_case(device_type: str, case: str, result_path: str) -> None:
    """`case` as rank 0 of a fake process group of its world size: two steps planned, compiled
    and run on this device (the fake group's collectives move nothing)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world, options = (CASES[case] if case in CASES else PLAN_HUGGING_FACE[case][1:])
    os.environ.update(RANK="0", WORLD_SIZE=str(world), LOCAL_RANK="0")
    device = torch.device(device_type)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    strategy = piper_fx.parse_options(options)
    cfg = GPTConfig(**CONFIG)
    torch.manual_seed(0)
    if case in CASES:
        model = GPT(cfg).to(device)
        if strategy.pp > 1:
            model.block_context = lambda: piper_fx.annotate("PP")
    else:
        model = hugging_face(PLAN_HUGGING_FACE[case][0]).to(device)
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    for i in range(2):
        x, y = (t.to(device) for t in global_batch(i, ROWS_PER_RANK, cfg))
        if case in CASES:
            train_call(step, x, y, WINDOWS.get(case, 1))
        else:  # every other row padded: its last 3 tokens masked, their labels ignored
            mask = torch.ones_like(x)
            mask[::2, -3:] = 0
            step(x, y.masked_fill(mask == 0, -100), mask).backward()
    Path(result_path).write_text(json.dumps({}))
    dist.destroy_process_group()


def rank_main(rank: int, world: int, device_type: str, init_method: str, case: str, result_path: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    if device_type == "cuda":
        torch.cuda.set_device(rank)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    dist.init_process_group("nccl" if device_type == "cuda" else "gloo", init_method=init_method, rank=rank,
                            world_size=world, timeout=COLLECTIVE_TIMEOUT)
    try:
        result = run_case(rank, world, device, CASES[case][1], WINDOWS.get(case, 1))
        if result is not None:
            Path(result_path).write_text(json.dumps(result))
    finally:
        dist.destroy_process_group()


def spawn_case(case: str, device_type: str, planned: bool = False) -> dict:
    """Run one case's ranks to completion (`planned`: its rank 0 alone, `plan_case`): rank 0's
    result, or the failure (the first rank to exit non-zero)."""
    world = 1 if planned else CASES[case][0]
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "result.json")
        init_method = f"file://{os.path.join(tmp, 'rendezvous')}"
        procs = [ctx.Process(target=plan_case, args=(device_type, case, result_path)) if planned else
                 ctx.Process(target=rank_main, args=(r, world, device_type, init_method, case, result_path))
                 for r in range(world)]
        for proc in procs:
            proc.start()
        failed = None
        try:
            running = dict(enumerate(procs))
            while running and failed is None:
                wait([proc.sentinel for proc in running.values()])
                for r, proc in list(running.items()):
                    if proc.exitcode is not None:
                        del running[r]
                        if proc.exitcode != 0 and failed is None:
                            failed = f"rank {r} failed with exit code {proc.exitcode}"
        finally:
            for proc in procs:
                if proc.is_alive():
                    proc.terminate()
                proc.join()
        if failed is not None:
            return {"error": failed}
        return json.loads(Path(result_path).read_text())


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"],
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--nproc", type=int, default=None,
                        help="ranks available (default: the number of GPUs; on CPU, 4)")
    parser.add_argument("--cases", default=None,
                        help=f"comma-separated, of: {', '.join(CASES)}; "
                             f"with --plan also {', '.join(PLAN_HUGGING_FACE)}")
    parser.add_argument("--plan", action="store_true",
                        help="run a case needing more ranks than there are as rank 0 of a fake process group "
                             "(planned and run, no numbers compared), and the Hugging Face cases")
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("device_check: --device cuda, but torch sees no GPU", file=sys.stderr)
        return 2
    available = args.nproc or (torch.cuda.device_count() if args.device == "cuda" else 4)
    known = {**CASES, **(PLAN_HUGGING_FACE if args.plan else {})}
    names = args.cases.split(",") if args.cases else list(known)
    unknown = [name for name in names if name not in known]
    if unknown:
        print(f"device_check: unknown cases {unknown}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, device {args.device} ({device_name}), {available} rank(s) available, "
          f"{STEPS} AdamW steps, tolerance {RTOL:g} (relative; bf16 against eager FSDP2: 0 with eager codegen, "
          f"with Inductor twice FSDP2 compiled's)")
    print(f"{'case':<26} {'world':>5} {'loss err':>10} {'param err':>10}  result")
    bad = 0
    for name in names:
        world = CASES[name][0] if name in CASES else PLAN_HUGGING_FACE[name][1]
        if world > available or name not in CASES:
            if not args.plan:
                print(f"{name:<26} {world:>5} {'':>10} {'':>10}  not run: needs {world} ranks")
                continue
            result = spawn_case(name, args.device, planned=True)
            bad += "error" in result
            print(f"{name:<26} {world:>5} {'':>10} {'':>10}  " + (f"FAILED: {result['error']}" if "error" in result
                  else "planned and ran as rank 0 of a fake group"), flush=True)
            continue
        result = spawn_case(name, args.device)
        if "error" in result:
            bad += 1
            print(f"{name:<26} {world:>5} {'':>10} {'':>10}  FAILED: {result['error']}")
            continue
        ok = passes(result, CASES[name][1])
        bad += not ok
        yardstick = (f" (FSDP2 compiled: {result['yardstick'][0]:.2e} {result['yardstick'][1]:.2e})"
                     if result["yardstick"] else "")
        print(f"{name:<26} {world:>5} {result['loss']:>10.2e} {result['params']:>10.2e}  "
              f"{'equal' if ok else 'DIFFERENT'}{yardstick}", flush=True)
    print("all cases passed" if bad == 0 else f"{bad} case(s) failed or not equal")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
