"""Mixed precision (run inside `run_ranks`): piper_fx against FSDP2 and single-process training
under one `MixedPrecisionPolicy`, and against DDP or one process under `torch.autocast`, on the
same global batches."""
from __future__ import annotations

import contextlib
import copy

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.func import functional_call
from torch.nn.parallel import DistributedDataParallel

import piper_fx
from examples.gpt import GPT, GPTConfig
from piper_fx.sharding.holdings import is_stored
from training import SMALL, global_batch, mark_regions, relative_error


def _policy(options: dict) -> MixedPrecisionPolicy:
    """The options' mixed precision as FSDP2's policy."""
    return MixedPrecisionPolicy(**{key: getattr(torch, value) if isinstance(value, str) else value
                                   for key, value in options["mixed_precision"].items()})


def _optimizer(name: str, params):
    if name == "sgd":  # gradient differences reach the parameters linearly, so they bound them
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _single_process_step(model: torch.nn.Module, x, y, policy: MixedPrecisionPolicy) -> torch.Tensor:
    """One step of `model` on the whole batch, its parameters read cast to `param_dtype`
    (gradients flow back to the fp32 parameters through the casts)."""
    params = {name: p.to(policy.param_dtype) for name, p in model.named_parameters()}
    return functional_call(model, params, (x, y), tie_weights=True)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _mean_over_ranks(loss: torch.Tensor, world: int) -> float:
    loss = loss.detach().float().clone()
    dist.all_reduce(loss)
    return loss.item() / world


def _backward_and_step(losses: tuple[torch.Tensor, ...], optimizers: list[torch.optim.Optimizer]) -> None:
    """Each side's backward from its loss, then each side's optimizer step."""
    for loss in losses:
        loss.backward()
    for opt in optimizers:
        opt.step()
        opt.zero_grad()


def _fp32_comm_bytes(options: dict, cfg: GPTConfig, pp_regions: bool, x, y, rank: int, dp: int) -> dict:
    """The bytes of one step's collectives under `options` without mixed precision."""
    options = {k: v for k, v in options.items() if k != "mixed_precision"}
    model = GPT(cfg)
    if pp_regions:
        model.block_context = lambda: piper_fx.annotate("PP")
    piper_fx.prepare(model, options)
    rows = x.shape[0] // dp
    torch.compile(model, backend="piper", options=options)(x[rank % dp * rows:][:rows],
                                                           y[rank % dp * rows:][:rows]).backward()
    return piper_fx.last_step_stats()["comm_bytes"]


