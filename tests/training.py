"""Per-rank training loops compared against single-process training (run inside `run_ranks`)."""
from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.backends.registry import _lazy_import as _import_dynamo_backends
from torch.distributed.tensor import DTensor, Replicate, Shard

import piper_fx
from examples.gpt import GPT, GPTConfig
from piper_fx.compat import local_tensor
from piper_fx.sharding.dtensor_params import stood_for
from piper_fx.sharding.holdings import is_stored

# Every Dynamo backend's module imported once, here, in the server every test process is forked
# from (`ranks.PRELOADED`): a process then never lists and imports them itself, as Dynamo does at
# its first compile (`registry._lazy_import`, cached per process). Once, in CI, a forked rank's
# import found no module for a file that listing had named (`torch._dynamo.backends.distributed`).
_import_dynamo_backends()

# Odd sizes on purpose: vocab 37 and block 9 rows do not divide by 2 or 4 ranks.
SMALL = dict(vocab_size=37, block_size=9, n_layer=2, n_head=2, n_embd=16)


def make_optimizer(name: str, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    if name == "adamw_eps":
        # For runs that sum a gradient in another order than the reference (microbatches, pipelines):
        # the GPT's attention key bias has an exactly-zero gradient in exact arithmetic (softmax is
        # shift-invariant), so in fp32 it is rounding noise, which Adam's normalisation turns into a
        # full step of random sign: any other summation order moves that bias by O(lr) (a 3e-4
        # relative error after 3 steps under 1F1B). eps = 1e-4 keeps noise (< 1e-8) from being
        # amplified, while the real gradients (>= 1e-3 here) still take normalised steps.
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)
    if name == "adamw_fused":  # torchtitan's: one fused kernel call for every parameter
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True)
    raise ValueError(name)


def global_batch(step: int, batch: int, cfg: GPTConfig):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    y = torch.randint(0, cfg.vocab_size, (batch, cfg.block_size), generator=g)
    return x, y


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = expected.abs().max().clamp_min(1e-12)
    return ((actual - expected).abs().max() / scale).item()


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local piece, a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(tensors) -> int:
    return sum(local(t).numel() * t.element_size() for t in tensors)


def placement(t: torch.Tensor) -> str:
    """How `t` is placed: "plain", or a DTensor's mesh dimensions and placements."""
    if not isinstance(t, DTensor):
        return "plain"
    return f"{','.join(t.device_mesh.mesh_dim_names or ())}:{','.join(map(repr, t.placements))}"


def optimizer_state_bytes(opt) -> int:
    return local_bytes(t for state in opt.state.values() for t in state.values()
                       if isinstance(t, torch.Tensor) and t.dim() > 0)


