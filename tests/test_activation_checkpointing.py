"""Activation checkpointing (option `activation_checkpointing`, pass `checkpoint_activations`):
recomputation changes no number, and keeps only each unit's input across the forward and backward."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import piper_fx
from examples.gpt import GPT, GPTConfig
from memory_workers import light_ops_pipeline_worker, light_ops_zero_worker
from ranks import run_ranks
from training import SMALL, global_batch, pipeline_worker

MODES = ("none", "full", "selective")
B, T, D, H = 4, SMALL["block_size"], SMALL["n_embd"], SMALL["n_head"]  # the batch below, and the model's sizes


def _train_one_process(n_layer: int, mode: str, steps: int = 3) -> dict:
    cfg = GPTConfig(**{**SMALL, "n_layer": n_layer})
    torch.manual_seed(0)
    model = GPT(cfg)
    options = {"codegen": "eager", "activation_checkpointing": {"mode": mode}}
    step = torch.compile(model, backend="piper", options=options)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for i in range(steps):
        loss = step(*global_batch(i, B, cfg))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    torch._dynamo.reset()
    return {"losses": losses, "params": [p.detach().clone() for p in model.parameters()],
            "activation_bytes": piper_fx.last_step_stats()["peak_activation_bytes"]}


@pytest.fixture(scope="module")
def one_process():
    return {(n_layer, mode): _train_one_process(n_layer, mode) for n_layer in (2, 3) for mode in MODES}


def test_recomputation_changes_no_number(one_process):
    for (n_layer, mode), run in one_process.items():
        plain = one_process[(n_layer, "none")]
        assert run["losses"] == plain["losses"], (n_layer, mode)
        assert all(torch.equal(a, b) for a, b in zip(run["params"], plain["params"])), (n_layer, mode)


def test_full_keeps_one_input_per_layer_and_selective_also_the_matmul_and_attention_outputs(one_process):
    """Bytes kept from forward to backward per layer, as the difference between 3 and 2 layers:
    with full checkpointing exactly the layer's input (B x T x D floats); with selective, at most
    the input and the outputs of the layer's matmuls (qkv 3D, attention projection D, MLP 4D and
    D) and of its attention (D, and its logsumexp, B x H x T floats); without, no more than
    selective's, and here as much: in every mode the values light ops make from values the
    backward reads anyway (the layer norms' and the GELU's outputs) are recomputed."""
    per_layer = {mode: one_process[(3, mode)]["activation_bytes"] - one_process[(2, mode)]["activation_bytes"]
                 for mode in MODES}
    floats = 4
    assert per_layer["full"] == B * T * D * floats
    assert per_layer["selective"] <= (1 + 3 + 1 + 1 + 4 + 1) * B * T * D * floats + B * H * T * floats
    assert per_layer["full"] < per_layer["selective"] == per_layer["none"]
    # Outside the layers (embeddings, head) nothing changes: the rest is the same for every mode.
    outside = {mode: one_process[(2, mode)]["activation_bytes"] - 2 * per_layer[mode] for mode in MODES}
    assert outside["full"] == outside["selective"] == outside["none"]


class _CheckpointedMLP(torch.nn.Module):
    """An MLP (with dropout) whose middle runs under the model's own `torch.utils.checkpoint`."""

    def __init__(self, checkpointed: bool, p: float):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)
        self.drop, self.checkpointed = torch.nn.Dropout(p), checkpointed

    def _middle(self, x):
        return self.down(self.drop(torch.tanh(self.up(x))).sin())

    def forward(self, x, y):
        h = checkpoint(self._middle, x, use_reentrant=False) if self.checkpointed else self._middle(x)
        return ((h - y) ** 2).mean()


