"""Per-rank training runs that save and resume checkpoints (run inside `run_ranks`; tests/test_checkpoint.py).

Every run trains the SMALL GPT with tied embeddings on the same global batches
(`global_batch(step, 4, cfg)`), each rank on its data-parallel share. Results
travel back as numpy arrays and floats: a worker's tensors would travel as
shared memory that dies with it.
"""
from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import piper_fx
from examples.gpt import GPT, GPTConfig
from piper_fx.checkpoint import load_checkpoint, save_checkpoint
from training import SMALL, global_batch, local as local_piece, local_bytes, make_optimizer, optimizer_state_bytes

GLOBAL_BATCH = 4
SAVE_AFTER, STEPS = 3, 6
ZERO3 = {"zero": 3, "codegen": "eager"}
PP2_1F1B = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"schedule": "1f1b", "microbatches": 2}}
OPTIMIZERS = ("sgd", "adamw_eps")
DROPOUT = "dropout"  # a GPT with dropout, SGD, saved and resumed at ZeRO-3
TORCH_API = "torch_api"  # AdamW saved and resumed with torch.distributed.checkpoint.state_dict's functions
PP_TORCH_API = "pp_torch_api"  # the same under a pipeline, where a rank holds its stages' parameters only


def config() -> GPTConfig:
    return GPTConfig(**SMALL, tied_embeddings=True)


def build(options: dict, seed: int):
    """A fresh GPT initialized from `seed`, prepared for `options`."""
    torch.manual_seed(seed)
    model = GPT(config())
    if options.get("mesh", {}).get("pp", 1) > 1:
        model.block_context = lambda: piper_fx.annotate("PP")
    return piper_fx.prepare(model, options)


def compiled(model, options: dict):
    return torch.compile(model, backend="piper", options=options)


def train(step, opt, options: dict, steps: range, rank: int, world: int) -> tuple[list[float], list[float]]:
    """Train the compiled `step` on global batches `steps`: (this rank's losses, the global batch's losses)."""
    dp = options.get("mesh", {}).get("dp", world // options.get("mesh", {}).get("pp", 1))
    local, mean = [], []
    for i in steps:
        x, y = global_batch(i, GLOBAL_BATCH, config())
        loss = step(x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp])
        loss.backward()
        opt.step()
        opt.zero_grad()
        local.append(loss.item())
        total = loss.detach().clone()
        dist.all_reduce(total)
        mean.append(total.item() / world)  # every rank's loss is its dp replica's: the mean is the global one
    return local, mean


def full_numpy(model) -> dict[str, np.ndarray]:
    return {name: t.numpy().copy() for name, t in piper_fx.full_state_dict(model).items()}


def _snapshot(model, opt) -> list[torch.Tensor]:
    tensors = [p.detach().clone() for p in model.parameters()]
    tensors += [t.clone() for state in opt.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    return tensors + [torch.get_rng_state()]


def train_and_save_worker(rank: int, world: int, root: str) -> dict:
    """ZeRO-3 over dp = world, for each optimizer: STEPS steps uninterrupted from the same
    initial values, with a checkpoint saved after step SAVE_AFTER to root/<optimizer>. Every
    step's losses, the final full state, rank 0's RNG state at saving, and whether saving left
    everything as it was. (One model and one compiled step: each run starts by putting the
    initial values back into the parameters, as a fresh model from the same seed would have.)"""
    model = build(ZERO3, seed=0)
    initial = [p.detach().clone() for p in model.parameters()]
    step = compiled(model, ZERO3)
    results = {}
    for name in OPTIMIZERS:
        with torch.no_grad():
            for p, value in zip(model.parameters(), initial):
                p.copy_(value)
        opt = make_optimizer(name, model.parameters())
        first_local, first_mean = train(step, opt, ZERO3, range(SAVE_AFTER), rank, world)
        before = _snapshot(model, opt)
        save_checkpoint(os.path.join(root, name), model, opt, step=SAVE_AFTER)
        if name == "adamw_eps":  # and with PyTorch's own API, which sees the DTensor parameters
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, TORCH_API))
        unchanged = all(torch.equal(a, b) for a, b in zip(before, _snapshot(model, opt)))
        rng_at_save = torch.get_rng_state().numpy().copy()
        last_local, last_mean = train(step, opt, ZERO3, range(SAVE_AFTER, STEPS), rank, world)
        results[name] = {"local_losses": first_local + last_local, "losses": first_mean + last_mean,
                         "final": full_numpy(model), "rng_at_save": rng_at_save, "save_changed_nothing": unchanged}
    torch._dynamo.reset()

    # A model with dropout: its masks come from the compiled step's stream, which the checkpoint keeps.
    model = build_dropout(seed=0)
    opt = make_optimizer("sgd", model.parameters())
    step = compiled(model, ZERO3)
    first, _ = train(step, opt, ZERO3, range(SAVE_AFTER), rank, world)
    save_checkpoint(os.path.join(root, DROPOUT), model, opt, step=SAVE_AFTER)
    last, _ = train(step, opt, ZERO3, range(SAVE_AFTER, STEPS), rank, world)
    results[DROPOUT] = {"local_losses": first + last, "final": full_numpy(model)}
    torch._dynamo.reset()
    return results