def materialize_as(model: nn.Module, source: nn.Module) -> None:
    """Give `model`, built on the meta device and prepared there, memory (`to_empty`, on
    `source`'s device) and `source`'s values as FSDP2's users give them: its state dict loaded
    with `set_model_state_dict` (full), its buffers (those outside the state dict too) set by
    hand, as a model's own initialisation recomputes them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model.to_empty(device=next(source.parameters()).device)
    set_model_state_dict(model, source.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        for name, buffer in source.named_buffers():
            model.get_buffer(name).copy_(buffer)


def train_and_compare(rank: int, world: int, options: dict, optimizer: str, steps: int = 5,
                      tied: bool = True, per_rank_batch: int = 2, same_init: bool = True,
                      call_prepare: bool = True, pp_regions: bool = False, n_layer: int = 2,
                      model: str = "gpt", experts: int = 0, ep_regions: bool = True,
                      capacity_factor: float | None = None, model_kwargs: dict | None = None,
                      keywords: bool = False, on_meta: bool = False,
                      per_rank_batches: list[int | list[int]] | None = None, frozen: bool = False,
                      unsynced_steps: tuple[int, ...] = (), window_part: bool = False,
                      deep_copy: bool = False) -> dict:
    """Train with piper_fx on this rank's shard and, alongside, one model on the global batch.

    With `same_init=False` each rank initializes its own model from its own seed;
    the reference starts from rank 0's, which every replica must adopt. With `keywords`
    the compiled model is called with its batch as keyword arguments (`model(x=..., y=...)`).
    With `on_meta` the model is built on the meta device and prepared there, then given
    memory and values (`materialize_as`). With `per_rank_batches`, step i's batch has that
    many rows a replica (the steps are as many), or as many as the list names for each
    replica: then, as DDP and FSDP2 train on uneven batches, against one process stepping on
    the mean of the replicas' losses (each the mean over its own rows). With `frozen`, the
    first parameter and the one halfway down `named_parameters()` have `requires_grad=False`
    from before `prepare` on both sides, as fine-tuning freezes some: neither side trains them.
    The steps in `unsynced_steps` accumulate gradients into the next: piper_fx's call runs in
    `piper_fx.no_sync`, and neither side steps its optimizer after it; with `window_part`, the
    window holds a part of the model alone (its middle child with parameters), whose other
    parameters are reduced at every call. With `deep_copy`, the model is copied
    (`copy.deepcopy`, as an EMA copy is made) after every step's backward, while its parameters
    hold the step's gradients: `copy_mismatches` names the parameters whose copy differs
    (`_copy_mismatches`).
    """
    from models import MODELS, batch

    gpt_sizes = {} if model in MODELS else (model_kwargs or {})  # the GPT's: sizes other than SMALL's
    cfg = GPTConfig(**{**SMALL, "n_layer": n_layer, **gpt_sizes}, tied_embeddings=tied, n_expert=experts,
                    capacity_factor=capacity_factor)
    model_fn = (lambda: MODELS[model](**(model_kwargs or {}))) if model in MODELS else (lambda: GPT(cfg))
    batch_fn = batch if model in MODELS else (lambda i, rows: global_batch(i, rows, cfg))
    torch.manual_seed(0)
    reference = model_fn()
    torch.manual_seed(0 if same_init else rank)
    if on_meta:
        source = model_fn()
        with torch.device("meta"):
            model = model_fn()
    else:
        model = model_fn()
    if frozen:
        for side in (model, reference):
            names = [name for name, _ in side.named_parameters()]
            for name in {names[0], names[len(names) // 2]}:
                side.get_parameter(name).requires_grad_(False)
    mark_regions(model, pipeline=pp_regions, experts=bool(experts), expert_regions=ep_regions)
    if call_prepare:
        piper_fx.prepare(model, options)
    if on_meta:
        materialize_as(model, source)
    opt = make_optimizer(optimizer, model.parameters())
    ref_opt = make_optimizer(optimizer, reference.parameters())
    # Tokens each expert of the reference receives per step: routing is uneven, and parity must hold anyway.
    expert_loads: list[list[int]] = []
    for module in (reference.experts() if experts else []):
        module.register_forward_hook(lambda m, inputs, output: expert_loads.append(
            (inputs[0].abs().sum(-1) > 0).sum(-1).tolist()))
    step = torch.compile(model, backend="piper", options=options)
    parts = [child for child in model.children() if any(True for _ in child.parameters())]
    windowed = parts[len(parts) // 2] if window_part else step

    loss_errors, copy_mismatches = [], set()
    for i in range(len(per_rank_batches) if per_rank_batches else steps):
        mesh = options.get("mesh", {})
        dp = mesh.get("dp", world // mesh.get("pp", 1))
        rows = per_rank_batches[i] if per_rank_batches else per_rank_batch
        replica_rows = rows if isinstance(rows, list) else [rows] * dp
        x, y = batch_fn(i, sum(replica_rows))
        parts = list(zip(x.split(replica_rows), y.split(replica_rows)))
        lx, ly = parts[rank % dp]
        unsynced = i in unsynced_steps
        with piper_fx.no_sync(windowed) if unsynced else contextlib.nullcontext():
            named = dict(zip(inspect.signature(model.forward).parameters, (lx, ly)))
            loss = step(**named) if keywords else step(lx, ly)
            loss.backward()
        if deep_copy:
            copy_mismatches |= _copy_mismatches(model, copy.deepcopy(model))
        ref_loss = reference(x, y) if len(set(replica_rows)) == 1 else sum(reference(*part) for part in parts) / dp
        ref_loss.backward()
        if not unsynced:
            for stepped in (opt, ref_opt):
                stepped.step()
                stepped.zero_grad()

        mean_loss = loss.detach().clone()
        if world > 1:
            dist.all_reduce(mean_loss)
            mean_loss /= world
        loss_errors.append(abs(mean_loss.item() - ref_loss.item()) / abs(ref_loss.item()))

    full = piper_fx.full_state_dict(model)
    expected = reference.state_dict()
    assert full.keys() == expected.keys(), (sorted(full), sorted(expected))
    param_errors = {name: relative_error(full[name], expected[name]) for name in expected}
    return {
        "loss_errors": loss_errors,
        "copy_mismatches": sorted(copy_mismatches),
        "expert_loads": expert_loads,
        "param_errors": param_errors,
        "optimizer_state_bytes": optimizer_state_bytes(opt),
        # A released parameter (another rank's stage) has an empty state: it is never stepped.
        "params_with_state": sorted(name for name, p in model.named_parameters() if opt.state.get(p)),
        # Parameters this rank trained, as it holds them (several pipeline ranks may hold one);
        # numpy, since a worker's tensors would travel as shared memory that dies with it.
        "trained_values": {name: local(p.detach()).numpy().copy() for name, p in model.named_parameters()
                           if opt.state.get(p)},
        "all_params": sorted(name for name, _ in model.named_parameters()),
        "frozen": sorted(name for name, p in model.named_parameters() if not p.requires_grad),
        "placements": {name: placement(p) for name, p in model.named_parameters()},
        # Each optimizer state of a parameter's shape, placed like the parameter (FSDP2's convention).
        "state_placements": {f"{name}.{key}": placement(value) for name, p in model.named_parameters()
                             for key, value in opt.state.get(p, {}).items()
                             if isinstance(value, torch.Tensor) and value.dim() > 0},
        "reference_state_bytes": optimizer_state_bytes(ref_opt),
        "local_param_bytes": local_bytes(model.parameters()),
        # Bytes of parameter storage this rank keeps (a pipeline rank: its stages' parameters only);
        # a released one reads as zeros, from pages it does not hold.
        "stored_param_bytes": sum(local(p).untyped_storage().nbytes() for p in model.parameters() if is_stored(p)),
        "released_read_as_zeros": all(not local(p.detach()).any() for p in model.parameters() if not is_stored(p)),
        "stored_read_as_values": all(local(p.detach()).any() for p in model.parameters()
                                     if is_stored(p) and p.dim() > 1),
        "full_param_bytes": sum(p.numel() * p.element_size() for p in reference.parameters()),
    }


def _copy_mismatches(model: torch.nn.Module, copied: torch.nn.Module) -> set[str]:
    """The parameters of `model` whose counterpart in its deep copy `copied` is not a copy: of
    another type or placement, other values, sharing memory with the original's, or a gradient
    other than PyTorch's deep copy gives: a copy of a DTensor parameter's (`Tensor.__deepcopy__`
    copies it), none for a plain `nn.Parameter` (`Parameter.__deepcopy__` copies its data alone)."""
    def differ(original, other) -> bool:
        if original is None or other is None:
            return original is not other
        return (type(original) is not type(other) or placement(original) != placement(other)
                or not torch.equal(local(original.detach()), local(other.detach()))
                or (local(original).numel() > 0
                    and local(original).untyped_storage().data_ptr() == local(other).untyped_storage().data_ptr()))

    copies = dict(copied.named_parameters())
    return {name for name, parameter in model.named_parameters()
            if name not in copies or differ(parameter, copies[name])
            or differ(parameter.grad if isinstance(parameter, DTensor) else None, copies[name].grad)}


def parity_worker(rank: int, world: int, options: dict, tied: bool) -> dict:
    return {name: train_and_compare(rank, world, options, name, tied=tied) for name in ("sgd", "adamw")}


def gradient_delivery_worker(rank: int, world: int, zero: int) -> dict:
    """Gradients of DTensor parameters as autograd would give them, against one model on the
    global batch: scaled and accumulated over two calls into `.grad` (the step adds them
    itself), added into zeroed gradients, and returned by `torch.autograd.grad` without
    touching `.grad`. The worst relative error of each, over parameters (full tensors)."""
    cfg = GPTConfig(**SMALL, tied_embeddings=True)
    torch.manual_seed(0)
    reference = GPT(cfg)
    torch.manual_seed(0)
    model = piper_fx.prepare(GPT(cfg), {"zero": zero, "codegen": "eager"})
    step = torch.compile(model, backend="piper", options={"zero": zero, "codegen": "eager"})
    params, ref_params = list(model.parameters()), list(reference.parameters())
    batches = [global_batch(i, 2 * world, cfg) for i in range(2)]
    shards = [(x.chunk(world)[rank], y.chunk(world)[rank]) for x, y in batches]

    def worst(grads, ref_grads) -> float:
        return max(relative_error(g.full_tensor() if isinstance(g, DTensor) else g, r)
                   for g, r in zip(grads, ref_grads, strict=True))

    errors = {}
    (3.0 * step(*shards[0])).backward()
    step(*shards[1]).backward()
    (3.0 * reference(*batches[0])).backward()
    reference(*batches[1]).backward()
    errors["scaled and accumulated"] = worst([p.grad for p in params], [q.grad for q in ref_params])
    placements = {str(p.grad.placements) == str(p.placements) for p in params}

    for p in (*params, *ref_params):
        p.grad.zero_()
    step(*shards[0]).backward()
    reference(*batches[0]).backward()
    errors["into zeroed gradients"] = worst([p.grad for p in params], [q.grad for q in ref_params])

    before = [local(p.grad).clone() for p in params]
    grads = torch.autograd.grad(step(*shards[1]), params)
    ref_grads = torch.autograd.grad(reference(*batches[1]), ref_params)
    errors["autograd.grad"] = worst(grads, ref_grads)
    untouched = all(torch.equal(local(p.grad), b) for p, b in zip(params, before))
    return {"errors": errors, "same placements": placements == {True}, "untouched": untouched,
            "dtensor grads": all(isinstance(g, DTensor) for g in grads)}


def zero3_memory_worker(rank: int, world: int, zero: int, overlap: bool = False, n_layer: int = 2,
                        model: str = "gpt", prefetch: int = 1, steps: int = 3) -> dict:
    """Peak bytes of gathered (full) parameters alive at once in each of `steps` training steps,
    with what bounds them: the largest unit (a child of the model's layer list) and the
    parameters outside units, counted as they are gathered (rows padded to a multiple of world)."""
    from piper_fx.ops import collective_op_kind
    from piper_fx.runtime.executor import around_tasks

    torch.manual_seed(0)
    module, layers, forward, batch_fn = memory_model(model, n_layer)
    padded = lambda p: -(-p.shape[0] // world) * world * p[0].numel() * p.element_size()  # noqa: E731
    in_units = {id(p) for layer in layers for p in layer.parameters()}
    largest_unit = max(sum(padded(p) for p in layer.parameters()) for layer in layers)
    outside_units = sum(padded(p) for p in module.parameters() if id(p) not in in_units)
    all_params = sum(padded(p) for p in module.parameters())
    full_bytes = sum(p.numel() * p.element_size() for p in module.parameters())
    # Default 25 MB buckets: ZeRO-3 buckets are units.
    options = {"zero": zero, "codegen": "eager", "overlap": overlap, "prefetch": prefetch}
    piper_fx.prepare(module, options)
    step = torch.compile(forward, backend="piper", options=options)
    x, y = batch_fn(0, 2 * world)
    step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()  # compile outside the measurement
    peaks = []
    for _ in range(steps):
        gathers = program_held_bytes(lambda op: collective_op_kind(op) == "all_gather")
        with around_tasks(gathers):
            step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        peaks.append(gathers.peak)
    return {"peaks": peaks, "peak_gathered": min(peaks), "worst_peak_gathered": max(peaks),
            "largest_unit": largest_unit, "outside_units": outside_units, "all_params_padded": all_params,
            "shard_bytes": sum(p.numel() * p.element_size() for p in module.parameters()), "full_bytes": full_bytes}


def inductor_worker(rank: int, world: int, debug_root: str) -> dict:
    """Every ZeRO level with Inductor code generation, against single-process training."""
    results = {}
    for zero in (0, 1, 2, 3):
        options = {"zero": zero, "codegen": "inductor", "debug_dir": f"{debug_root}/zero{zero}"}
        results[zero] = train_and_compare(rank, world, options, "sgd", steps=3)
    return results


def regions_worker(rank: int, world: int, debug_root: str) -> dict:
    """ZeRO-3 on a 6-layer GPT with Inductor, whose tasks compile as regions, against
    single-process training; with how this rank obtained each region's code."""
    options = {"zero": 3, "codegen": "inductor", "debug_dir": debug_root}
    run = train_and_compare(rank, world, options, "sgd", steps=3, n_layer=6)
    return {**run, "tasks": piper_fx.last_compile_stats()["tasks"]}


def unsynchronized_init_worker(rank: int, world: int, zero: int, call_prepare: bool) -> dict:
    options = {"zero": zero, "codegen": "eager"}
    return train_and_compare(rank, world, options, "sgd", steps=2, same_init=False, call_prepare=call_prepare)


def first_op_reads_a_parameter_worker(rank: int, world: int, zero: int) -> float:
    """A graph whose very first op is a parameter read (no op precedes the all-gather)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    reference = copy.deepcopy(model)
    options = {"zero": zero, "codegen": "eager"}
    piper_fx.prepare(model, options)
    step = torch.compile(lambda x: model(x).square().mean(), backend="piper", options=options)
    x = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(0))
    step(x.chunk(world)[rank]).backward()
    reference(x).square().mean().backward()
    return relative_error(dict(model.named_parameters())["weight"].grad.full_tensor(), reference.weight.grad)


def pipeline_worker(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """Several pipeline trainings in one process group, each against single-process training."""
    results = []
    for config in configs:
        config = dict(config)
        options = {"codegen": "eager", **config.pop("options")}
        config = {"steps": 3, "tied": False, **config}
        results.append(train_and_compare(rank, world, options, "sgd", **config))
        torch._dynamo.reset()  # each config compiles its own model (as the rank pool does between runs)
    return results


def recurrent_worker(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """`pipeline_worker` with Dynamo tracing recurrent layers (`nn.GRU`, `nn.LSTM`), which it
    does only with `torch._dynamo.config.allow_rnn`."""
    with torch._dynamo.config.patch(allow_rnn=True):
        return pipeline_worker(rank, world, configs)


def second_model_worker(rank: int, world: int, options: dict) -> list[dict]:
    """`train_and_compare` of two GPTs of the same class, one after the other in one process
    (no `torch._dynamo.reset()` between: Dynamo runs the frame it compiled for the first)."""
    results = [train_and_compare(rank, world, options, "sgd", steps=2, tied=False) for _ in range(2)]
    torch._dynamo.reset()
    return results


def fixed_batch_pipeline_worker(rank: int, world: int) -> str:
    """The error of compiling, under a pipeline over `world` ranks, a function that calls the
    prepared GPT's `forward` itself, past the hook by which `prepare` marks the batch size
    dynamic: Dynamo sees a fixed batch size, which the GPT's views read."""
    options = {"codegen": "eager", "mesh": {"pp": world}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    cfg = GPTConfig(**SMALL, tied_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.block_context = lambda: piper_fx.annotate("PP")
    piper_fx.prepare(model, options)
    step = torch.compile(lambda x, y: model.forward(x, y), backend="piper", options=options)
    try:
        step(*global_batch(0, 4, cfg))
    except piper_fx.PiperError as e:
        return str(e)
    return ""


def message_batches_worker(rank: int, world: int, schedules: list[str]) -> dict:
    """One training step per schedule over pp = world (4 layers, a stage each, 4 microbatches),
    recording every `dist.batch_isend_irecv` call the runtime makes: per schedule, the calls
    (each a list of ("send" | "recv", peer)), the program's sends and receives in order, and
    the step's `p2p_batches`."""
    from piper_fx.ir import Recv, Send

    calls: list[list[tuple[str, int]]] = []
    batch_isend_irecv = dist.batch_isend_irecv

    def recording(ops):
        calls.append([("send" if op.op is dist.isend else "recv", op.peer) for op in ops])
        return batch_isend_irecv(ops)

    dist.batch_isend_irecv = recording
    results = {}
    try:
        for schedule in schedules:
            options = {"mesh": {"pp": world}, "codegen": "eager",
                       "pipeline": {"schedule": schedule, "microbatches": 4}}
            cfg = GPTConfig(**{**SMALL, "n_layer": 4}, tied_embeddings=False)
            torch.manual_seed(0)
            model = GPT(cfg)
            model.block_context = lambda: piper_fx.annotate("PP")
            piper_fx.prepare(model, options)
            compiled = []

            def backend(gm, example_inputs):
                compiled.append(piper_fx.piper_backend(gm, example_inputs, options))
                return compiled[-1]

            calls.clear()
            torch.compile(model, backend=backend)(*global_batch(0, 8, cfg)).backward()
            instructions = compiled[0].step.executor.program.instructions
            results[schedule] = {
                "calls": list(calls),
                "messages": [("send" if isinstance(i, Send) else "recv", i.peer) for i in instructions
                             if isinstance(i, (Send, Recv))],
                "p2p_batches": piper_fx.last_step_stats()["p2p_batches"]}
            torch._dynamo.reset()
    finally:
        dist.batch_isend_irecv = batch_isend_irecv
    return results


def activation_memory_worker(rank: int, world: int, microbatches: int) -> dict:
    """Peak bytes of per-microbatch values held by the runtime, per schedule."""
    peaks = {}
    for schedule in ("gpipe", "1f1b"):
        options = {"mesh": {"pp": world}, "codegen": "eager",
                   "pipeline": {"schedule": schedule, "microbatches": microbatches}}
        cfg = GPTConfig(**{**SMALL, "n_layer": world}, tied_embeddings=False)
        torch.manual_seed(0)
        model = GPT(cfg)
        model.block_context = lambda: piper_fx.annotate("PP")
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
        x, y = global_batch(0, 2 * microbatches, cfg)
        step(x, y).backward()
        peaks[schedule] = piper_fx.last_step_stats()["peak_activation_bytes"]
    return peaks


def pipeline_errors_worker(rank: int, world: int) -> dict:
    """Each bad pipeline setup, with the error it raises on this rank."""
    from piper_fx import PiperConfigError, PiperError

    def error_of(fn):
        try:
            fn()
        except (PiperConfigError, PiperError) as e:
            return f"{type(e).__name__}: {e}"
        return None

    def train_once(n_layer=2, tied=False, batch=4, microbatches=2, regions=True):
        cfg = GPTConfig(**{**SMALL, "n_layer": n_layer}, tied_embeddings=tied)
        model = GPT(cfg)
        if regions:
            model.block_context = lambda: piper_fx.annotate("PP")
        options = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"microbatches": microbatches}}
        piper_fx.prepare(model, options)
        x, y = global_batch(0, batch, cfg)
        torch.compile(model, backend="piper", options=options)(x, y).backward()

    return {
        "few_microbatches": error_of(lambda: piper_fx.parse_options(
            {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 1}})),
        "regions": error_of(lambda: train_once(n_layer=3)),
        "batch": error_of(lambda: train_once(batch=3)),
    }