def _checkpointed_mlp_step(checkpointed: bool, p: float) -> dict:
    torch.manual_seed(0)  # also the dropout seed, drawn when the step is compiled
    model = _CheckpointedMLP(checkpointed, p)
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    loss = torch.compile(model, backend="piper", options={"codegen": "eager"})(x, y)
    loss.backward()
    eager(x, y).backward()
    torch._dynamo.reset()
    return {"loss": loss.item(), "grads": [p.grad for p in model.parameters()],
            "eager_grads": [p.grad for p in eager.parameters()],
            "kept": piper_fx.last_step_stats()["peak_activation_bytes"]}


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_the_models_own_torch_utils_checkpoint_is_recomputed(p):
    """Its region keeps only its input (8 x 16 floats), and nothing else changes: a recomputed
    dropout draws the same mask (its Philox offsets are the original's). Without dropout the
    gradients are also eager PyTorch's (with it, eager draws other masks)."""
    plain, checkpointed = _checkpointed_mlp_step(False, p), _checkpointed_mlp_step(True, p)
    assert checkpointed["loss"] == plain["loss"]
    assert all(torch.equal(a, b) for a, b in zip(checkpointed["grads"], plain["grads"]))
    if p == 0:
        for ours, eager in zip(checkpointed["grads"], checkpointed["eager_grads"]):
            torch.testing.assert_close(ours, eager, rtol=1e-6, atol=1e-7)
    assert checkpointed["kept"] == 8 * 16 * 4 < plain["kept"]


# 3 layers over 2 stages balanced by cost: the stage boundary cuts a layer, so recomputation
# must keep what crosses the cut (each stage recomputes its own part of the layer).
CUT_LAYER = {"pp_regions": False, "n_layer": 3, "per_rank_batch": 8, "model_kwargs": {"block_size": 32, "n_embd": 64}}


