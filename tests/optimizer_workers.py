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


def _like_the_parameter(p, g) -> DTensor:
    """A gradient as the hand-over gives it: a DTensor of the parameter's spec."""
    return dtensor_like(torch.randn(p.to_local().shape, generator=g), p)


def _against_dtensor_dispatch(build, make_optimizer, rank: int, gradients) -> dict:
    """Two models from `build` trained alike, one through DTensor's own dispatch of the fused
    ops: how many calls ran on the local tensors, of how many, and whether every parameter
    and state ended bitwise equal."""
    model, reference = build(), build()
    opt, ref_opt = make_optimizer(list(model.parameters())), make_optimizer(list(reference.parameters()))
    with _recorded() as calls:
        _train(model, opt, rank, gradients)
    with _dtensor_dispatch():
        _train(reference, ref_opt, rank, gradients)
    return {"local_calls": sum(calls), "calls": len(calls),
            "equal": all(torch.equal(a, b) for a, b in zip(_local_state(model, opt), _local_state(reference, ref_opt)))}


def _prepared(zero: int):
    torch.manual_seed(0)
    return piper_fx.prepare(GPT(GPTConfig(**SMALL)), {"zero": zero})


def fused_step_worker(rank: int, world: int, zero: int) -> dict:
    """Per fused optimizer: a prepared model's steps with the fused op run on the local tensors,
    against the same steps through DTensor's own dispatch, from the same parameters and
    gradients (`_against_dtensor_dispatch`)."""
    return {name: _against_dtensor_dispatch(lambda: _prepared(zero), make, rank, _like_the_parameter)
            for name, make in FUSED.items()}


def fused_step_fallback_worker(rank: int, world: int) -> dict:
    """Calls this module does not run on local tensors go through DTensor's own dispatch and
    compute what it computes: parameters piper_fx did not lay out (DTensors of one's own, as
    FSDP2's), and gradients placed unlike their parameter (`Shard(0)` for a `Replicate()` one)."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (world,))

    def own_dtensors():
        torch.manual_seed(0)
        linear = torch.nn.Linear(8, 4)
        for name, p in list(linear.named_parameters()):
            linear.register_parameter(name, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Replicate()])))
        return linear

    def sharded(p, g):
        grad = torch.randn(p.shape, generator=torch.Generator().manual_seed(7))  # the same on every rank
        return distribute_tensor(grad, p.device_mesh, [Shard(0)]) if p.dim() else dtensor_like(grad, p)

    return {"not laid out by piper_fx": _against_dtensor_dispatch(own_dtensors, FUSED["adamw"], rank,
                                                                  _like_the_parameter),
            "gradient placed otherwise": _against_dtensor_dispatch(lambda: _prepared(0), FUSED["adamw"], rank,
                                                                   sharded)}