def mixed_precision_worker(rank: int, world: int, options: dict, optimizer: str = "adamw", steps: int = 10,
                           per_rank_batch: int = 2, pp_regions: bool = False, tied: bool = False,
                           accumulate: int = 1) -> dict:
    """Train the GPT (its head tied to its embedding if `tied`) `steps` steps with piper_fx
    under `options`, FSDP2 over every rank with the options' mixed precision as its
    `MixedPrecisionPolicy`, and one process with the same casts, on the same global batches;
    return each one's losses and final parameters. With `accumulate` > 1 each step
    accumulates that many calls' gradients (each loss divided by it), all but the last
    without gradient synchronization: piper_fx's `no_sync`, FSDP2's
    `set_requires_gradient_sync(False)`."""
    policy = _policy(options)
    cfg = GPTConfig(**SMALL, tied_embeddings=tied)
    torch.manual_seed(0)
    model = GPT(cfg)
    fsdp, single = copy.deepcopy(model), copy.deepcopy(model)
    if pp_regions:
        model.block_context = lambda: piper_fx.annotate("PP")
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    for block in fsdp.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(fsdp, mp_policy=policy)
    initial = {k: v.detach().clone() for k, v in single.state_dict().items()}
    optimizers = [_optimizer(optimizer, m.parameters()) for m in (model, fsdp, single)]

    mesh = options.get("mesh", {})
    dp = mesh.get("dp", world // mesh.get("pp", 1))
    losses: dict[str, list[float]] = {"piper": [], "fsdp2": [], "single": []}
    for i in range(steps * accumulate):
        x, y = global_batch(i, per_rank_batch * world, cfg)
        rows = x.shape[0] // dp
        synced = i % accumulate == accumulate - 1
        fsdp.set_requires_gradient_sync(synced)
        with contextlib.nullcontext() if synced else piper_fx.no_sync(step):
            piper_loss = step(x[rank % dp * rows:][:rows], y[rank % dp * rows:][:rows])
            fsdp_loss = fsdp(x.chunk(world)[rank], y.chunk(world)[rank])
            single_loss = _single_process_step(single, x, y, policy)
            scaled = [loss / accumulate if accumulate > 1 else loss for loss in (piper_loss, fsdp_loss, single_loss)]
            _backward_and_step(scaled, optimizers if synced else [])
        losses["piper"].append(_mean_over_ranks(piper_loss, world))
        losses["fsdp2"].append(_mean_over_ranks(fsdp_loss, world))
        losses["single"].append(single_loss.item())
    comm_bytes = piper_fx.last_step_stats()["comm_bytes"]

    return {
        "losses": losses,
        "comm_bytes": comm_bytes,
        "fp32_comm_bytes": _fp32_comm_bytes(options, cfg, pp_regions, x, y, rank, dp),
        "initial": initial,
        "loss_dtypes": [str(piper_loss.dtype), str(fsdp_loss.dtype), str(single_loss.dtype)],
        "param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
        "numel": sum(p.numel() for p in single.parameters()),  # each parameter once, a tied one too
        "piper": {k: v.float() for k, v in piper_fx.full_state_dict(model).items()},
        "fsdp2": {k: _full(v.detach()).clone() for k, v in fsdp.state_dict().items()},
        "single": {k: v.detach().clone() for k, v in single.state_dict().items()},
    }


def hf_mixed_precision_worker(rank: int, world: int, name: str, options: dict, optimizer: str = "adamw",
                              steps: int = 3) -> dict:
    """A tiny Hugging Face model (`training.HUGGING_FACE[name]`) trained `steps` steps with
    piper_fx under `options` and with FSDP2 over every rank under the options' mixed
    precision (`fully_shard` on each of the model's layers, `_no_split_modules`, and at the
    root), on the same global batches: each one's losses, and the initial and final parameters."""
    from training import HUGGING_FACE, LossOf, llama_batch

    policy = _policy(options)
    torch.manual_seed(0)
    model = HUGGING_FACE[name]()
    fsdp = copy.deepcopy(model)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = options.get("mesh", {})
    pipelined = mesh.get("pp", 1) > 1
    dp = mesh.get("dp", world // mesh.get("pp", 1))
    compiled = LossOf(model) if pipelined else None
    piper_fx.prepare(compiled or model, options)
    step = torch.compile(compiled or (lambda x, y: model(input_ids=x, labels=y).loss), backend="piper",
                         options=options)
    for module in fsdp.modules():
        if type(module).__name__ in fsdp._no_split_modules:
            fully_shard(module, mp_policy=policy)
    fully_shard(fsdp, mp_policy=policy)
    optimizers = [_optimizer(optimizer, m.parameters()) for m in (model, fsdp)]
    losses: dict[str, list[float]] = {"piper": [], "fsdp2": []}
    for i in range(steps):
        x, y = llama_batch(i, 4 * world)  # 4 rows a rank: 2 a microbatch under a pipeline
        rows = x.shape[0] // dp
        piper_loss = step(x[rank % dp * rows:][:rows], y[rank % dp * rows:][:rows])
        fsdp_loss = fsdp(input_ids=x.chunk(world)[rank], labels=y.chunk(world)[rank]).loss
        _backward_and_step((piper_loss, fsdp_loss), optimizers)
        losses["piper"].append(_mean_over_ranks(piper_loss, world))
        losses["fsdp2"].append(_mean_over_ranks(fsdp_loss, world))
    return {
        "losses": losses,
        "initial": initial,
        "piper": {k.removeprefix("model.") if pipelined else k: v.float()
                  for k, v in piper_fx.full_state_dict(compiled or model).items()},
        "fsdp2": {k: _full(v.detach()).clone() for k, v in fsdp.state_dict().items()},
    }


def autocast_worker(rank: int, world: int, configs: list[dict], steps: int = 3) -> list[dict]:
    """For each options dict: AdamW steps of the example GPT under `torch.autocast` (bf16 on the
    model's device type) with piper_fx, against the same policy without it: DDP under autocast on
    the same per-rank rows where the options only shard data, else one process under autocast
    stepping the same microbatches (each loss scaled by 1/(ranks * microbatches)). Then one more
    call of the same compiled step outside autocast, against the reference's fp32 loss. Per
    config: the losses of both sides, the largest relative parameter difference, and the loss
    of one fp32 reference step (autocast must change it, or the comparison proves nothing)."""
    results = []
    for options in configs:
        pp = options.get("mesh", {}).get("pp", 1)
        dp = world // pp
        microbatches = options.get("pipeline", {}).get("microbatches", 1)
        cfg = GPTConfig(**{**SMALL, "n_layer": 2 * pp}, tied_embeddings=False)
        torch.manual_seed(0)
        model = mark_regions(GPT(cfg), pipeline=pp > 1)
        reference = copy.deepcopy(model)
        fp32 = copy.deepcopy(model)
        device_type = next(model.parameters()).device.type
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
        ref_step = DistributedDataParallel(reference) if pp == 1 else None
        opt, ref_opt = (_optimizer("adamw", m.parameters()) for m in (model, reference))
        out: dict = {"piper": [], "reference": []}
        for i in range(steps + 1):
            x, y = global_batch(i, 4 * dp, cfg)
            rows = (x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp])
            amp = torch.autocast(device_type, dtype=torch.bfloat16) if i < steps else contextlib.nullcontext()
            with amp:
                loss = step(*rows)
            loss.backward()
            if ref_step is not None:
                with amp:
                    ref_loss = ref_step(*rows)
                ref_loss.backward()
                ref_loss = _mean_over_ranks(ref_loss, world)
            else:
                ref_loss = 0.0
                for xm, ym in zip(x.chunk(dp * microbatches), y.chunk(dp * microbatches)):
                    with amp:
                        part = reference(xm, ym) / (dp * microbatches)
                    part.backward()
                    ref_loss += part.item()
            if i < steps:
                _backward_and_step((), [opt, ref_opt])
            out["piper"].append(_mean_over_ranks(loss, dp) if pp == 1 else loss.item())
            out["reference"].append(ref_loss)
        out["param_error"] = max(relative_error(_full(p.detach()), q.detach()) for p, q in
                                 zip(model.parameters(), reference.parameters()) if is_stored(p))
        x, y = global_batch(0, 4 * dp, cfg)
        out["fp32_first_loss"] = fp32(x, y).item()
        results.append(out)
    return results