@pytest.mark.parametrize("options, model", [
    ({"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}, {}),
    ({"mesh": {"pp": 2}, "pipeline": {"schedule": "zb1p", "microbatches": 2}}, {}),
    ({"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 4}}, CUT_LAYER),
    ({"mesh": {"dp": 2}, "zero": 3}, {}),
], ids=["pp2-1f1b", "pp2-zb1p", "pp2-1f1b-stages-cut-a-layer", "dp2-zero3"])
def test_recomputation_under_pipelines_and_zero3_changes_no_number(options, model):
    """Recomputed in each microbatch's B task (1F1B) or its I and W tasks (zero-bubble), or with
    ZeRO-3's parameters gathered again for the backward: equal to the run without, bit for bit,
    and to single-process training."""
    pipelined = "pipeline" in options
    configs = [{"options": {**options, "activation_checkpointing": {"mode": mode}}, "pp_regions": pipelined,
                "per_rank_batch": 4, "tied": False, **model} for mode in MODES]
    for runs in run_ranks(pipeline_worker, 2, configs, deadline_s=400):
        plain = runs[0]
        for run in runs:
            assert max(run["loss_errors"]) < 1e-5 and max(run["param_errors"].values()) < 1e-5
            assert run["loss_errors"] == plain["loss_errors"]
            assert run["trained_values"].keys() == plain["trained_values"].keys()
            for name, value in run["trained_values"].items():
                assert np.array_equal(value, plain["trained_values"][name]), name


def _peak_step_bytes(model: torch.nn.Module, step, batch) -> int:
    from piper_fx.runtime.memory import peak_allocated_bytes
    for _ in range(2):
        step(*batch).backward()
        model.zero_grad()
    return peak_allocated_bytes(lambda: step(*batch).backward())[1]


def test_full_checkpointing_holds_what_pytorchs_checkpoint_holds():
    """The most a forward and backward allocate (the CPU allocator's peak), GPT 4x256 on 8 x 128
    tokens: piper_fx's full checkpointing against `checkpoint_wrapper` around every block in eager
    PyTorch. Each layer is recomputed when its own backward needs it, not every layer at the
    backward's start (where AOTAutograd puts the detaches of saved values: 41.1 MB against 31.9)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    cfg = GPTConfig(vocab_size=65, block_size=128, n_layer=4, n_head=4, n_embd=256, tied_embeddings=False)
    batch = global_batch(0, 8, cfg)
    torch.manual_seed(0)
    ours = GPT(cfg)
    step = torch.compile(ours, backend="piper", options={"codegen": "eager", "activation_checkpointing": {"mode": "full"}})
    piper_bytes = _peak_step_bytes(ours, step, batch)
    torch._dynamo.reset()
    torch.manual_seed(0)
    theirs = GPT(cfg)
    for index, block in enumerate(theirs.blocks):
        theirs.blocks[index] = checkpoint_wrapper(block)
    torch_bytes = _peak_step_bytes(theirs, theirs, batch)
    assert piper_bytes <= 1.02 * torch_bytes, (piper_bytes, torch_bytes)


class _LayerNormGeluMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down = torch.nn.LayerNorm(16), torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x, y):
        return ((self.down(torch.nn.functional.gelu(self.up(self.norm(x)))) - y) ** 2).mean()


def test_what_light_ops_make_from_values_the_backward_reads_anyway_is_recomputed():
    """Without checkpointing, the backward needs the layer norm's output (for `up`'s weight
    gradient) and the GELU's (for `down`'s), but makes them from values it reads anyway: the
    model's input, from which the layer norm, its statistics included, is made again, and
    `up`'s output, which the GELU's backward reads. So neither is kept: what crosses is `up`'s
    output (8 x 64 floats) and the loss's difference (8 x 16), where the layer norm's output
    and statistics and the GELU's output crossed before. Gradients are eager PyTorch's."""
    torch.manual_seed(0)
    model = _LayerNormGeluMLP()
    eager = copy.deepcopy(model)
    x, y = torch.randn(8, 16), torch.randn(8, 16)
    loss = torch.compile(model, backend="piper", options={"codegen": "eager"})(x, y)
    loss.backward()
    kept = piper_fx.last_step_stats()["peak_activation_bytes"]
    torch._dynamo.reset()
    eager_loss = eager(x, y)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
    for ours, theirs in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(ours.grad, theirs.grad, rtol=1e-6, atol=1e-7)
    assert kept == (8 * 64 + 8 * 16) * 4, kept


def test_under_a_pipeline_too_what_light_ops_make_from_values_the_backward_reads_anyway_is_recomputed():
    """GPipe's first stage holds every microbatch's kept values once its forwards are done:
    the up projection's output (2 x 64 floats a microbatch) and the stage's output, sent to
    the second stage (2 x 16) and held until the second stage's answer arrives; not the
    layer norm's output and statistics nor the GELU's, which its backward makes again.
    Gradients are eager PyTorch's."""
    microbatches = 4
    first, second = run_ranks(light_ops_pipeline_worker, 2, microbatches)
    assert first["held"] == microbatches * 2 * (64 + 16) * 4, first
    assert max(first["grad_error"], second["grad_error"]) < 1e-6, (first, second)


def test_at_every_zero_level_what_light_ops_make_from_gathered_parameters_is_recomputed_too():
    """A gathered parameter that the backward can read without another collective counts as
    a parameter does: at ZeRO-1/2, which gather each parameter once per step and keep it for
    the backward, and at ZeRO-3 within a unit whose parameters the backward gathers again (the
    up projection's weight, which the shift joins). So the backward makes the layer norm's
    shifted output again from the shift, and a small table's lookup from the table, as at
    ZeRO-0, where both are parameters, and the same bytes cross from the forward to the
    backward at every level (before, the shifted output and what the gathered parameters
    made crossed: 11776 bytes at ZeRO-1/2 and 3584 at ZeRO-3, against 3072 without a
    table). A table larger than what its lookup lets the backward make again (1000 x 16
    floats against 8 x 16) is not held for that, nor at ZeRO-3 a table whose gather the
    backward would make for it alone: there the lookup's output crosses too. Gradients are
    eager PyTorch's on the global batch."""
    lookup = 8 * 16 * 4
    for vocab, extra in ((None, {1: 0, 2: 0, 3: 0}), (4, {1: 0, 2: 0, 3: lookup}),
                         (1000, {1: lookup, 2: lookup, 3: lookup})):
        plain = run_ranks(light_ops_zero_worker, 2, 0, vocab)[0]["held"]
        for zero, more in extra.items():
            ranks = run_ranks(light_ops_zero_worker, 2, zero, vocab)
            assert [rank["held"] for rank in ranks] == [plain + more] * 2, (vocab, zero, plain, ranks)
            assert max(rank["grad_error"] for rank in ranks) < 1e-6, (vocab, zero, ranks)
