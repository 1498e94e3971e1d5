"""Per-rank fused optimizer steps over a prepared model's DTensor parameters (run inside `run_ranks`)."""
from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

import piper_fx
from examples.gpt import GPT, GPTConfig
from piper_fx.compat import dtensor_like, dtensor_op_handlers
from piper_fx.sharding import fused_optimizers
from training import SMALL

STEPS = 3
# name -> a fused optimizer over `params`: each fused op DTensor runs (Adam's, AdamW's) and overload
# (a tensor learning rate), with and without amsgrad's list
FUSED = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    "adamw_amsgrad": lambda params: torch.optim.AdamW(params, lr=1e-2, amsgrad=True, fused=True),
    "adam_tensor_lr": lambda params: torch.optim.Adam(params, lr=torch.tensor(1e-2), fused=True),
}


@contextlib.contextmanager
def _recorded():
    """The calls of the fused ops while inside, each as True where it ran on the local tensors."""
    handlers = dtensor_op_handlers()
    ops = [op for op in handlers if handlers[op] is fused_optimizers._on_local_tensors]
    calls: list[bool] = []

    def recorder(op, args, kwargs):
        calls.append(fused_optimizers._local_arguments(op, args, kwargs) is not None)
        return fused_optimizers._on_local_tensors(op, args, kwargs)

    for op in ops:
        handlers[op] = recorder
    try:
        yield calls
    finally:
        for op in ops:
            handlers[op] = fused_optimizers._on_local_tensors


@contextlib.contextmanager
def _dtensor_dispatch():
    """DTensor's own dispatch of the fused ops while inside (the reference)."""
    handlers = dtensor_op_handlers()
    ours = {op: handlers.pop(op) for op in list(handlers) if handlers[op] is fused_optimizers._on_local_tensors}
    try:
        yield
    finally:
        handlers.update(ours)


def _local_state(model, opt) -> list[torch.Tensor]:
    tensors = [p for p in model.parameters()]
    tensors += [v for p in model.parameters() for v in opt.state[p].values() if isinstance(v, torch.Tensor)]
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def _train(model, opt, rank: int, gradients) -> None:
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        for p in model.parameters():
            p.grad = gradients(p, g)
        opt.step()
        opt.zero_grad()


def fused_step_worker(rank: int, world: int, zero: int) -> dict:
    """Per fused optimizer: a prepared model's steps with the fused op run on the local tensors,
    against the same steps through DTensor's own dispatch, from the same parameters and
    gradients (DTensors of each parameter's spec, as the hand-over gives them). Returns, per
    optimizer, how many calls ran on the local tensors, of how many, and whether every
    parameter and state ended bitwise equal."""

    def prepared():
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL))
        return piper_fx.prepare(model, {"zero": zero})

    def like_the_parameter(p, g):
        return dtensor_like(torch.randn(p.to_local().shape, generator=g), p)

    report = {}
    for name, make in FUSED.items():
        model, reference = prepared(), prepared()
        opt, ref_opt = make(list(model.parameters())), make(list(reference.parameters()))
        with _recorded() as calls:
            _train(model, opt, rank, like_the_parameter)
        with _dtensor_dispatch():
            _train(reference, ref_opt, rank, like_the_parameter)
        report[name] = {"local_calls": sum(calls), "calls": len(calls),
                        "equal": all(torch.equal(a, b) for a, b in
                                     zip(_local_state(model, opt), _local_state(reference, ref_opt)))}
    return report


def fused_step_fallback_worker(rank: int, world: int) -> dict:
    """Calls this module does not run on local tensors go through DTensor's own dispatch and
    compute what it computes: parameters piper_fx did not lay out (DTensors of one's own, as
    FSDP2's), and gradients placed unlike their parameter (`Shard(0)` for a `Replicate()` one)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    report = {}

    def own_dtensors():
        torch.manual_seed(0)
        return torch.nn.ModuleList([torch.nn.Linear(8, 4)]).apply(
            lambda m: [m.register_parameter(n, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
                       for n, p in list(m.named_parameters(recurse=False))])

    def whole(p, g):
        return dtensor_like(torch.randn(p.to_local().shape, generator=g), p)

    def sharded(p, g):
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(7))  # the same on every rank
        return distribute_tensor(grad, p.device_mesh, [Shard(0)]) if p.dim() else dtensor_like(grad, p)

    def prepared():
        torch.manual_seed(0)
        return piper_fx.prepare(GPT(GPTConfig(**SMALL)), {"zero": 0})

    for name, build, gradients in (("not laid out by piper_fx", own_dtensors, whole),
                                   ("gradient placed otherwise", prepared, sharded)):
        model, reference = build(), build()
        opt, ref_opt = FUSED["adamw"](list(model.parameters())), FUSED["adamw"](list(reference.parameters()))
        with _recorded() as calls:
            _train(model, opt, rank, gradients)
        with _dtensor_dispatch():
            _train(reference, ref_opt, rank, gradients)
        report[name] = {"local_calls": sum(calls), "calls": len(calls),
                        "equal": all(torch.equal(a, b) for a, b in
                                     zip(_local_state(model, opt), _local_state(reference, ref_opt)))}
    return report
