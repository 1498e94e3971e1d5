"""Per-rank gradient accumulation with `piper_fx.no_sync` and `set_requires_gradient_sync` against
single-process training on the same batches (run inside `run_ranks`; tests/test_gradient_sync.py)."""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import piper_fx
from examples.gpt import GPT, GPTConfig
from training import SMALL, global_batch, make_optimizer, mark_regions, relative_error


def accumulate_and_train(rank: int, world: int, options: dict, calls: int = 3, steps: int = 2,
                         context: bool = True, tied: bool = True, window: bool = True, experts: int = 0,
                         part: str | None = None) -> dict:
    """`steps` SGD steps of `calls` calls each, every call's loss scaled by 1/calls, all but the
    last with synchronization off (`no_sync`, or `set_requires_gradient_sync` where `context` is
    False; every call synchronizing where `window` is False), against one model accumulating the
    same global batches; with `experts`, the GPT's mixture of experts shared out over `mesh.ep`;
    with `part`, the window set on that submodule alone. Per call: the bytes this rank sent by
    each collective kind, in its program alone (before its backward) and in all, and whether any gradient of the window's parameters changed (it must
    not inside the window), and any other's; at the end each parameter's relative error."""
    mesh = options.get("mesh", {})
    pp = mesh.get("pp", 1)
    dp = mesh.get("dp", world // pp)
    cfg = GPTConfig(**{**SMALL, "n_layer": 2 * pp}, tied_embeddings=tied, n_expert=experts)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    model = mark_regions(GPT(cfg), pipeline=pp > 1, experts=bool(experts))
    piper_fx.prepare(model, options)
    opt = make_optimizer("sgd", model.parameters())
    ref_opt = make_optimizer("sgd", reference.parameters())
    compiled = torch.compile(model, backend="piper", options=options)
    windowed = compiled if part is None else model.get_submodule(part)
    inside = [part is None or name.startswith(part + ".") for name, _ in model.named_parameters()]
    out: dict = {"comm_bytes": [], "grads_changed_in_window": [], "others_changed_in_window": [], "loss_errors": [],
                 "window_bytes": sum(p.numel() * p.element_size() for p in windowed.parameters())}
    per_rank = 2 * max(pp, 1)
    out["comm_in_call"] = []

    def run_call(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = compiled(x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp])
        # What the call's program sent before its backward: the first call after a window reduces what
        # the window held there, overlapped with its backward, where the strategy allows it.
        out["comm_in_call"].append({k: v for k, v in piper_fx.last_step_stats()["comm_bytes"].items() if v})
        return loss

    for step in range(steps):
        for call in range(calls):
            x, y = global_batch(step * calls + call, per_rank * dp, cfg)
            last = call == calls - 1
            before = [None if p.grad is None else p.grad.full_tensor().clone() for p in model.parameters()]
            if not window:
                loss = run_call(x, y)
                (loss / calls).backward()
            elif not last and context:
                with piper_fx.no_sync(windowed):
                    loss = run_call(x, y)
                    (loss / calls).backward()
            else:
                if not context:
                    piper_fx.set_requires_gradient_sync(windowed, last)
                loss = run_call(x, y)
                (loss / calls).backward()
            stats = piper_fx.last_step_stats()
            out["comm_bytes"].append({k: v for k, v in stats["comm_bytes"].items() if v})
            if not last:
                after = [None if p.grad is None else p.grad.full_tensor() for p in model.parameters()]
                changed = [(a is None) != (b is None) or (a is not None and not torch.equal(a, b))
                           for a, b in zip(before, after)]
                out["grads_changed_in_window"].append(any(c for c, i in zip(changed, inside) if i))
                out["others_changed_in_window"].append(any(c for c, i in zip(changed, inside) if not i))
            ref_loss = reference(x, y)
            (ref_loss / calls).backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            mean /= world
            out["loss_errors"].append(abs(mean.item() - ref_loss.item()) / abs(ref_loss.item()))
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    full, expected = piper_fx.full_state_dict(model), reference.state_dict()
    out["param_errors"] = {name: relative_error(full[name], expected[name]) for name in expected}
    return out


def gradient_sync_worker(rank: int, world: int, configs: list[dict]) -> list[dict]:
    results = []
    for config in configs:
        config = dict(config)
        options = {"codegen": "eager", **config.pop("options")}
        results.append(accumulate_and_train(rank, world, options, **config))
        torch._dynamo.reset()
    return results



def backward_forms_worker(rank: int, world: int, zero: int) -> dict:
    """The other forms of backward through calls of a window, against one process running the same
    on the global batches: (a) `backward(inputs=...)` inside the window holds the gradients of the
    parameters it names alone; (b) `torch.autograd.grad` inside it is a `PiperError` (the window
    hands no gradient back before its end); (c) `torch.autograd.grad` of a call with
    synchronization on gets that call's reduced gradients and leaves what is held; (d) the next
    `backward()` reduces what (a) held with its own; then a window of a call whose loss is scaled
    by 1/4 and one by 0 (e), and a call without backward, which changes nothing, the next call's scaled by 1/2
    and backward of some parameters (f), which reduces what was held of those with its own (the
    seeds differ) and leaves the others' held, and a `backward()` (g) that reduces those with its
    own, scaled by 1. The relative error of each
    parameter's gradient after (c), (d) and (g), of those (f) names after it, and (b)'s message."""
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    options = {"zero": zero, "codegen": "eager"}
    piper_fx.prepare(model, options)
    compiled = torch.compile(model, backend="piper", options=options)
    params, ref_params = list(model.parameters()), list(reference.parameters())
    named = [1, 4, 9]  # the position embedding, the first block's qkv weight and its ln_2 bias

    def replica(call: int) -> tuple:
        x, y = global_batch(call, 2 * world, cfg)
        return (x, y), (x.chunk(world)[rank], y.chunk(world)[rank])

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    out: dict = {}
    with piper_fx.no_sync(compiled):
        batch, mine = replica(0)
        compiled(*mine).backward(inputs=[params[i] for i in named])  # (a)
        reference(*batch).backward(inputs=[ref_params[i] for i in named])
        try:  # (b)
            torch.autograd.grad(compiled(*replica(1)[1]), params)
        except piper_fx.PiperError as error:
            out["autograd_in_window"] = str(error)
    batch, mine = replica(2)  # (c)
    grads = torch.autograd.grad(compiled(*mine), params)
    ref_grads = torch.autograd.grad(reference(*batch), ref_params)
    out["autograd_errors"] = [relative_error(full(g), r) for g, r in zip(grads, ref_grads, strict=True)]
    out["grads_after_autograd"] = [p.grad is not None for p in params]
    batch, mine = replica(3)  # (d)
    compiled(*mine).backward()
    reference(*batch).backward()
    out["grad_errors"] = [relative_error(full(p.grad), q.grad) for p, q in zip(params, ref_params, strict=True)]
    with piper_fx.no_sync(compiled):  # (e)
        batch, mine = replica(4)
        (compiled(*mine) / 4).backward()
        (reference(*batch) / 4).backward()
        batch, mine = replica(8)  # its latest call's loss scaled by 0: what was held is not divided by it
        (compiled(*mine) * 0).backward()
        (reference(*batch) * 0).backward()
    compiled(*replica(7)[1])  # a call whose backward never runs (an evaluation with grad enabled, say)
    batch, mine = replica(5)  # (f)
    (compiled(*mine) * 0.5).backward(inputs=[params[i] for i in named])
    (reference(*batch) * 0.5).backward(inputs=[ref_params[i] for i in named])
    out["named_errors"] = [relative_error(full(params[i].grad), ref_params[i].grad) for i in named]
    batch, mine = replica(6)  # (g)
    compiled(*mine).backward()
    reference(*batch).backward()
    out["seeds_errors"] = [relative_error(full(p.grad), q.grad) for p, q in zip(params, ref_params, strict=True)]
    return out


def calls_worker(rank: int, world: int, zero: int, microbatches: int, calls: list[tuple[bool, str, float]]) -> dict:
    """`calls` of the GPT prepared at `zero` over `world` replicas (in `microbatches` each), each (in a window, how its
    backward goes, its loss's scale), against one process making the same calls on the global
    batches: a window's call goes back by `backward()` ("backward") or `backward(inputs=...)` of
    three parameters ("inputs"); a call with synchronization on by those, by
    `torch.autograd.grad` ("autograd", whose gradients it compares), or not at all ("none");
    then a `backward()` with synchronization on, after which every gradient is compared. The
    largest relative error of the gradients each comparison saw."""
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    model = GPT(cfg)
    options = {"zero": zero, "codegen": "eager", "pipeline": {"microbatches": microbatches}}
    piper_fx.prepare(model, options)
    compiled = torch.compile(model, backend="piper", options=options)
    params, ref_params = list(model.parameters()), list(reference.parameters())
    named = [1, 4, 9]

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    errors = []
    for index, (in_window, form, scale) in enumerate([*calls, (False, "backward", 1.0)]):
        x, y = global_batch(100 + index, 2 * world * microbatches, cfg)
        with piper_fx.no_sync(compiled) if in_window else contextlib.nullcontext():
            loss, ref_loss = compiled(x.chunk(world)[rank], y.chunk(world)[rank]) * scale, reference(x, y) * scale
            if form == "backward":
                loss.backward()
                ref_loss.backward()
            elif form == "inputs":
                loss.backward(inputs=[params[i] for i in named])
                ref_loss.backward(inputs=[ref_params[i] for i in named])
            elif form == "autograd":
                grads = torch.autograd.grad(loss, params)
                ref_grads = torch.autograd.grad(ref_loss, ref_params)
                errors.append(max(relative_error(full(g), r) for g, r in zip(grads, ref_grads, strict=True)))
    errors.append(max(relative_error(full(p.grad), q.grad) for p, q in zip(params, ref_params, strict=True)))
    return {"errors": errors}
