"""Per-rank training with `piper_fx.clip_grad_norm_` against single-process training clipped by torch
(run inside `run_ranks`; tests/test_clipping.py)."""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

import piper_fx
from examples.gpt import GPT, GPTConfig
from piper_fx.clipping import clip_grad_norm_
from piper_fx.compat import resolve_process_group
from piper_fx.sharding.holdings import held_parameters
from training import SMALL, global_batch, local, make_optimizer, mark_regions, relative_error


def _reference_rows(holding, reference_grad: torch.Tensor, rows: int) -> torch.Tensor:
    """The rows of the reference's (full) gradient that this rank's piece, of `rows` rows, holds."""
    if holding.shard_group is None:
        return reference_grad
    full = reference_grad.reshape(1) if reference_grad.dim() == 0 else reference_grad
    group = resolve_process_group(holding.shard_group)
    shard_rows = -(-full.shape[0] // dist.get_world_size(group))
    start = dist.get_rank(group) * shard_rows
    return full[start:start + rows]


def clip_and_train(rank: int, world: int, options: dict, max_norm: float, norm_type: float = 2.0,
                   experts: int = 0, per_rank_batch: int = 2, steps: int = 3, n_layer: int = 2) -> dict:
    """Train a tied-embedding GPT with piper_fx on this rank's shard, clipping each step with
    `piper_fx.clip_grad_norm_`, and alongside one model on the global batch clipped by
    `torch.nn.utils.clip_grad_norm_` (AdamW, `adamw_eps`). Per step: both norms, the norm torch
    would compute from this rank's own gradients, and the worst relative error of this rank's
    clipped gradients (every piece it holds, counted or not) against the reference's."""
    cfg = GPTConfig(**{**SMALL, "n_layer": n_layer}, tied_embeddings=True, n_expert=experts)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    model = mark_regions(GPT(cfg), pipeline=options.get("mesh", {}).get("pp", 1) > 1, experts=bool(experts))
    piper_fx.prepare(model, options)
    opt = make_optimizer("adamw_eps", model.parameters())
    ref_opt = make_optimizer("adamw_eps", reference.parameters())
    step = torch.compile(model, backend="piper", options=options)
    mesh = options.get("mesh", {})
    dp = mesh.get("dp", world // mesh.get("pp", 1))

    out = {"norms": [], "reference_norms": [], "rank_local_norms": [], "grad_errors": [], "loss_errors": [],
           "pieces": 0}
    for i in range(steps):
        x, y = global_batch(i, per_rank_batch * dp, cfg)
        loss = step(x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp])
        loss.backward()
        ref_loss = reference(x, y)
        ref_loss.backward()

        own_grads = [local(p.grad) for p in model.parameters() if p.grad is not None]
        out["rank_local_norms"].append(torch.nn.utils.get_total_norm(own_grads, norm_type).item())
        norm = clip_grad_norm_(model.parameters(), max_norm, norm_type)
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), max_norm, norm_type)
        out["norms"].append(norm.item())
        out["reference_norms"].append(ref_norm.item())

        # Every gradient this rank holds, clipped, against the same rows of the clipped reference's.
        worst = 0.0
        for held in held_parameters(model):
            grad = held.parameter.grad
            if grad is None:
                continue
            expected = reference.get_parameter(held.fqns[0]).grad
            piece = held.holding.local(grad)
            scale = expected.abs().max().clamp_min(1e-12)
            error = ((piece - _reference_rows(held.holding, expected, piece.shape[0] if piece.dim() else 1)
                      .reshape(piece.shape)).abs().max() / scale).item()
            worst = max(worst, error)
            out["pieces"] += 1
        out["grad_errors"].append(worst)

        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss)
        mean_loss /= world
        out["loss_errors"].append(abs(mean_loss.item() - ref_loss.item()) / abs(ref_loss.item()))

    full, expected = piper_fx.full_state_dict(model), reference.state_dict()
    assert full.keys() == expected.keys(), (sorted(full), sorted(expected))
    out["param_errors"] = {name: relative_error(full[name], expected[name]) for name in expected}
    return out


