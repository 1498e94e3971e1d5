"""Per-rank runs for the memory breakdown test (run inside `run_ranks`)."""
from __future__ import annotations

import copy

import torch

import piper_fx
from examples.gpt import GPT, GPTConfig
from piper_fx.runtime.memory import peak_allocated_bytes
from piper_fx.sharding.holdings import is_stored
from training import global_batch, local


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of these tensors' local pieces (a released one holds none:
    on a CPU its storage reads as zeros from pages it does not hold)."""
    storages = {local(t).untyped_storage()._cdata: local(t).untyped_storage().nbytes() for t in tensors
                if is_stored(t)}
    return sum(storages.values())

# Big enough that activations, not the runtime's small tensors, make up the step's memory.
CONFIG = dict(vocab_size=37, block_size=32, n_layer=3, n_head=2, n_embd=64)
BATCH = 8  # the global batch, in sequences


def breakdown_worker(rank: int, world: int, cases: list[dict], steps: int = 3) -> list[dict]:
    """Per strategy: the last step's memory breakdown, the peak the CPU allocator saw
    during that step from the step's own thread (`peak_allocated_bytes`, without gloo's
    worker threads), and what the rank holds counted apart from piper_fx: its
    parameters' bytes and its optimizer's state bytes."""
    results = []
    for options in cases:
        torch.manual_seed(0)
        cfg = GPTConfig(**CONFIG)
        model = GPT(cfg)
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        replicas = 1 if "pipeline" in options else world
        for i in range(steps):
            x, y = global_batch(i, BATCH, cfg)
            x, y = x.chunk(replicas)[rank % replicas], y.chunk(replicas)[rank % replicas]
            # Gradients set to None (zero_grad's default): the step frees nothing it did not make.
            _, measured = peak_allocated_bytes(lambda: step(x, y).backward(), other_threads=False)
            memory = piper_fx.last_step_stats()["memory"]
            opt.step()
            opt.zero_grad()
        state = [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
        results.append({"memory": memory, "measured": measured, "model_bytes": model_bytes,
                        "param_bytes": storage_bytes([*model.parameters(), *model.buffers()]),
                        "optimizer_state_bytes": storage_bytes(state)})
        torch._dynamo.reset()
    return results


class LightOpsPipeline(torch.nn.Module):
    """Two stages, each a layer norm, a linear layer up, a GELU and a linear layer down (a
    pipeline stage each: `piper_fx.annotate("PP")`), then a squared error."""

    def __init__(self, width: int = 16, hidden: int = 64):
        super().__init__()
        self.layers = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.LayerNorm(width), torch.nn.Linear(width, hidden), torch.nn.GELU(),
                                torch.nn.Linear(hidden, width))
            for _ in range(2))

    def forward(self, x, y):
        for layer in self.layers:
            with piper_fx.annotate("PP"):
                x = layer(x)
        return ((x - y) ** 2).mean()


def light_ops_pipeline_worker(rank: int, world: int, microbatches: int) -> dict:
    """GPipe over `LightOpsPipeline`'s two stages, one step of 2 rows per microbatch: the
    most bytes of per-microbatch values the rank held at once, and its parameters'
    gradients' largest difference from eager PyTorch's on the same batch."""
    options = {"mesh": {"pp": world}, "codegen": "eager",
               "pipeline": {"schedule": "gpipe", "microbatches": microbatches}}
    torch.manual_seed(0)
    model = LightOpsPipeline()
    eager = copy.deepcopy(model)
    x, y = torch.randn(2 * microbatches, 16), torch.randn(2 * microbatches, 16)
    piper_fx.prepare(model, options)
    torch.compile(model, backend="piper", options=options)(x, y).backward()
    held = piper_fx.last_step_stats()["peak_activation_bytes"]
    eager(x, y).backward()
    errors = [(p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), eager.parameters())
              if p.grad is not None]
    return {"held": held, "grad_error": max(errors)}


class _NormedUp(torch.nn.Module):
    """A layer norm whose scale and shift are this module's parameters, then a linear layer up."""

    def __init__(self):
        super().__init__()
        self.scale, self.shift = torch.nn.Parameter(torch.rand(16) + 0.5), torch.nn.Parameter(torch.randn(16))
        self.up = torch.nn.Linear(16, 64)

    def forward(self, x):
        return self.up(torch.nn.functional.layer_norm(x, (16,)) * self.scale + self.shift)


class EmbeddedLightOps(torch.nn.Module):
    """A lookup in a table of `vocab` rows of 16 (none: the input is the rows), a `_NormedUp`
    (in a module list: a unit of ZeRO-3, whose backward gathers the up projection's weight
    again, and reads neither the shift nor, the input needing no gradient, the scale), a
    GELU and a linear layer down, then a squared error."""

    def __init__(self, vocab: int | None):
        super().__init__()
        self.table = torch.nn.Embedding(vocab, 16) if vocab else None
        self.blocks = torch.nn.ModuleList([_NormedUp()])
        self.down = torch.nn.Linear(64, 16)

    def forward(self, x, y):
        x = self.table(x) if self.table is not None else x
        return ((self.down(torch.nn.functional.gelu(self.blocks[0](x))) - y) ** 2).mean()


def light_ops_zero_worker(rank: int, world: int, zero: int, vocab: int | None) -> dict:
    """One step of `EmbeddedLightOps` at `zero` over every rank, 8 rows a rank: the most
    bytes of per-microbatch values the rank held at once, and its parameters' gradients'
    largest difference from eager PyTorch's on the global batch."""
    options = {"zero": zero, "codegen": "eager"}
    torch.manual_seed(0)
    model = EmbeddedLightOps(vocab)
    eager = copy.deepcopy(model)
    x = torch.randint(0, vocab, (8 * world,)) if vocab else torch.randn(8 * world, 16)
    y = torch.randn(8 * world, 16)
    piper_fx.prepare(model, options)
    rows = slice(8 * rank, 8 * (rank + 1))
    torch.compile(model, backend="piper", options=options)(x[rows], y[rows]).backward()
    held = piper_fx.last_step_stats()["peak_activation_bytes"]
    eager(x, y).backward()
    errors = [(p.grad.full_tensor() - q.grad).abs().max().item()
              for p, q in zip(model.parameters(), eager.parameters())]
    return {"held": held, "grad_error": max(errors)}