def batch_shape_change_worker(rank: int, world: int) -> str:
    """A pipelined step called with a batch of another size than it was compiled for, which
    does not split into its microbatches."""
    cfg = GPTConfig(**SMALL, tied_embeddings=False)
    model = GPT(cfg)
    options = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"microbatches": 2}}
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    step(*global_batch(0, 4, cfg)).backward()
    try:
        step(*global_batch(1, 5, cfg))
    except piper_fx.PiperError as e:
        return str(e)
    return "no error"


def mark_regions(model: GPT, pipeline: bool = False, experts: bool = False, expert_regions: bool = True) -> GPT:
    """Mark the example GPT's regions as a strategy needs them: where `pipeline`, each block a PP
    region; where `experts`, its experts marked for expert parallelism and (unless
    `expert_regions` is False) their forward an EP region. Returns the model."""
    if pipeline:
        model.block_context = lambda: piper_fx.annotate("PP")
    if experts:
        for module in model.experts():
            piper_fx.mark_experts(module)
        if expert_regions:
            model.expert_context = lambda: piper_fx.annotate("EP")
    return model


def mismatched_batches_worker(rank: int, world: int, options: dict, rows: list[int],
                              later_rows: list[int] | None = None) -> str:
    """One step of the small GPT (with 4 experts under ep) called on this rank with a batch of
    `rows[rank]` rows, then, if `later_rows`, one of `later_rows[rank]`: the error raised, or
    "no error"."""
    experts = options.get("mesh", {}).get("ep", 1) > 1
    cfg = GPTConfig(**SMALL, tied_embeddings=False, n_expert=4 if experts else 0)
    torch.manual_seed(0)
    model = GPT(cfg)
    mark_regions(model, pipeline="pipeline" in options, experts=experts)
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    try:
        for each in [rows] + ([later_rows] if later_rows else []):
            step(*global_batch(0, each[rank], cfg)).backward()
    except piper_fx.PiperError as e:
        return str(e)
    return "no error"


def one_step_with_dumps_worker(rank: int, world: int, options: dict) -> None:
    cfg = GPTConfig(**SMALL, tied_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.block_context = lambda: piper_fx.annotate("PP")
    piper_fx.prepare(model, options)
    mesh = options.get("mesh", {})
    dp = mesh.get("dp", world // mesh.get("pp", 1))
    x, y = global_batch(0, 4 * dp, cfg)
    torch.compile(model, backend="piper", options=options)(x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp]).backward()


def plan_all_ranks(options: dict, world: int, n_layer: int, batch_rows: int, experts: int = 0) -> tuple[dict, float]:
    """Every rank's program for `options`, planned in this process on a fake process group of
    `world` ranks from one capture of the example GPT (with PP regions; with `experts`, MoE
    blocks whose experts are EP regions): (programs, seconds)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        return plan_programs(options, n_layer, batch_rows, experts)
    finally:
        dist.destroy_process_group()


def plan_programs(options: dict, n_layer: int, batch_rows: int, experts: int = 0) -> tuple[dict, float]:
    """`plan_all_ranks`'s programs, planned in the process group this process is in: called on
    every rank of it (`prepare` is collective), on a real group as on the fake one."""
    from piper_fx.capture import capture, keep_input_sources
    from piper_fx.passes import run_passes
    from piper_fx.sharding.mesh import dp_group_name

    torch.manual_seed(0)
    model = mark_regions(GPT(GPTConfig(**{**SMALL, "n_layer": n_layer}, tied_embeddings=False, n_expert=experts)),
                         pipeline=True, experts=bool(experts))
    piper_fx.prepare(model, options)
    captured = {}

    def keep_graph(gm, example_inputs):
        keep_input_sources(gm)  # as the backend does: Dynamo deletes them once the frame is compiled
        captured.update(gm=gm, example_inputs=example_inputs)
        return gm.forward

    x, y = global_batch(0, batch_rows, model.cfg)
    torch.compile(model, backend=keep_graph)(x, y)
    start = time.monotonic()
    strategy = piper_fx.parse_options(options)
    dag = capture(captured["gm"], captured["example_inputs"], strategy, dp_group_name(strategy))
    programs = {}
    for dp_index in range(strategy.dp):  # one capture; passes per data-parallel index (ZeRO-1 slices differ)
        planned = run_passes(dag.copy(), strategy.with_rank(dp_index), lambda *_: None)
        programs.update(planned.programs)
    return programs, time.monotonic() - start


def gathers_in_flight(programs: dict) -> int:
    """The most all-gathers of one process group in flight at once (issued, not yet waited
    for) anywhere in the tasks of `programs`."""
    from piper_fx.ops import WAIT, collective_group, collective_kind

    worst = 0
    for program in programs.values():
        for task in program.tasks.values():
            flying: dict[str, set] = {}
            for node in task.graph.graph.nodes:
                if collective_kind(node) == "all_gather":
                    group = flying.setdefault(collective_group(node), set())
                    group.add(node)
                    worst = max(worst, len(group))
                elif node.target is WAIT and collective_kind(node.args[0]) == "all_gather":
                    flying[collective_group(node.args[0])].discard(node.args[0])
    return worst


def gathers_in_flight_worker(rank: int, world: int, options: dict) -> int:
    """`gathers_in_flight` of the programs planned for `options` in the ranks' own (gloo) group."""
    programs, _ = plan_programs(options, n_layer=2, batch_rows=2 * world)
    return gathers_in_flight(programs)


def stats_worker(rank: int, world: int, options: dict, steps: int = 3, inductor_caches: bool = True) -> dict:
    """`last_step_stats()` after each of a few steps, with the model's parameter bytes; with
    `inductor_caches` False, every task compiled by Inductor anew, none loaded from its caches."""
    if not inductor_caches:
        with torch._inductor.config.patch(force_disable_caches=True):
            return stats_worker(rank, world, options, steps)
    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    model = GPT(cfg)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    piper_fx.prepare(model, options)
    shard_bytes = local_bytes(model.parameters())
    step = torch.compile(model, backend="piper", options=options)
    stats = []
    for i in range(steps):
        x, y = global_batch(i, 2 * world, cfg)
        loss = step(x.chunk(world)[rank], y.chunk(world)[rank])
        in_the_call = piper_fx.last_step_stats()["step_call_s"]
        loss.backward()
        stats.append({**piper_fx.last_step_stats(), "step_call_s_before_backward": in_the_call})
    return {"stats": stats, "param_bytes": param_bytes, "shard_bytes": shard_bytes,
            "trace": piper_fx.last_step_trace()}


class DeviceEvents:
    """Stands for a device module's timing events (`torch.cuda.Event`) on the CPU: a
    stamp of host time at `record`, read by `elapsed_time` only once `synchronize`d (a
    device's events complete later than the host records them); counts the reads."""

    synchronized = 0
    made = 0  # events made

    @staticmethod
    def current_stream() -> str:
        return "stream"

    class Event:
        def __init__(self, enable_timing: bool = False):
            assert enable_timing
            self.at, self.done = None, False
            DeviceEvents.made += 1

        def record(self, stream: str) -> None:
            assert stream == "stream"
            self.at, self.done = time.perf_counter_ns(), False

        def synchronize(self) -> None:
            DeviceEvents.synchronized += 1
            self.done = True

        def elapsed_time(self, end: "DeviceEvents.Event") -> float:
            assert end.done, "read before its work completed"
            return (end.at - self.at) / 1e6


def stream_clock_worker(rank: int, world: int, options: dict, steps: int = 4) -> dict:
    """`stats_worker` with each step timed by a stream clock over `DeviceEvents`, as on a
    GPU: the events read during the steps, and after the stats and trace were asked for;
    the events made by the end of each step."""
    from piper_fx.runtime import executor
    from piper_fx.runtime.timing import StreamClock

    clock_for = executor.clock_for
    executor.clock_for = lambda device: StreamClock(DeviceEvents)
    try:
        DeviceEvents.synchronized = DeviceEvents.made = 0
        cfg = GPTConfig(**SMALL)
        torch.manual_seed(0)
        model = GPT(cfg)
        model.block_context = lambda: piper_fx.annotate("PP")
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
        dp = world // options.get("mesh", {}).get("pp", 1)
        made = []
        for i in range(steps):
            x, y = global_batch(i, 2 * world, cfg)
            step(x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp]).backward()
            made.append(DeviceEvents.made)
        read_while_stepping = DeviceEvents.synchronized
        stats, trace = piper_fx.last_step_stats(), piper_fx.last_step_trace()
        return {"read_while_stepping": read_while_stepping, "read": DeviceEvents.synchronized,
                "stats": stats, "trace": trace, "made": made}
    finally:
        executor.clock_for = clock_for


def expert_errors_worker(rank: int, world: int) -> dict:
    """Each bad expert-parallel setup (mesh dp=2, ep=2), with the error it raises on this rank."""
    from piper_fx import PiperConfigError

    def error_of(n_expert: int, mark: bool = True, regions: bool = True):
        cfg = GPTConfig(**SMALL, n_expert=n_expert)
        model = GPT(cfg)
        if mark:
            for module in model.experts():
                piper_fx.mark_experts(module)
        if regions:
            model.expert_context = lambda: piper_fx.annotate("EP")
        options = {"mesh": {"dp": 2, "ep": 2}, "codegen": "eager"}
        try:
            piper_fx.prepare(model, options)
            x, y = global_batch(0, 2, cfg)
            torch.compile(model, backend="piper", options=options)(x, y).backward()
        except PiperConfigError as e:
            return (e.key, str(e))
        return None

    return {"indivisible": error_of(3), "unannotated": error_of(4, regions=False),
            "unmarked": error_of(4, mark=False)}


# A causal LM nested as Hugging Face nests its layers (`model.layers.N`), small enough for CPU ranks.
LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=2,
             max_position_embeddings=16)
LLAMA_SEQ = 8


def tiny_llama(n_layer: int = 2):
    """A Hugging Face `LlamaForCausalLM` as its config builds it (sdpa attention, untied head)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**LLAMA, num_hidden_layers=n_layer))


def llama_batch(step: int, rows: int):
    """Token ids and labels for `tiny_llama`, drawn as the GPT's batches are."""
    return global_batch(step, rows, GPTConfig(vocab_size=LLAMA["vocab_size"], block_size=LLAMA_SEQ))


def memory_model(name: str, n_layer: int):
    """(module, its layers, the callable to compile, batch(step, rows)) of the example GPT
    ("gpt", layers `blocks.N`) or a tiny Hugging Face Llama ("llama", `model.layers.N`),
    whose compiled callable returns the loss of `model(input_ids=x, labels=y)`."""
    if name == "gpt":
        cfg = GPTConfig(**{**SMALL, "n_layer": n_layer})
        model = GPT(cfg)
        return model, list(model.blocks), model, lambda i, rows: global_batch(i, rows, cfg)
    model = tiny_llama(n_layer)
    return model, list(model.model.layers), lambda x, y: model(input_ids=x, labels=y).loss, llama_batch