def build_dropout(seed: int):
    from models import DropoutGPT

    torch.manual_seed(seed)
    return piper_fx.prepare(DropoutGPT(0.1), ZERO3)


def resume_worker(rank: int, world: int, root: str) -> dict:
    """At ZeRO-3 over dp = world, each optimizer resumed from its checkpoint: SGD into a fresh
    model (each rank's own init, unlike the saved run's) loaded before compiling, then AdamW with a
    fresh optimizer into that same model, compiled and trained by then (loading after compiling).
    Then AdamW resumed at pp = world 1F1B into a fresh model and saved again to root/pp after
    training: its final full state and the parameters this rank holds stale copies of."""
    results = {}
    model, step = build(ZERO3, seed=100 + rank), None
    for name in OPTIMIZERS:
        opt = make_optimizer(name, model.parameters())
        torch.manual_seed(1000 + rank)  # an RNG state of this rank's own, unlike any saved one
        rng_before = torch.get_rng_state().numpy().copy()
        resumed_at = load_checkpoint(os.path.join(root, name), model, opt)
        state_bytes = optimizer_state_bytes(opt)
        rng = torch.get_rng_state().numpy().copy()
        step = compiled(model, ZERO3) if step is None else step
        local, mean = train(step, opt, ZERO3, range(resumed_at, STEPS), rank, world)
        results[name] = {
            "step": resumed_at, "local_losses": local, "losses": mean, "final": full_numpy(model),
            "rng_before_load": rng_before, "rng_after_load": rng, "optimizer_state_bytes": state_bytes,
            "local_param_bytes": local_bytes(model.parameters()),
            "full_param_bytes": sum(p.numel() * p.element_size() for p in GPT(config()).parameters()),
        }
    torch._dynamo.reset()

    # The dropout model, loaded before compiling (the stream waits for its step), then again into
    # the compiled and trained model (the stream is rewound in place).
    model = build_dropout(seed=400 + rank)
    opt = make_optimizer("sgd", model.parameters())
    load_checkpoint(os.path.join(root, DROPOUT), model, opt)
    step = compiled(model, ZERO3)
    before_compile, _ = train(step, opt, ZERO3, range(SAVE_AFTER, STEPS), rank, world)
    load_checkpoint(os.path.join(root, DROPOUT), model, opt)
    after_compile, _ = train(step, opt, ZERO3, range(SAVE_AFTER, STEPS), rank, world)
    results[DROPOUT] = {"loaded_before_compiling": before_compile, "loaded_after_compiling": after_compile,
                        "final": full_numpy(model)}
    torch._dynamo.reset()

    # PyTorch's own get_state_dict / dcp.load / set_state_dict into a fresh model and optimizer.
    model = build(ZERO3, seed=300 + rank)
    opt = make_optimizer("adamw_eps", model.parameters())
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, TORCH_API))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    local, mean = train(compiled(model, ZERO3), opt, ZERO3, range(SAVE_AFTER, STEPS), rank, world)
    results[TORCH_API] = {"local_losses": local, "losses": mean, "final": full_numpy(model)}
    torch._dynamo.reset()

    # At pp = world 1F1B, saving after its first step with PyTorch's own API too (root/pp_torch).
    model = build(PP2_1F1B, seed=200 + rank)
    opt = make_optimizer("adamw_eps", model.parameters())
    resumed_at = load_checkpoint(os.path.join(root, "adamw_eps"), model, opt)
    step = compiled(model, PP2_1F1B)
    local, _ = train(step, opt, PP2_1F1B, range(resumed_at, resumed_at + 1), rank, world)
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, PP_TORCH_API))
    local += train(step, opt, PP2_1F1B, range(resumed_at + 1, STEPS), rank, world)[0]
    save_checkpoint(os.path.join(root, "pp"), model, opt, step=STEPS)
    final = full_numpy(model)
    stale = sorted(name for name, p in model.named_parameters() if not np.array_equal(local_piece(p.detach()).numpy(), final[name]))
    results["pp"] = {"step": resumed_at, "losses": local, "final": final, "stale": stale}
    torch._dynamo.reset()
    return results