def clipping_worker(rank: int, world: int, configs: list[dict]) -> dict:
    """`clip_and_train` for each config in turn, then `uneven_rows_and_nonfinite`, in one process group."""
    trainings = []
    for config in configs:
        config = dict(config)
        options = {"codegen": "eager", **config.pop("options")}
        trainings.append(clip_and_train(rank, world, options, **config))
        torch._dynamo.reset()
    return {"trainings": trainings, "linear": uneven_rows_and_nonfinite(rank, world)}


def _linear_with_grads(rank: int, world: int, out_features: int, zero: int):
    """A Linear(5, out_features) at `zero` over every rank, one compiled step's gradients in it,
    and its unsplit copy with the global batch's."""
    import copy

    torch.manual_seed(0)
    model = torch.nn.Linear(5, out_features)
    reference = copy.deepcopy(model)
    options = {"zero": zero, "codegen": "eager"}
    piper_fx.prepare(model, options)
    step = torch.compile(lambda x: model(x).square().mean(), backend="piper", options=options)
    x = torch.randn(2 * world, 5, generator=torch.Generator().manual_seed(0))
    step(x.chunk(world)[rank]).backward()
    reference(x).square().mean().backward()
    return model, reference


def torch_clipping(rank: int, world: int) -> dict:
    """torch's own `clip_grad_norm_` on a Linear(5, 7) over every rank at ZeRO-3 (uneven rows, each
    rank some) and at ZeRO-0 (`Replicate()` DTensors) against torch's on the unsplit Linear,
    clipping active (norms 2 and inf): the norm errors, and the worst error of the clipped gradients."""
    out = {}
    for zero in (0, 3):
        for norm_type in (2.0, math.inf):
            model, reference = _linear_with_grads(rank, world, 7, zero=zero)
            torch_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type)
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.01, norm_type)
            out[f"torch_norm_error_{norm_type}_zero{zero}"] = (
                abs(torch_norm.full_tensor().item() - expected.item()) / expected.item())
            out[f"torch_grad_error_{norm_type}_zero{zero}"] = max(
                relative_error(p.grad.full_tensor(), r.grad) for p, r in zip(model.parameters(), reference.parameters()))
            torch._dynamo.reset()
    return out


def uneven_rows_and_nonfinite(rank: int, world: int) -> dict:
    """A Linear(5, 3) under ZeRO-2 over every rank (3 rows over 4 ranks: rank 3 holds none of the
    weight's rows). The gradients' shapes; the norm against torch's on the unsplit Linear, for
    norms 2 and inf (and `torch_clipping`); then, with a nan in rank 1's rows, what each rank's
    call raised, and the inf norm returned without raising."""
    model, reference = _linear_with_grads(rank, world, 3, zero=2)
    held = [h for h in held_parameters(model) if h.parameter.grad is not None]
    out = {"grad_shapes": [tuple(h.parameter.grad.shape) for h in held],
           "local_rows": [local(h.parameter.grad).shape[0] for h in held]}
    for norm_type in (2.0, math.inf):
        expected = torch.nn.utils.get_total_norm([p.grad for p in reference.parameters()], norm_type)
        norm = clip_grad_norm_(model, math.inf, norm_type, error_if_nonfinite=True)  # max_norm inf: scale 1
        out[f"norm_error_{norm_type}"] = abs(norm.item() - expected.item()) / expected.item()
    out.update(torch_clipping(rank, world))
    if rank == 1:
        local(held[0].parameter.grad).view(-1)[0] = math.nan
    for norm_type in (2.0, math.inf):
        try:
            clip_grad_norm_(model, 1.0, norm_type, error_if_nonfinite=True)
            out[f"raised_{norm_type}"] = None
        except RuntimeError as e:
            out[f"raised_{norm_type}"] = str(e)
    out["returned_inf"] = clip_grad_norm_(model, 1.0, math.inf).item()
    return out