def zero3_memory_sweep(rank: int, world: int, model: str, n_layer: int, settings: list[tuple[bool, int]]) -> list:
    """`zero3_memory_worker` at ZeRO-3 for each (overlap, prefetch) of `settings`, in one process group."""
    return [zero3_memory_worker(rank, world, 3, overlap, n_layer, model, prefetch) for overlap, prefetch in settings]


def _tiny(model_class: str, config_class: str, **config):
    """A tiny Hugging Face model of `transformers.<model_class>` from `<config_class>(**config)`."""
    def build():
        import transformers

        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
        if model_class == "GPT2LMHeadModel":  # else transformers' logger breaks the graph (README)
            model.loss_type = "ForCausalLM"
        return model
    return build


_DECODER = dict(vocab_size=LLAMA["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, max_position_embeddings=16)
# Tiny Hugging Face models of `hf_parity_worker`, each built from its config: `make test` trains
# some of them (`tests/test_hugging_face.py`: its CASES, its tests by name and its search), all with PIPER_HF_SWEEP=1.
HUGGING_FACE = {
    "llama": tiny_llama,
    # An encoder and a decoder sharing one embedding with the head, relative position biases,
    # and labels shifted right into the decoder's input by slice assignment.
    "t5": _tiny("T5ForConditionalGeneration", "T5Config", vocab_size=LLAMA["vocab_size"], d_model=32, d_kv=16,
                d_ff=64, num_layers=2, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0),
    # Rotary frequencies in a buffer (`inv_freq`), biased query, key and value projections,
    # grouped keys and values, and the head tied to the embedding.
    "qwen2": _tiny("Qwen2ForCausalLM", "Qwen2Config", **_DECODER, num_key_value_heads=1,
                   tie_word_embeddings=True),
    "mistral": _tiny("MistralForCausalLM", "MistralConfig", **_DECODER, num_key_value_heads=1),
    "gemma": _tiny("GemmaForCausalLM", "GemmaConfig", **_DECODER, num_key_value_heads=1, head_dim=16),
    "phi": _tiny("PhiForCausalLM", "PhiConfig", **_DECODER, resid_pdrop=0.0, embd_pdrop=0.0),
    "gpt_neox": _tiny("GPTNeoXForCausalLM", "GPTNeoXConfig", **_DECODER),
    "opt": _tiny("OPTForCausalLM", "OPTConfig", vocab_size=LLAMA["vocab_size"], hidden_size=32, ffn_dim=64,
                 num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=16,
                 word_embed_proj_dim=32, dropout=0.0),
    "gpt2": _tiny("GPT2LMHeadModel", "GPT2Config", vocab_size=LLAMA["vocab_size"], n_positions=16, n_embd=32,
                  n_layer=2, n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0),
    "bert": _tiny("BertForMaskedLM", "BertConfig", **_DECODER, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0),
    # Mixture of experts: top-2 routing over 4 experts, whose matmuls in fp32 are transformers'
    # custom op `grouped_mm_fallback` (`piper_fx.sharding.library_rules`).
    "mixtral": _tiny("MixtralForCausalLM", "MixtralConfig", **_DECODER, num_key_value_heads=1, num_local_experts=4,
                     num_experts_per_tok=2),
    "qwen3": _tiny("Qwen3ForCausalLM", "Qwen3Config", **_DECODER, num_key_value_heads=1, head_dim=16),
    # Latent attention (keys built in slices of a `new_empty` tensor) and a mixture of experts
    # after a dense first layer.
    "deepseek_v3": _tiny("DeepseekV3ForCausalLM", "DeepseekV3Config", **_DECODER, num_key_value_heads=2,
                         n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=16,
                         kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                         first_k_dense_replace=1, n_group=1, topk_group=1),
    # Experts after a dense first layer, whose router keeps a correction of its scores in a
    # parameter with requires_grad=False.
    "ernie4_5_moe": _tiny("Ernie4_5_MoeForCausalLM", "Ernie4_5_MoeConfig", **_DECODER, num_key_value_heads=1,
                          moe_num_experts=4, moe_k=2, moe_intermediate_size=32, moe_layer_start_index=1),
    # An encoder and a decoder with learned positions and embeddings scaled in the forward.
    "bart": _tiny("BartForConditionalGeneration", "BartConfig", vocab_size=LLAMA["vocab_size"], d_model=32,
                  encoder_layers=1, decoder_layers=1, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=16, dropout=0.0,
                  attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0, eos_token_id=2,
                  decoder_start_token_id=2),
    # No attention: a selective state-space scan over the sequence (a causal convolution, then
    # a recurrence of sequence length steps).
    "mamba": _tiny("MambaForCausalLM", "MambaConfig", vocab_size=LLAMA["vocab_size"], hidden_size=32, state_size=8,
                   num_hidden_layers=2, expand=2, conv_kernel=4),
    # Linear attention (a gated delta rule over chunks, which reverses their cumulative decays)
    # beside full attention, and experts with a shared one.
    "qwen3_next": _tiny("Qwen3NextForCausalLM", "Qwen3NextConfig", **_DECODER, num_key_value_heads=1, head_dim=16,
                        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, linear_num_value_heads=2, linear_num_key_heads=2,
                        linear_key_head_dim=8, linear_value_head_dim=8,
                        layer_types=["linear_attention", "full_attention"]),
    # One key and value head expanded over the query's heads, attention and MLP side by side.
    "falcon": _tiny("FalconForCausalLM", "FalconConfig", vocab_size=LLAMA["vocab_size"], hidden_size=32,
                    num_hidden_layers=2, num_attention_heads=2, hidden_dropout=0.0, attention_dropout=0.0),
    # Sliding-window layers and soft-capped attention scores and logits.
    "gemma2": _tiny("Gemma2ForCausalLM", "Gemma2Config", **_DECODER, num_key_value_heads=1, head_dim=16,
                    sliding_window=4, final_logit_softcapping=30.0, attn_logit_softcapping=50.0),
    # Mamba layers and an attention layer, experts in every other layer.
    "jamba": _tiny("JambaForCausalLM", "JambaConfig", vocab_size=LLAMA["vocab_size"], hidden_size=32,
                   intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                   num_experts=2, num_experts_per_tok=1, attn_layer_period=2, attn_layer_offset=1,
                   expert_layer_period=2, expert_layer_offset=1, mamba_d_state=4, mamba_d_conv=4, mamba_expand=2),
}

# Tiny Hugging Face models `hf_parity_worker` trains under eager code alone (`codegen: "eager"`),
# out of the search over `HUGGING_FACE`, which draws Inductor too.
EAGER_CODE_ONLY = {
    # Pools its sequence between blocks (an average pool), and the decoder adds the first
    # block's output to the upsampled last one, and builds its attention's class mask from
    # that sum. Inductor's C++ code generation of its kernels does not finish (SymPy's
    # simplification of an index, 400 s and more; `torch.compile` of the model alone as well).
    "funnel": _tiny("FunnelForMaskedLM", "FunnelConfig", vocab_size=LLAMA["vocab_size"], d_model=32, n_head=2,
                    d_head=16, d_inner=64, block_sizes=[1, 1], hidden_dropout=0.0, attention_dropout=0.0,
                    activation_dropout=0.0),
}


class LossOf(nn.Module):
    """A module around a Hugging Face model whose forward returns the loss alone, which
    `hf_parity_worker` compiles under a pipeline: `piper_fx.prepare` marks the batch dynamic
    in a hook of the module it prepares, which would break the function it compiles otherwise.
    (The model itself compiles too: `hf_outputs_worker`.)"""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x, y, attention_mask=None):
        return self.model(input_ids=x, attention_mask=attention_mask, labels=y).loss


def padded(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The batch with every other row's last 3 tokens padding, as a tokenizer pads a batch to
    its longest row: their attention mask is 0 and their labels -100. Every pair of rows
    holds the same number of tokens, so any split of the batch into pairs of rows has the
    same mean loss over its tokens as the whole batch."""
    mask = torch.ones_like(x)
    mask[::2, -3:] = 0
    return x, y.masked_fill(mask == 0, -100), mask


def ddp_buffers_worker(rank: int, world: int, runs: list[dict]) -> list[dict]:
    """The ConvNet (its BatchNorm's running statistics) trained by piper_fx with each of `runs`'
    options and by DDP with their `broadcast_buffers` (default False), on this rank's rows of
    each batch: 3 calls and 2 SGD steps, the second call in a window (`piper_fx.no_sync`,
    DDP's `no_sync()`, where neither broadcasts), then a call in eval mode without gradients.
    Per run: each side's losses (the eval call's last) and buffers, and the bytes piper_fx's
    calls broadcast (`last_step_stats`)."""
    from torch.nn.parallel import DistributedDataParallel

    from models import ConvNet, conv_batch

    out = []
    for options in runs:
        torch.manual_seed(rank)  # replicas built unlike: both sides start from rank 0's
        model = ConvNet()
        reference = DistributedDataParallel(copy.deepcopy(model), broadcast_buffers=options.get("broadcast_buffers",
                                                                                                 False))
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
        opt, ref_opt = make_optimizer("sgd", model.parameters()), make_optimizer("sgd", reference.parameters())
        losses: dict[str, list[float]] = {"piper": [], "ddp": []}
        broadcast = []
        for call in range(3):
            x, y = (part.chunk(world)[rank] for part in conv_batch(call, 4 * world))
            windowed = call == 1
            with piper_fx.no_sync(step) if windowed else contextlib.nullcontext():
                loss = step(x, y)
                loss.backward()
            with reference.no_sync() if windowed else contextlib.nullcontext():
                ref_loss = reference(x, y)
                ref_loss.backward()
            losses["piper"].append(loss.item())
            losses["ddp"].append(ref_loss.item())
            broadcast.append(piper_fx.last_step_stats()["comm_bytes"].get("broadcast", 0))
            if not windowed:
                for stepped in (opt, ref_opt):
                    stepped.step()
                    stepped.zero_grad()
        model.eval()
        reference.eval()
        with torch.no_grad():
            x, y = (part.chunk(world)[rank] for part in conv_batch(3, 4 * world))
            losses["piper"].append(step(x, y).item())
            losses["ddp"].append(reference(x, y).item())
            broadcast.append(piper_fx.last_step_stats()["comm_bytes"].get("broadcast", 0))
        out.append({"losses": losses, "broadcast_bytes": broadcast, "buffers": {
            "piper": {name: b.clone() for name, b in model.named_buffers()},
            "ddp": {name: b.clone() for name, b in reference.module.named_buffers()}}})
        torch._dynamo.reset()
    return out


def local_rows_worker(rank: int, world: int, options: dict, model: str = "batch_norm") -> dict:
    """A model whose step depends on which rows it computes together (its forward mutates
    buffers from them, or its loss mixes them) trained 3 steps (SGD) on this rank's share of
    each batch, beside an eager copy trained as DDP trains it without broadcasting buffers (its
    gradients averaged over the ranks, its buffers updated from this rank's rows alone, as
    under FSDP2), on the options' microbatches one after another (each normalized by its own
    statistics, and updating the buffers in turn, as gradient accumulation and
    torch.distributed.pipelining do): the largest relative differences of the losses, and of
    every parameter and buffer (`full_state_dict`'s, on every rank), and whether the model
    holds the buffer objects it started with. `model`: "batch_norm" (`models.BatchNormMLP`),
    "conv" (`models.ConvNet`), "conv_group_norm" (its group norm in place of the batch norm),
    "spectral_norm" (`models.SpectralNormMLP`) or "contrastive" (`models.ContrastiveTowers`); and
    "checks_targets" (`models.ChecksItsTargets`, a graph break before its layers), whose rows
    are independent, for which that copy is one process on the global batch."""
    from models import BatchNormMLP, ChecksItsTargets, ContrastiveTowers, ConvNet, SpectralNormMLP, batch, conv_batch

    build, batch = {"batch_norm": (BatchNormMLP, batch), "conv": (ConvNet, conv_batch),
                    "conv_group_norm": (functools.partial(ConvNet, False), conv_batch),
                    "spectral_norm": (SpectralNormMLP, batch), "contrastive": (ContrastiveTowers, batch),
                    "checks_targets": (ChecksItsTargets, batch)}[model]
    torch.manual_seed(0)
    model, reference = build(), build()
    buffers = dict(model.named_buffers())
    reference.load_state_dict(model.state_dict())
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    opt, ref_opt = make_optimizer("sgd", model.parameters()), make_optimizer("sgd", reference.parameters())
    mesh = options.get("mesh", {})
    dp = mesh.get("dp", world // mesh.get("pp", 1))  # a pipeline's ranks: one replica (dp 1) or dp alone
    microbatches = options.get("pipeline", {}).get("microbatches", 1)
    loss_errors = []
    for i in range(3):  # 4 rows a microbatch: a batch norm's variance of fewer is all rounding
        x, y = (t.chunk(dp)[rank % dp] for t in batch(i, 4 * dp * microbatches))
        loss = step(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = 0.0
        for x_m, y_m in zip(x.chunk(microbatches), y.chunk(microbatches)):
            microbatch_loss = reference(x_m, y_m) / microbatches
            microbatch_loss.backward()
            ref_loss += microbatch_loss.detach()
        for p in reference.parameters():  # the replicas' mean: each pipeline rank has its replica's
            if dp > 1:
                dist.all_reduce(p.grad)
                p.grad /= world
        ref_opt.step()
        ref_opt.zero_grad()
        loss_errors.append(abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    full, expected = piper_fx.full_state_dict(model), reference.state_dict()
    return {"loss_errors": loss_errors, "errors": {name: relative_error(full[name].double(), expected[name].double())
                                                   for name in expected},
            "same_buffers": all(held is buffers[name] for name, held in model.named_buffers())}


def sync_batch_norm_worker(rank: int, world: int, options: dict) -> dict:
    """The ConvNet with its batch norm made a `nn.SyncBatchNorm` (`convert_sync_batchnorm`),
    trained 3 SGD steps on this rank's rows of each batch, against one process with a
    `BatchNorm2d` stepping through the microbatches of the global batch in turn (each the
    replicas' microbatches together: a synchronized batch norm normalizes by all of their
    rows), then evaluated on a batch: the relative errors of the losses (the evaluation's
    last), and of every parameter and buffer (`full_state_dict`'s). Under a pipeline it is not
    evaluated: the ConvNet's stages are cut by cost, which put the synchronized norm's weight
    and bias (ops of their own in training) on two stages, where an evaluation's batch norm
    reads both (a `PiperError` that says to mark the stages)."""
    from models import ConvNet, conv_batch

    torch.manual_seed(0)
    model, reference = nn.SyncBatchNorm.convert_sync_batchnorm(ConvNet()), ConvNet()
    reference.load_state_dict(model.state_dict())
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    opt, ref_opt = make_optimizer("sgd", model.parameters()), make_optimizer("sgd", reference.parameters())
    mesh = options.get("mesh", {})
    dp = mesh.get("dp", world // mesh.get("pp", 1))
    microbatches = options.get("pipeline", {}).get("microbatches", 1)
    loss_errors = []
    for i in range(3 if mesh.get("pp", 1) > 1 else 4):
        x, y = conv_batch(i, 4 * dp * microbatches)  # 4 rows a replica's microbatch
        training = i < 3
        model.train(training)
        reference.train(training)
        with contextlib.nullcontext() if training else torch.no_grad():
            loss = step(x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp])
            if training:
                loss.backward()
            loss = loss.detach().clone()
            ref_loss = 0.0
            # Microbatch m of the global batch: every replica's microbatch m.
            parts = [[t.chunk(microbatches) for t in (x_r, y_r)] for x_r, y_r in zip(x.chunk(dp), y.chunk(dp))]
            for m in range(microbatches):
                x_m, y_m = (torch.cat([part[k][m] for part in parts]) for k in range(2))
                microbatch_loss = reference(x_m, y_m) / microbatches
                if training:
                    microbatch_loss.backward()
                ref_loss += microbatch_loss.detach()
        if training:
            for stepped in (opt, ref_opt):
                stepped.step()
                stepped.zero_grad()
        if dp > 1:
            dist.all_reduce(loss)
            loss /= world
        loss_errors.append(abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    full, expected = piper_fx.full_state_dict(model), reference.state_dict()
    return {"loss_errors": loss_errors, "errors": {name: relative_error(full[name].double(), expected[name].double())
                                                   for name in expected}}


def pipeline_evaluation_worker(rank: int, world: int, options: dict) -> tuple[float, float]:
    """The ConvNet (stages cut by cost) trained one call under `options`' pipeline, then
    evaluated on a batch: its loss and that of one process stepping through the same
    microbatches (the running statistics updated microbatch by microbatch)."""
    from models import ConvNet, conv_batch

    torch.manual_seed(0)
    model, reference = ConvNet(), ConvNet()
    reference.load_state_dict(model.state_dict())
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    x, y = conv_batch(0, 8)
    step(x, y).backward()
    for x_m, y_m in zip(x.chunk(options["pipeline"]["microbatches"]), y.chunk(options["pipeline"]["microbatches"])):
        reference(x_m, y_m)
    model.eval()
    reference.eval()
    with torch.no_grad():
        x, y = conv_batch(1, 8)
        return step(x, y).item(), reference(x, y).item()


def frozen_worker(rank: int, world: int, options: dict, pp_regions: bool) -> dict:
    """`train_and_compare` of the GPT (AdamW, 3 steps) with two parameters frozen before `prepare`."""
    return train_and_compare(rank, world, options, "adamw_eps", steps=3, pp_regions=pp_regions, frozen=True)


def hf_parity_worker(rank: int, world: int, name: str, options: dict, steps: int = 3, rows: int = 4,
                     pad: bool = False, checkpointed: bool = False, on_meta: bool = False,
                     lengths: list[int | list[int]] | None = None, itself: bool = False,
                     unsynced_steps: tuple[int, ...] = ()) -> dict:
    """A tiny Hugging Face model (`HUGGING_FACE[name]` or `EAGER_CODE_ONLY[name]`) trained with
    piper_fx on this rank's shard of `rows` rows a replica against one copy on the global batch
    (SGD with momentum): relative errors of the losses, and the parameters (by name) whose
    final values are not those of the copy (`torch.allclose`, rtol 1e-5, atol 1e-7: a key
    projection's bias has no gradient but rounding). Under a pipeline, the compiled module is the model in a
    `LossOf`. With `pad`, the batch is `padded`, and the model is called with its attention
    mask. With `checkpointed`, the model recomputes its layers' activations in the backward
    (transformers' `activation_checkpointing_enable`, non-reentrant, with no key and value
    cache, whose warning that it is off would break the graph). With `on_meta`, the model is
    built on the meta device, prepared there, and given memory and values (`materialize_as`).
    With `lengths`, step i's sequences have that many tokens (as batches padded to their
    longest row do; each length compiles a step of its own), or as many as the list names
    for each replica (each rank pads its batch to its own longest row): then against one copy
    stepping on the mean of the replicas' losses, as DDP trains on them. With `itself`, the
    compiled module is the model itself, called with keywords and returning its `ModelOutput`
    (with its key and value cache on, as its config has it: Dynamo returns the cache's tensors
    before the loss), whose loss trains. The steps in `unsynced_steps` accumulate their
    gradients into the next: piper_fx's call runs in `piper_fx.no_sync` of the model, and
    neither side steps its optimizer after it."""
    build = HUGGING_FACE.get(name) or EAGER_CODE_ONLY[name]
    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(0)
    source = build()
    if on_meta:
        with torch.device("meta"):
            model = build()
    else:
        model = source
    if checkpointed:
        model.activation_checkpointing_enable({"use_reentrant": False})
        model.config.use_cache = False
    mesh = options.get("mesh", {})
    dp = mesh.get("dp", world // mesh.get("pp", 1))
    compiled = LossOf(model) if mesh.get("pp", 1) > 1 and not itself else None
    piper_fx.prepare(compiled or model, options)
    if on_meta:  # the module prepare laid out, which keeps tied parameters tied (`laid_out_on_meta`)
        materialize_as(compiled or model, LossOf(source) if compiled else source)
    opt, ref_opt = make_optimizer("sgd", model.parameters()), make_optimizer("sgd", reference.parameters())
    if itself:
        whole = torch.compile(model, backend="piper", options=options)

        def step(x, y, attention_mask=None):
            return whole(input_ids=x, attention_mask=attention_mask, labels=y).loss
    else:
        def loss_of(x, y, attention_mask=None):
            return model(input_ids=x, attention_mask=attention_mask, labels=y).loss

        step = torch.compile(compiled or loss_of, backend="piper", options=options)
    loss_errors = []
    for i in range(len(lengths) if lengths else steps):
        batch = llama_batch(i, rows * dp)  # by default 4 rows a replica: 2 a microbatch under a pipeline
        length = lengths[i] if lengths else None
        if isinstance(length, list):  # each replica's part cut to its own length
            parts = [tuple(t[:, :n].contiguous() for t in part) for part, n in zip(zip(*(t.chunk(dp) for t in batch)),
                                                                                   length)]
            parts = [padded(*part) if pad else part for part in parts]
        else:
            batch = tuple(t[:, :length].contiguous() for t in batch) if length else batch
            batch = padded(*batch) if pad else batch
            parts = list(zip(*(t.chunk(dp) for t in batch)))
        unsynced = i in unsynced_steps
        with piper_fx.no_sync(compiled or model) if unsynced else contextlib.nullcontext():
            loss = step(*parts[rank % dp])
            ref_loss = sum(LossOf(reference)(*part) for part in parts) / dp if isinstance(length, list) \
                else LossOf(reference)(*batch)
            loss_errors.append(_step_both(loss, opt, ref_loss, ref_opt, world, stepping=not unsynced))
    return _parity(compiled or model, reference, loss_errors)


def hf_outputs_worker(rank: int, world: int, options: dict, steps: int = 2, rows: int = 4,
                      cache: bool = False) -> dict:
    """Hugging Face's Llama compiled itself, as one compiles it for eager training, not a module
    returning its loss: called with keywords, it returns its `CausalLMOutputWithPast`, the loss
    beside the logits (and with `cache`, its key and value cache, on as its config has it).
    Trained on this rank's shard of `rows` rows a replica against one copy on the global batch
    (SGD with momentum): the relative errors of the losses, the parameters that differ (as
    `hf_parity_worker`), and per step the largest difference of the logits the step returned
    from the copy's on this replica's rows, or None where the rank returned none; with `cache`,
    per step and layer, that of its keys and values."""
    torch.manual_seed(0)
    reference = tiny_llama()
    torch.manual_seed(0)
    model = tiny_llama()
    for each in (model, reference):
        if not cache:
            without_cache(each)
    mesh = options.get("mesh", {})
    dp = mesh.get("dp", world // mesh.get("pp", 1))
    piper_fx.prepare(model, options)
    opt, ref_opt = make_optimizer("sgd", model.parameters()), make_optimizer("sgd", reference.parameters())
    step = torch.compile(model, backend="piper", options=options)
    loss_errors, logits_errors, cache_errors = [], [], []

    def error(value: torch.Tensor | None, expected: torch.Tensor) -> float | None:
        return None if value is None else (value - expected.detach().chunk(dp)[replica]).abs().max().item()

    for i in range(steps):
        x, y = llama_batch(i, rows * dp)
        replica = rank % dp
        out = step(input_ids=x.chunk(dp)[replica], labels=y.chunk(dp)[replica])
        expected = reference(input_ids=x, labels=y)
        logits_errors.append(error(out.logits, expected.logits))
        if cache:
            cache_errors.append([(error(layer.keys, expected_layer.keys), error(layer.values, expected_layer.values))
                                 for layer, expected_layer in zip(out.cache.layers, expected.cache.layers, strict=True)])
        loss_errors.append(_step_both(out.loss, opt, expected.loss, ref_opt, world))
    return {**_parity(model, reference, loss_errors), "logits_errors": logits_errors, "cache_errors": cache_errors}


def without_cache(model: nn.Module) -> None:
    """Turn off the key and value cache of a Hugging Face model, each of whose modules with a
    config reads its own (T5's decoder keeps a copy): Dynamo's graph would return the cache's
    tensors before the loss."""
    for module in model.modules():
        config = getattr(module, "config", None)
        if getattr(config, "use_cache", False):
            config.use_cache = False


def _step_both(loss: torch.Tensor, opt, ref_loss: torch.Tensor, ref_opt, world: int,
               stepping: bool = True) -> float:
    """Step the trained model and the reference on their losses (or, not `stepping`, only
    accumulate their gradients): the relative error of the replicas' mean loss."""
    for each, optimizer in ((loss, opt), (ref_loss, ref_opt)):
        each.backward()
        if stepping:
            optimizer.step()
            optimizer.zero_grad()
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss)
    return abs(mean_loss.item() / world - ref_loss.item()) / abs(ref_loss.item())


def _parity(trained: nn.Module, reference: nn.Module, loss_errors: list[float]) -> dict:
    """The relative errors of the losses, and the parameters (by name) whose final values in
    `trained` (the model, or a `LossOf` around it) are not those of `reference` (`torch.allclose`,
    rtol 1e-5, atol 1e-7), with their `relative_error`."""
    full = {name.removeprefix("model.") if isinstance(trained, LossOf) else name: value
            for name, value in piper_fx.full_state_dict(trained).items()}
    expected = reference.state_dict()
    assert full.keys() == expected.keys(), (sorted(full), sorted(expected))
    return {"loss_errors": loss_errors,
            "mismatched": {name: relative_error(full[name], expected[name]) for name in expected
                           if not torch.allclose(full[name], expected[name], rtol=1e-5, atol=1e-7)}}


# Tiny Hugging Face vision models, built from their configs: 16x16 images of 3 channels, 5 classes.
_IMAGES = dict(num_channels=3, num_labels=5)
_VIT = dict(image_size=16, patch_size=4, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **_IMAGES)
VISION = {
    # Windowed attention over shifted windows, patches merged between stages, and an adaptive
    # average pool (its decomposition reads and writes its rows through `as_strided`).
    "swin": _tiny("SwinForImageClassification", "SwinConfig", image_size=16, patch_size=2, embed_dim=16,
                  depths=[2, 2], num_heads=[2, 2], window_size=2, drop_path_rate=0.0, hidden_dropout_prob=0.0,
                  attention_probs_dropout_prob=0.0, **_IMAGES),
    # A relative position bias table interpolated to the patches (its backward adds the
    # gradient into zeros at replicated indices).
    "beit": _tiny("BeitForImageClassification", "BeitConfig", use_relative_position_bias=True, drop_path_rate=0.0,
                  **_VIT),
    "vit": _tiny("ViTForImageClassification", "ViTConfig", **_VIT),
    "convnext": _tiny("ConvNextForImageClassification", "ConvNextConfig", num_stages=2, hidden_sizes=[8, 16],
                      depths=[1, 1], drop_path_rate=0.0, image_size=16, **_IMAGES),
}


# Image classifiers with batch norms, whose statistics are each microbatch's: compared with one
# process stepping through the microbatches in turn (`vision_parity_worker`), under a pipeline.
BATCH_NORMED = {
    "resnet": _tiny("ResNetForImageClassification", "ResNetConfig", embedding_size=8, hidden_sizes=[8, 16],
                    depths=[1, 1], layer_type="basic", **_IMAGES),
}


class ImageLoss(LossOf):
    """A Hugging Face image classifier whose forward returns the loss alone."""

    def forward(self, images, labels):
        return self.model(pixel_values=images, labels=labels).loss


def vision_parity_worker(rank: int, world: int, name: str, options: dict, steps: int = 3) -> dict:
    """A tiny vision model (`VISION[name]`, or `BATCH_NORMED[name]`) trained with piper_fx on
    this rank's shard of 4 images a replica against one copy on the global batch (SGD with
    momentum), as `hf_parity_worker` compares them. A batch-normed one, under a pipeline of
    one replica, against one copy stepping through the options' microbatches in turn (its
    loss their mean), as gradient accumulation and torch.distributed.pipelining do; its
    running statistics are compared too."""
    build = VISION.get(name) or BATCH_NORMED[name]
    torch.manual_seed(0)
    reference = build()
    torch.manual_seed(0)
    model = ImageLoss(build())
    piper_fx.prepare(model, options)
    mesh = options.get("mesh", {})
    dp = mesh.get("dp", world // mesh.get("pp", 1))
    opt, ref_opt = make_optimizer("sgd", model.parameters()), make_optimizer("sgd", reference.parameters())
    step = torch.compile(model, backend="piper", options=options)
    loss_errors = []
    for i in range(steps):
        generator = torch.Generator().manual_seed(i)
        images = torch.randn(4 * dp, 3, 16, 16, generator=generator)
        labels = torch.randint(0, 5, (4 * dp,), generator=generator)
        loss = step(images.chunk(dp)[rank % dp], labels.chunk(dp)[rank % dp])
        if name in BATCH_NORMED:
            assert dp == 1, "each replica's statistics are its own: one copy stands for one replica"
            microbatches = options.get("pipeline", {}).get("microbatches", 1)
            ref_loss = sum(ImageLoss(reference)(*microbatch) for microbatch in zip(images.chunk(microbatches),
                                                                                  labels.chunk(microbatches)))
            ref_loss = ref_loss / microbatches
        else:
            ref_loss = ImageLoss(reference)(images, labels)
        loss_errors.append(_step_both(loss, opt, ref_loss, ref_opt, world))
    return _parity(model, reference, loss_errors)


def units_worker(rank: int, world: int, cases: list[list[str] | None], debug_root: str) -> list:
    """One ZeRO-3 step of the tiny Llama for each value of the option `units` in `cases`: this
    rank's `units.txt`, or the `PiperConfigError` compiling raised, as (key, message)."""
    from pathlib import Path

    results = []
    for case, patterns in enumerate(cases):
        torch.manual_seed(0)
        model = tiny_llama()
        options = {"zero": 3, "codegen": "eager", "units": patterns, "debug_dir": f"{debug_root}/{case}"}
        piper_fx.prepare(model, options)
        step = torch.compile(lambda x, y: model(input_ids=x, labels=y).loss, backend="piper", options=options)
        x, y = llama_batch(0, 2 * world)
        try:
            step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
        except piper_fx.PiperConfigError as e:
            results.append((e.key, str(e)))
            continue
        (graph_dir,) = (Path(debug_root) / str(case) / f"rank{rank}").iterdir()
        results.append((graph_dir / "units.txt").read_text())
    return results


def program_held_bytes(watch):
    """A `LiveStorageBytes` that counts the storages the ops `watch` selects for as long as the
    program holds them, not the communication backend: their outputs reach the program as
    aliases. A collective's work object keeps its output alive after the wait, until gloo's
    worker thread next takes its queue lock; under load that is after the next collective
    is issued, which would count a layer the program has already freed."""
    from torch.utils._pytree import tree_leaves, tree_map_only

    from piper_fx.runtime.memory import LiveStorageBytes

    class ProgramHeldBytes(LiveStorageBytes):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.watch(func):
                return super().__torch_dispatch__(func, types, args, kwargs)
            out = tree_map_only(torch.Tensor, torch.ops.aten.alias.default, func(*args, **(kwargs or {})))
            for value in tree_leaves(out):
                self._observe(func, value)
            return out

    return ProgramHeldBytes(watch)


# ---- Failures (tests/test_failures.py): a step that fails on one rank ends on every rank.

class InjectedFailure(ValueError):
    """The error a test makes one rank's task raise."""


class FailOnTask:
    """A context entered around every task run (`around_tasks`) that raises `error` on
    rank `fail_rank`'s `nth` task run (counting from 1): a failure in the middle of a step."""

    def __init__(self, rank: int, fail_rank: int, nth: int, error: Exception):
        self.armed, self.nth, self.error, self.runs = rank == fail_rank, nth, error, 0

    def __enter__(self):
        self.runs += 1
        if self.armed and self.runs == self.nth:
            raise self.error

    def __exit__(self, *exc_info):
        return False


def outcome_of(error: BaseException | None, elapsed_s: float) -> dict:
    """What a rank's failed call raised, as plain values that travel back from the worker."""
    if error is None:
        return {"type": None, "elapsed_s": elapsed_s}
    return {"type": type(error).__name__, "types": [c.__name__ for c in type(error).__mro__],
            "message": str(error), "notes": list(getattr(error, "__notes__", [])),
            "failed_rank": getattr(error, "failed_rank", None), "failed_where": getattr(error, "failed_where", None),
            "elapsed_s": elapsed_s}


def _call_timed(fn) -> tuple[BaseException | None, float]:
    import time

    start = time.monotonic()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects whatever the step raised
        return e, time.monotonic() - start
    return None, time.monotonic() - start


def _stay_until_peers_finish(rank: int, world: int, failed: bool) -> None:
    """Keep the failed rank's process, and so its connections, alive until every other rank has
    finished its step: as a rank that catches its error and goes on with other work would. Its
    peers then cannot learn of the failure from closed connections."""
    from datetime import timedelta

    store = dist.group.WORLD.get_group_store()
    if failed:
        store.wait([f"test/finished/{r}" for r in range(world) if r != rank], timedelta(seconds=300))
    else:
        store.set(f"test/finished/{rank}", "1")


def failing_step_worker(rank: int, world: int, options: dict, fail_rank: int, nth_task: int, error: Exception,
                        failed_rank_stays: bool) -> dict:
    """One good training step, then one in which `fail_rank` raises `error` in its `nth_task`-th task
    run: what this rank's second step raised, and after how many seconds."""
    from piper_fx.runtime.executor import around_tasks

    cfg = GPTConfig(**SMALL, tied_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.block_context = lambda: piper_fx.annotate("PP")
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    mesh = options.get("mesh", {})
    dp = mesh.get("dp", world // mesh.get("pp", 1))
    x, y = global_batch(0, 4 * dp, cfg)
    x, y = x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp]
    step(x, y).backward()  # compiled and run once: the failure comes in the middle of a warm step
    dist.barrier()
    with around_tasks(FailOnTask(rank, fail_rank, nth_task, error)):
        raised, elapsed_s = _call_timed(lambda: step(x, y).backward())
    if failed_rank_stays:
        _stay_until_peers_finish(rank, world, failed=rank == fail_rank)
    return outcome_of(raised, elapsed_s)


def _capture_compiled_step(model, options: dict) -> tuple:
    """`model` compiled by piper_fx, and a dict that receives the backend's step and the
    arguments Dynamo calls it with (parameters and batch, in the compiled order)."""
    captured: dict = {}

    def backend(gm, example_inputs):
        captured["step"] = compiled = piper_fx.piper_backend(gm, example_inputs, options)

        def call(*args):
            captured["args"] = args
            return compiled(*args)
        return call

    return torch.compile(model, backend=backend), captured


def bad_input_worker(rank: int, world: int) -> dict:
    """Calls of a compiled step (dp over every rank) whose batch is unlike the compiled one: on every
    rank (each rejects its own), after which a good step still runs, then on rank 1 only, while its
    peers run the step. What each call raised on this rank."""
    cfg = GPTConfig(**SMALL, tied_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    options = {"codegen": "eager"}
    piper_fx.prepare(model, options)
    compiled, captured = _capture_compiled_step(model, options)
    x, y = global_batch(0, 2 * world, cfg)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    compiled(x, y).backward()
    # Dynamo guards every argument's dtype and device, so a call through `compiled` with another
    # one compiles anew; the step itself is what a caller of the backend (or a guard-free
    # wrapper) runs, and what must reject arguments it was not compiled for.
    step, args = captured["step"], captured["args"]
    (tokens,) = [i for i, a in enumerate(args) if a is x]

    def call_with(tokens_value):
        return _call_timed(lambda: step(*args[:tokens], tokens_value, *args[tokens + 1:])[0].backward())

    outcomes = {"dtype": call_with(x.int()), "device": call_with(x.to("meta")), "shape": call_with(x[:1])}
    # A parameter placed otherwise than compiled (same global shape and local tensor), which the
    # step checks in place of Dynamo's guards on its spec; then a new parameter with an equal spec.
    # Dynamo passes each parameter's program placeholder; the step takes a parameter itself as well.
    (weight,) = [i for i, a in enumerate(args) if stood_for(a) is model.lm_head._parameters["weight"]]
    replicated = stood_for(args[weight])

    def call_with_weight(value):
        return _call_timed(lambda: step(*args[:weight], value, *args[weight + 1:])[0].backward())

    outcomes["placement"] = call_with_weight(DTensor.from_local(
        replicated.to_local(), replicated.device_mesh, [Shard(1)], run_check=False,
        shape=replicated.shape, stride=replicated.stride()))
    outcomes["equal_placement"] = call_with_weight(torch.nn.Parameter(DTensor.from_local(
        replicated.to_local().detach(), replicated.device_mesh, [Replicate()], run_check=False)))
    outcomes["good_after_rejections"] = call_with(x)
    outcomes["dtype_on_rank_1_only"] = call_with(x.int() if rank == 1 else x)
    result = {case: outcome_of(*raised) for case, raised in outcomes.items()}
    result["spec_guards"] = _parameter_spec_guards(model)
    return result


def _parameter_spec_guards(model) -> dict:
    """Of Dynamo's guards on `model`'s compiled forward: how many read a registered parameter
    (a DTensor, whose program placeholder Dynamo should see instead; guards that an absent
    one, e.g. a bias, is None aside) or a DTensor spec or mesh, how many read a program
    placeholder, how many of those ask whether a module holds one (each checked at every
    call), how many look a class's forward up through its type's MRO (ZeRO-3's gathering
    forward, `read_through.gathers_in_eager_forward`, calls its own), and how many parameters
    are DTensors."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    entries = _debug_get_cache_entry_list(type(model).forward.__code__)
    lines = [line for entry in entries for line in str(entry.guard_manager).splitlines()]
    dtensor = [line for line in lines if ("_parameters[" in line and "NoneType" not in line and "NONE_MATCH" not in line)
               or "._spec" in line or ".device_mesh" in line]
    return {"frames": len(entries), "guards": len(dtensor), "examples": dtensor[:3],
            "placeholder_guards": sum("_piper_program_placeholders" in line for line in lines),
            "placeholder_contains_guards": sum("_piper_program_placeholders" in line and "CONTAINS" in line
                                               for line in lines),
            "mro_guards": sum("__mro__" in line for line in lines),
            "dtensor_parameters": sum(isinstance(p, DTensor) for p in model.parameters())}


def recompiled_dtype_worker(rank: int, world: int) -> dict:
    """A pipeline (pp over every rank) called through torch.compile with int32 targets after it was
    compiled for int64 ones: Dynamo's dtype guard fails, the step is compiled again for int32,
    and the last stage's loss rejects them. What that call raised on this rank."""
    cfg = GPTConfig(**SMALL, tied_embeddings=False)
    torch.manual_seed(0)
    model = GPT(cfg)
    model.block_context = lambda: piper_fx.annotate("PP")
    options = {"mesh": {"pp": world}, "codegen": "eager", "pipeline": {"microbatches": 2}}
    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    x, y = global_batch(0, 4, cfg)
    step(x, y).backward()
    return outcome_of(*_call_timed(lambda: step(x, y.int()).backward()))


def plan_cache_worker(rank: int, world: int, configs: list[dict], cache_dir: str) -> list[dict]:
    """Per config: train it twice from the same start (`train_and_compare`, SGD), with a plan
    cache (and Inductor cache) directory of its own that starts empty: the second compile finds
    the first one's plan. Where each plan came from, and both runs' results."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    results = []
    try:
        for index, config in enumerate(configs):
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(cache_dir, str(index))
            config = dict(config)
            options = {"codegen": "eager", **config.pop("options")}
            runs = []
            for _ in range(2):
                run = train_and_compare(rank, world, options, "sgd", **{"steps": 3, **config})
                runs.append({"plan": piper_fx.last_compile_stats()["plan"], **run})
                torch._dynamo.reset()
            results.append(runs)
    finally:  # the rank pool's process serves other tests after this one
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    return results


def shared_compile_worker(rank: int, world: int, cache_dir: str) -> dict:
    """ZeRO-3 under Inductor from an empty cache directory shared by the ranks, against
    single-process training: how this rank obtained each task's code (`compile_stats`)."""
    previous = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    try:
        run = train_and_compare(rank, world, {"zero": 3, "codegen": "inductor"}, "sgd", steps=3)
        stats = piper_fx.last_compile_stats()
    finally:  # the rank pool's process serves other tests after this one
        if previous is None:
            os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
        else:
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = previous
    return {**run, "tasks": stats["tasks"], "phases": list(stats["seconds"])}


def failing_compile_worker(rank: int, world: int, fail_rank: int) -> str:
    """Data parallelism under Inductor in which `fail_rank`'s code generation raises: what
    compiling raised on this rank."""
    from piper_fx.codegen import inductor

    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    model = GPT(cfg)
    compile_task = inductor.compile_task

    def failing(task, time_waits=False):
        raise RuntimeError(f"no compiler for {task.name}")

    if rank == fail_rank:
        inductor.compile_task = failing
    try:
        x, y = global_batch(0, 2, cfg)
        torch.compile(model, backend="piper", options={"codegen": "inductor"})(x, y)
    except Exception as error:  # noqa: BLE001 - the error is the result
        return f"{type(error).__name__}: {error}"
    finally:
        inductor.compile_task = compile_task
        torch._dynamo.reset()
    return "nothing raised"


def ema_worker(rank: int, world: int) -> dict:
    """PyTorch's EMA (`torch.optim.swa_utils.AveragedModel` with `get_ema_multi_avg_fn`) of a
    prepared model, per ZeRO level (0 and 3), beside the EMA of one process training on the
    global batch: made after the first step's backward (its deep copy holds the step's
    gradients), updated after each of 3 SGD steps, the averages' largest difference (full
    tensors) and both averaged models' losses on another batch, run eagerly."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    results = {}
    for zero in (0, 3):
        torch._dynamo.reset()
        cfg = GPTConfig(**SMALL, tied_embeddings=True)
        models = []
        for _ in range(2):
            torch.manual_seed(0)
            models.append(GPT(cfg))
        model, reference = models
        options = {"codegen": "eager", "zero": zero}
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
        opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        averages = []
        for i in range(3):
            x, y = global_batch(i, 2 * world, cfg)
            step(x.chunk(world)[rank], y.chunk(world)[rank]).backward()
            reference(x, y).backward()
            if not averages:
                averages = [AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in models]
            for opt, m, average in zip(opts, models, averages):
                opt.step()
                opt.zero_grad()
                average.update_parameters(m)
        full, expected = piper_fx.full_state_dict(averages[0].module), averages[1].module.state_dict()
        x, y = global_batch(9, 2 * world, cfg)
        with torch.no_grad():
            losses = [average.module(x, y).item() for average in averages]
        results[zero] = {"difference": max(relative_error(full[k], expected[k]) for k in expected),
                         "keys": sorted(full) == sorted(expected), "losses": losses}
    return results


def program_placeholders_worker(rank: int, world: int) -> dict:
    """What Dynamo traces of a prepared model (dp over every rank, ZeRO-0 and ZeRO-3): the
    parameters' program placeholders, and what becomes of them. Per ZeRO level: a parameter
    frozen after the first step (the next call rejects it, the one after compiles anew and
    trains the others alone), the model moved where it is (a no-op) and converted to another
    dtype (a `PiperError`: convert before `prepare`), a deep copy of the model, holding a
    step's gradients and not (its placeholders stand for its own parameters), a parameter
    registered anew (its placeholder dropped), and the model compiled by another backend (its
    backward refuses to train the placeholders)."""
    from torch.distributed.tensor import DTensor

    from piper_fx.sharding.read_through import _PLACEHOLDERS

    results = {}
    for zero in (0, 3):
        torch._dynamo.reset()  # a fresh model per level: no recompile limit, no guard on the last one
        cfg = GPTConfig(**SMALL, tied_embeddings=True)
        torch.manual_seed(0)
        model = GPT(cfg)
        options = {"codegen": "eager", "zero": zero}
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
        x, y = global_batch(0, 2 * world, cfg)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        step(x, y).backward()
        result = {"guards": _parameter_spec_guards(model)}
        # A deep copy (an EMA copy) while the parameters hold the step's gradients, views into
        # their reduction's flat bucket: torch's `Tensor.__deepcopy__` failed on such DTensors.
        result["gradients_at_offsets"] = any(local(p.grad).storage_offset() for p in model.parameters())
        result["copy_with_gradients_differs"] = sorted(_copy_mismatches(model, copy.deepcopy(model)))
        placeholders = getattr(model.wte, _PLACEHOLDERS)
        weight = model.wte._parameters["weight"]
        result["stands_for_its_parameter"] = stood_for(placeholders["weight"]) is weight
        result["placeholder_is_plain"] = not isinstance(placeholders["weight"], DTensor)
        result["tied_share_one"] = getattr(model.lm_head, _PLACEHOLDERS)["weight"] is placeholders["weight"]
        # Moved or converted: to where it is, a no-op (the calls below run after it); anew, refused.
        result["to_where_it_is"] = model.to(torch.float32) is model and model.wte._parameters["weight"] is weight
        result["to_float64"] = outcome_of(*_call_timed(lambda: model.to(torch.float64)))
        result["still_float32"] = all(p.dtype == torch.float32 for p in model.parameters())
        # Frozen after compiling: this call is refused, the next compiles anew without its gradient.
        frozen = model.blocks[0].mlp.fc._parameters["weight"]
        frozen.requires_grad_(False)
        model.zero_grad()
        result["frozen_call"] = outcome_of(*_call_timed(lambda: step(x, y).backward()))
        result["after_frozen_call"] = outcome_of(*_call_timed(lambda: step(x, y).backward()))
        result["frozen_grad_is_none"] = frozen.grad is None
        result["others_have_grads"] = all(p.grad is not None for p in model.parameters() if p.requires_grad)
        frozen.requires_grad_(True)
        # A deep copy: its placeholders stand for its own parameters, tied ones still one.
        model.zero_grad()
        twin = copy.deepcopy(model)
        twin_placeholders = getattr(twin.wte, _PLACEHOLDERS)
        result["copy_stands_for_copy"] = stood_for(twin_placeholders["weight"]) is twin.wte._parameters["weight"]
        result["copy_tied_share_one"] = getattr(twin.lm_head, _PLACEHOLDERS)["weight"] is twin_placeholders["weight"]
        # A parameter registered anew drops its placeholder and the property reading it: reads
        # give the new one. The original's module, whose class the copy's shared, still reads its own.
        twin.ln_f.bias = torch.nn.Parameter(twin.ln_f._parameters["bias"].detach().clone())
        result["registered_anew_dropped"] = "bias" not in getattr(twin.ln_f, _PLACEHOLDERS)
        result["registered_anew_read"] = twin.ln_f.bias is twin.ln_f._parameters["bias"]
        result["original_reads_through"] = "bias" in type(model.ln_f).__dict__ and \
            "bias" in getattr(model.ln_f, _PLACEHOLDERS) and "bias" not in type(twin.ln_f).__dict__
        # Another backend traces the placeholders: its backward must not train them in silence.
        other = torch.compile(model, backend="aot_eager")
        result["other_backend"] = outcome_of(*_call_timed(lambda: other(x, y).backward()))
        results[zero] = result
    return results


def replaced_memory_worker(rank: int, world: int) -> dict:
    """A parameter whose memory was replaced between steps (its local tensor given new storage,
    as `.data =` gives it) is read from there by the next step, not from what the step read
    before: per ZeRO level, two prepared models of the same seed, each stepped once; then the
    embedding (37 rows: padded under ZeRO-3) is zeroed, in one in new memory, in the other in
    place. Their next losses are the same, and not the first step's."""
    results = {}
    for zero in (0, 3):
        torch._dynamo.reset()
        cfg = GPTConfig(**SMALL)
        x, y = global_batch(0, 2 * world, cfg)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        losses = []
        for replace in (True, False):
            torch.manual_seed(0)
            model = GPT(cfg)
            options = {"codegen": "eager", "zero": zero}
            piper_fx.prepare(model, options)
            step = torch.compile(model, backend="piper", options=options)
            first = step(x, y).item()
            local = local_tensor(model.wte._parameters["weight"])  # itself (`to_local` gives an alias)
            with torch.no_grad():
                if replace:
                    local.data = torch.zeros_like(local)
                else:
                    local.zero_()
            losses.append((first, step(x, y).item()))
        (first, replaced), (_, in_place) = losses
        results[zero] = {"first": first, "replaced": replaced, "in_place": in_place}
    return results


def _bucket_shards(rank: int) -> list[torch.Tensor]:
    """Shards of a bucket that differ by rank: a matrix, a transposed view, a 0-d tensor."""
    return [torch.arange(6.0).reshape(2, 3) + 100 * rank, (torch.arange(4.0).reshape(2, 2) + 10 * rank).t(),
            torch.tensor(rank + 0.5)]


def gather_bucket_worker(rank: int, world: int) -> dict:
    """`piper::gather_bucket` over the world, checked against every rank's shards (known to
    each rank) flattened in turn, rank after rank, in float32 and cast to bfloat16."""
    from piper_fx.collectives.buckets import GATHER_BUCKET
    from piper_fx.ops import WAIT

    shards = _bucket_shards(rank)
    checks = {}
    for dtype in (torch.float32, torch.bfloat16):
        gathered = WAIT(GATHER_BUCKET(shards, world, dist.group.WORLD.group_name, dtype))
        expected = torch.cat([t.reshape(-1).to(dtype) for r in range(world) for t in _bucket_shards(r)])
        checks[str(dtype).removeprefix("torch.")] = gathered.dtype == dtype and torch.equal(gathered, expected)
        checks["aliases_a_shard"] = checks.get("aliases_a_shard", False) or any(
            gathered.untyped_storage().data_ptr() == t.untyped_storage().data_ptr() for t in shards)
    return checks


def attribute_reads_worker(rank: int, world: int) -> dict:
    """A sharded parameter read as the module's attribute, as FSDP2's reads: outside a forward the
    parameter's `DTensor`, so writes into it (`zero_()`, `nn.init`, a module's `reset_parameters`)
    reach its shards; inside an eager forward of the model, or of a module holding it called
    alone, the full tensor, gathered. Per case (ZeRO-3 over dp; experts over ep), against the
    unsharded model of the same seed: the reads' types and placements, the eager losses, the
    same writes on both models, the compiled step's loss after them, and a forward that raises
    (its reads outside a forward are `DTensor`s again)."""
    from piper_fx.sharding.experts import is_expert_parameter

    results = {}
    for case, extra, options in (("zero3", {}, {"zero": 3}),
                                 ("experts", {"n_expert": 4}, {"mesh": {"dp": world, "ep": world}})):
        torch._dynamo.reset()
        cfg = GPTConfig(**SMALL, **extra)
        torch.manual_seed(0)
        reference = GPT(cfg)
        torch.manual_seed(0)
        model = GPT(cfg)
        mark_regions(model, experts=bool(extra))
        options = {"codegen": "eager", **options}
        piper_fx.prepare(model, options)
        x, y = global_batch(0, 2 * world, cfg)
        x, y = x.chunk(world)[rank], y.chunk(world)[rank]
        result = {}
        named = dict(model.named_parameters())
        sharded = [name for name, p in named.items() if isinstance(p, DTensor) and p.placements == (Shard(0),)
                   and (is_expert_parameter(p) or not extra)]

        def attribute(name: str) -> torch.Tensor:
            module, _, attr = name.rpartition(".")
            return getattr(model.get_submodule(module), attr)

        result["sharded"] = len(sharded)
        result["reads_are_the_parameters"] = all(attribute(name) is named[name] for name in sharded)
        result["eager_loss"] = (model(x, y).item(), reference(x, y).item())
        fc = model.blocks[0].mlp.fc if not extra else None
        if fc is not None:
            h = torch.randn(3, cfg.n_embd, generator=torch.Generator().manual_seed(rank))
            result["module_alone"] = torch.equal(fc(h), reference.blocks[0].mlp.fc(h))
            try:
                fc(torch.ones(3, cfg.n_embd + 1))  # raises inside the forward, after its reads gathered
            except RuntimeError:
                pass
            result["after_a_raising_forward"] = type(fc.weight).__name__
        result["signature"] = str(inspect.signature(model.forward)) == str(inspect.signature(reference.forward))
        # The same writes through the attributes of both models.
        for m in (model, reference):
            with torch.no_grad():
                m.blocks[0].attn.proj.weight.zero_()
            torch.nn.init.constant_(m.blocks[1].attn.qkv.weight, 0.02)
            m.ln_f.weight.data.mul_(3.0)
            m.ln_f.reset_parameters()  # LayerNorm's: ones and zeros, through its attributes
            if extra:
                for expert in m.experts():
                    torch.nn.init.constant_(expert.w_in, 0.05)
        written = {name: p.full_tensor() if isinstance(p, DTensor) else p for name, p in model.named_parameters()}
        result["written"] = max(relative_error(written[name], p) for name, p in reference.named_parameters())
        step = torch.compile(model, backend="piper", options=options)
        result["step_loss"] = (step(x, y).item(), reference(x, y).item(), result["eager_loss"][1])
        results[case] = result
    return results


def meta_init_worker(rank: int, world: int, steps: int = 3) -> dict:
    """FSDP2's initialisation on the meta device, under piper_fx: the model built under
    `torch.device("meta")`, prepared, materialized with `to_empty`, its values loaded with
    PyTorch's `set_model_state_dict` from the full state dict of a model built as usual, then
    trained. Per case: the losses and final parameters (full) of that run and of the same
    strategy on the model built as usual, and whether every parameter's memory is real after
    `to_empty`. At ZeRO-0 rank 1 changes its replica after loading: the first compile starts
    every replica from the first one's values, as DDP does when it wraps a model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    results = {}
    bf16 = {"mixed_precision": {"param_dtype": "bfloat16"}}
    for case, extra, options in (
            ("zero3", {}, {"zero": 3}), ("zero0", {}, {"zero": 0}), ("zero3_bf16", {}, {"zero": 3, **bf16}),
            ("experts", {"n_expert": 4}, {"mesh": {"dp": world, "ep": world}}),
            ("pp2", {}, {"mesh": {"pp": world}, "pipeline": {"microbatches": 2}}),  # plain parameters
            ("pp2_bf16", {}, {"mesh": {"pp": world}, "pipeline": {"microbatches": 2}, **bf16})):
        options = {"codegen": "eager", **options}
        cfg = GPTConfig(**SMALL, **extra)  # tied embeddings: one parameter held by two modules
        runs = {}
        for built in ("as_usual", "on_meta"):
            torch._dynamo.reset()
            torch.manual_seed(0)
            usual = GPT(cfg)
            if built == "on_meta":
                with torch.device("meta"):
                    model = GPT(cfg)
            else:
                model = usual
            mark_regions(model, experts=bool(extra))
            if built == "on_meta":
                piper_fx.prepare(model, options)
                model.to_empty(device=next(usual.parameters()).device)
                runs["real_after_to_empty"] = not any(p.is_meta for p in model.parameters())
                runs["still_tied"] = model.wte._parameters["weight"] is model.lm_head._parameters["weight"]
                set_model_state_dict(model, usual.state_dict(), options=StateDictOptions(full_state_dict=True))
                if case == "zero0" and rank == 1:
                    with torch.no_grad():
                        for p in model.parameters():
                            local(p).add_(1.0)
            else:
                piper_fx.prepare(model, options)
            opt = make_optimizer("adamw", model.parameters())
            step = torch.compile(model, backend="piper", options=options)
            losses = []
            for i in range(steps):
                x, y = global_batch(i, 2 * world, cfg)
                loss = step(x.chunk(world)[rank], y.chunk(world)[rank])
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.item())
            # The state dict: under a pipeline, the parameters this rank holds (the others' memory is freed).
            params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                      for name, p in model.state_dict().items()}
            runs[built] = (losses, params)
        (usual_losses, usual_params), (meta_losses, meta_params) = runs["as_usual"], runs["on_meta"]
        results[case] = {"real_after_to_empty": runs["real_after_to_empty"], "still_tied": runs["still_tied"],
                         "losses": (usual_losses, meta_losses),
                         "same_parameters": usual_params.keys() == meta_params.keys() and all(
                             torch.equal(usual_params[name], meta_params[name]) for name in usual_params)}
    return results