def resume_pp_torch_api_worker(rank: int, world: int, root: str) -> dict:
    """At pp = world 1F1B, AdamW resumed from root/pp_torch with PyTorch's own `get_state_dict` /
    `dcp.load` / `set_state_dict` into a fresh model and optimizer before compiling, trained to
    STEPS: this rank's losses, the final full state, the names in this rank's `state_dict()`
    once compiled, the parameters the optimizer keeps state for, and the names in
    `get_state_dict` then. Then the same checkpoint loaded again the same way into the compiled
    and trained model, and trained to STEPS again: the losses and final state."""
    model = build(PP2_1F1B, seed=500 + rank)
    opt = make_optimizer("adamw_eps", model.parameters())
    model_sd, optim_sd = get_state_dict(model, opt)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, PP_TORCH_API))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    step = compiled(model, PP2_1F1B)
    local, _ = train(step, opt, PP2_1F1B, range(SAVE_AFTER + 1, STEPS), rank, world)
    names = {id(p): name for name, p in model.named_parameters()}
    model_sd, optim_sd = get_state_dict(model, opt)
    result = {"losses": local, "final": full_numpy(model), "state_dict_keys": sorted(model.state_dict()),
              "optimizer_state_of": sorted(names[id(p)] for p, state in opt.state.items() if state),
              "torch_model_keys": sorted(model_sd),
              "torch_optim_keys": sorted(fqn for fqn, state in optim_sd["state"].items() if state)}
    # Loaded again into the compiled and trained model, which holds its stages' parameters only.
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(root, PP_TORCH_API))
    set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    result["losses_loaded_after_compiling"], _ = train(step, opt, PP2_1F1B, range(SAVE_AFTER + 1, STEPS), rank,
                                                       world)
    result["final_loaded_after_compiling"] = full_numpy(model)
    torch._dynamo.reset()
    return result


def resume_zero1_worker(rank: int, world: int, root: str) -> dict:
    """AdamW resumed at ZeRO-1 over dp = world: the global losses and the final full state."""
    options = {"zero": 1, "codegen": "eager"}
    model = build(options, seed=300 + rank)
    opt = make_optimizer("adamw_eps", model.parameters())
    resumed_at = load_checkpoint(os.path.join(root, "adamw_eps"), model, opt)
    _, mean = train(compiled(model, options), opt, options, range(resumed_at, STEPS), rank, world)
    return {"step": resumed_at, "losses": mean, "final": full_numpy(model)}


BATCH_NORM_PIPELINE = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"schedule": "1f1b", "microbatches": 2}}


def batch_norm_pipeline_worker(rank: int, world: int, root: str) -> dict:
    """`models.ConvNet` (a batch norm, whose running statistics its forward updates) under a
    2-stage 1F1B, SGD with momentum: trained 2 steps and saved with PyTorch's `get_state_dict`
    and `dcp.save`, then trained 2 more; and a model of other initial values loaded from that
    checkpoint before compiling (`dcp.load`, `set_state_dict`) and trained the same 2 steps.
    This rank's losses and final full state of both, and the keys of its `state_dict()`."""
    from models import ConvNet, conv_batch

    def run(seed: int, load: bool) -> tuple:
        torch.manual_seed(seed)
        model = piper_fx.prepare(ConvNet(), BATCH_NORM_PIPELINE)
        opt = make_optimizer("sgd", model.parameters())
        if load:
            model_sd, optim_sd = get_state_dict(model, opt)
            dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
            set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        step = compiled(model, BATCH_NORM_PIPELINE)
        losses = []
        for i in range(2 if load else 0, 4):
            loss = step(*conv_batch(i, 8))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if i == 1 and not load:
                model_sd, optim_sd = get_state_dict(model, opt)
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=root)
        return model, losses

    trained, losses = run(0, load=False)
    result = {"losses": losses[2:], "final": full_numpy(trained), "state_dict_keys": sorted(trained.state_dict())}
    resumed, result["losses_resumed"] = run(1, load=True)
    result["final_resumed"] = full_numpy(resumed)
    torch._dynamo.reset()
    return result
