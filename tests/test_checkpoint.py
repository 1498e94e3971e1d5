"""Checkpoints (piper_fx/checkpoint.py): bit-exact resume, resume under other strategies and without piper_fx.

One 2-rank run trains dp2 ZeRO-3 uninterrupted and saves after step 3 (SGD and
AdamW); a second 2-rank run resumes both at dp2 ZeRO-3, and AdamW at pp2 1F1B,
which saves again; a 4-rank run resumes AdamW at dp4 ZeRO-1; this process
resumes it in a plain GPT with torch's own DCP calls.
"""
import os

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

import piper_fx.checkpoint
from checkpoint_workers import (DROPOUT, GLOBAL_BATCH, OPTIMIZERS, PP_TORCH_API, SAVE_AFTER, STEPS, TORCH_API,
                                batch_norm_pipeline_worker, config, resume_pp_torch_api_worker, resume_worker,
                                resume_zero1_worker, train_and_save_worker)
from examples.gpt import GPT
from piper_fx.checkpoint import load_checkpoint, save_checkpoint
from ranks import run_ranks
from training import global_batch, make_optimizer, relative_error

# fp32 parity, as tests/test_pipeline.py (AdamW with eps = 1e-4: see make_optimizer("adamw_eps")).
LOSS_RTOL = PARAM_RTOL = 1e-5
# Without a process group DCP warns that it works in this process alone: what these tests mean.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("checkpoints"))


@pytest.fixture(scope="module")
def saved(root):
    return run_ranks(train_and_save_worker, 2, root)


@pytest.fixture(scope="module")
def resumed(root, saved):
    return run_ranks(resume_worker, 2, root, fresh=True)  # new processes: nothing carried over


@pytest.fixture(scope="module")
def resumed_zero1(root, saved):
    return run_ranks(resume_zero1_worker, 4, root, deadline_s=300)


def _assert_continues(run: dict, uninterrupted: dict, label: str) -> None:
    """`run` (resumed after step SAVE_AFTER) equals `uninterrupted`'s last steps within fp32 tolerance."""
    assert run["step"] == SAVE_AFTER, label
    for got, want in zip(run["losses"], uninterrupted["losses"][SAVE_AFTER:], strict=True):
        assert abs(got - want) / abs(want) < LOSS_RTOL, (label, run["losses"], uninterrupted["losses"])
    assert run["final"].keys() == uninterrupted["final"].keys(), label
    errors = {name: relative_error(torch.from_numpy(run["final"][name]), torch.from_numpy(value))
              for name, value in uninterrupted["final"].items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < PARAM_RTOL, (label, worst, errors[worst])


def test_resume_under_the_same_strategy_is_bit_exact(saved, resumed):
    for name in OPTIMIZERS:
        rng_at_save = saved[0][name]["rng_at_save"]
        for rank in range(2):
            before, after = saved[rank][name], resumed[rank][name]
            assert before["save_changed_nothing"], (name, rank)
            assert after["step"] == SAVE_AFTER
            assert after["local_losses"] == before["local_losses"][SAVE_AFTER:], (name, rank)
            assert after["final"].keys() == before["final"].keys()
            for key, value in before["final"].items():
                assert np.array_equal(after["final"][key], value), (name, rank, key)
            # Every rank resumes with rank 0's RNG state, not its own.
            assert not np.array_equal(after["rng_before_load"], rng_at_save)
            assert np.array_equal(after["rng_after_load"], rng_at_save), (name, rank)


def test_resume_with_dropout_continues_the_same_masks_bit_exact(saved, resumed):
    for rank in range(2):
        before, after = saved[rank][DROPOUT], resumed[rank][DROPOUT]
        tail = before["local_losses"][SAVE_AFTER:]
        assert after["loaded_before_compiling"] == tail and after["loaded_after_compiling"] == tail, rank
        for key, value in before["final"].items():
            assert np.array_equal(after["final"][key], value), (rank, key)
    # Dropout is on: the steps' losses are not those of a model without it (each rank's differ anyway).
    assert saved[0][DROPOUT]["local_losses"] != saved[0]["sgd"]["local_losses"]


def test_pytorchs_own_get_state_dict_dcp_and_set_state_dict_resume_bit_exact(saved, resumed):
    # The parameters are DTensors under the model's own names, so PyTorch's functions need no piper_fx.
    for rank in range(2):
        before, after = saved[rank]["adamw_eps"], resumed[rank][TORCH_API]
        assert after["local_losses"] == before["local_losses"][SAVE_AFTER:], rank
        for key, value in before["final"].items():
            assert np.array_equal(after["final"][key], value), (rank, key)


def test_pytorchs_own_state_dict_functions_resume_a_pipeline_bit_exact(root, resumed):
    """Under a pipeline a rank stores only its stages' parameters (compiling releases the
    others): its `state_dict()` and PyTorch's `get_state_dict` hold those alone, as a stage
    module of torch.distributed.pipelining does, and DCP writes the ranks' union. PyTorch's
    `get_state_dict` / `dcp.load` / `set_state_dict` resume bit-exact, into a fresh model
    before compiling and into the compiled and trained one. The optimizer keeps state only
    for the parameters the rank stores, though `set_state_dict` loaded every one."""
    resumed_pp = run_ranks(resume_pp_torch_api_worker, 2, root, fresh=True)
    metadata = dcp.FileSystemReader(os.path.join(root, PP_TORCH_API)).read_metadata().state_dict_metadata
    plain_keys = set(GPT(config()).state_dict())
    assert {key[len("model."):] for key in metadata if key.startswith("model.")} == plain_keys
    stored = []
    for rank, run in enumerate(resumed_pp):
        before = resumed[rank]["pp"]
        for when in ("", "_loaded_after_compiling"):
            assert run[f"losses{when}"] == before["losses"][1:], (rank, when)
            for key, value in before["final"].items():
                assert np.array_equal(run[f"final{when}"][key], value), (rank, when, key)
        keys = set(run["state_dict_keys"])
        assert keys < plain_keys and set(run["torch_model_keys"]) == keys, rank
        params = keys - {name for name, _ in GPT(config()).named_buffers()}
        assert set(run["optimizer_state_of"]) == set(run["torch_optim_keys"]) == params - {"lm_head.weight"}, rank
        stored.append(keys)
    assert stored[0] | stored[1] == plain_keys
    assert {"wte.weight", "lm_head.weight"} <= stored[0] & stored[1]  # tied: read by the first and last stage


def test_resume_at_pp2_1f1b(saved, resumed):
    for rank in range(2):
        _assert_continues(resumed[rank]["pp"], saved[0]["adamw_eps"], f"pp2 rank {rank}")


def test_resume_at_dp4_zero1(saved, resumed_zero1):
    for rank, run in enumerate(resumed_zero1):
        _assert_continues(run, saved[0]["adamw_eps"], f"dp4 ZeRO-1 rank {rank}")


def _train_plain(model, opt, steps: range) -> list[float]:
    losses = []
    for i in steps:
        loss = model(*global_batch(i, GLOBAL_BATCH, config()))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_resume_in_a_plain_process_without_piper_fx(root, saved):
    torch.manual_seed(7)
    model = GPT(config())
    opt = make_optimizer("adamw_eps", model.parameters())
    model_state, optim_state = model.state_dict(), get_optimizer_state_dict(model, opt)
    dcp.load({"model": model_state, "optimizer": optim_state}, checkpoint_id=os.path.join(root, "adamw_eps"))
    model.load_state_dict(model_state, strict=True)
    set_optimizer_state_dict(model, opt, optim_state)
    losses = _train_plain(model, opt, range(SAVE_AFTER, STEPS))
    final = {name: t.numpy() for name, t in model.state_dict().items()}
    _assert_continues({"step": SAVE_AFTER, "losses": losses, "final": final}, saved[0]["adamw_eps"], "plain")


def test_checkpoint_has_the_plain_models_keys_and_zero3_state_is_sharded(root, resumed):
    metadata = dcp.FileSystemReader(os.path.join(root, "adamw_eps")).read_metadata().state_dict_metadata
    torch.manual_seed(0)
    plain = GPT(config())
    opt = make_optimizer("adamw_eps", plain.parameters())
    plain_optim = get_optimizer_state_dict(plain, opt)  # torch's layout, keyed by each parameter's first name
    model_keys = {key[len("model."):]: meta for key, meta in metadata.items() if key.startswith("model.")}
    assert model_keys.keys() == plain.state_dict().keys()  # wte.weight and lm_head.weight, tied
    assert {"wte.weight", "lm_head.weight"} <= model_keys.keys()
    for key, value in plain.state_dict().items():
        assert tuple(model_keys[key].size) == tuple(value.shape), key
    optim_keys = {key for key in metadata if key.startswith("optimizer.state.")}
    assert optim_keys == {f"optimizer.state.{fqn}.{k}" for fqn, s in plain_optim["state"].items() for k in s}
    assert metadata["step"] is not None and "rng.cpu" in metadata

    for rank, run in enumerate(resumed):
        # Loaded at ZeRO-3 over dp2: Adam's two states of this rank's rows, about 1/dp of the full model's.
        dp, state, full = 2, run["adamw_eps"]["optimizer_state_bytes"], 2 * run["adamw_eps"]["full_param_bytes"]
        assert state == 2 * run["adamw_eps"]["local_param_bytes"] <= full / dp * 1.25, (rank, state, full)
    assert sum(run["adamw_eps"]["optimizer_state_bytes"] for run in resumed) == full


def test_pipeline_checkpoint_takes_each_parameter_from_the_rank_that_trains_it(root, resumed):
    stale = [set(resumed[rank]["pp"]["stale"]) for rank in range(2)]
    assert stale[0] and stale[1] and not stale[0] & stale[1], stale  # each rank holds stale copies of the other's
    torch.manual_seed(7)
    model = GPT(config())
    opt = make_optimizer("adamw_eps", model.parameters())
    assert load_checkpoint(os.path.join(root, "pp"), model, opt) == STEPS  # a plain model, no process group
    loaded = model.state_dict()
    for rank in range(2):
        full = resumed[rank]["pp"]["final"]
        assert full.keys() == loaded.keys()
        for key, value in full.items():
            assert torch.equal(loaded[key], torch.from_numpy(value)), (rank, key)


def test_single_process_round_trip_and_repair_of_pieces_read_elsewhere(tmp_path, monkeypatch):
    """Without a process group, with gradients present when loading, and with pieces that DCP
    reads into copies (as a storage reader that does not write through would): loading still
    leaves the parameters, the optimizer state and the RNG as saved, and the gradients as they were."""
    torch.manual_seed(0)
    model = GPT(config())
    opt = make_optimizer("sgd", model.parameters())
    _train_plain(model, opt, range(2))
    torch.manual_seed(42)
    save_checkpoint(tmp_path, model, opt, step=2)
    expected_random = torch.rand(3)

    planner = piper_fx.checkpoint._write_through_planner()
    resolve = planner.resolve_tensor
    monkeypatch.setattr(planner, "resolve_tensor",
                        lambda self, item: resolve(self, item).clone())
    torch.manual_seed(1)
    fresh = GPT(config())
    fresh_opt = make_optimizer("sgd", fresh.parameters())
    fresh_opt.param_groups[0]["lr"] = 0.25
    fresh(*global_batch(9, GLOBAL_BATCH, config())).backward()
    grads = [p.grad.clone() for p in fresh.parameters()]
    assert load_checkpoint(tmp_path, fresh, fresh_opt) == 2
    assert torch.equal(torch.rand(3), expected_random)
    for (key, want), got in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(got, want), key
    for p, q, grad in zip(model.parameters(), fresh.parameters(), grads):
        assert torch.equal(fresh_opt.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])
        assert torch.equal(q.grad, grad)
    assert fresh_opt.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


def test_importing_piper_fx_loads_dcp_only_when_a_checkpoint_is_saved(tmp_path):
    """`torch.distributed.checkpoint` (and the `torch.distributed.elastic` it imports) is loaded
    by the first checkpoint, not by `import piper_fx`: a process that saves none does not hold it."""
    import subprocess
    import sys

    probe = ("import sys, torch, piper_fx; loaded = lambda: 'torch.distributed.checkpoint' in sys.modules; "
             f"print(loaded()); piper_fx.save_checkpoint({str(tmp_path)!r}, torch.nn.Linear(2, 2)); print(loaded())")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "True"], out


def test_load_checkpoint_reads_a_checkpoint_torch_saved(tmp_path):
    """A plain process's own DCP checkpoint (torch's state dict layouts, no step or RNG) loads too."""
    torch.manual_seed(0)
    model = GPT(config())
    opt = make_optimizer("adamw_eps", model.parameters())
    _train_plain(model, opt, range(2))
    dcp.save({"model": model.state_dict(), "optimizer": get_optimizer_state_dict(model, opt)}, checkpoint_id=tmp_path)
    torch.manual_seed(1)
    fresh = GPT(config())
    fresh_opt = make_optimizer("adamw_eps", fresh.parameters())
    assert load_checkpoint(tmp_path, fresh, fresh_opt) is None
    for (key, want), got in zip(model.state_dict().items(), fresh.state_dict().values()):
        assert torch.equal(got, want), key
    for p, q in zip(model.parameters(), fresh.parameters()):
        for key, value in opt.state[p].items():
            assert torch.equal(fresh_opt.state[q][key], value), key


def test_a_pipeline_saves_and_resumes_the_buffers_its_stages_update(tmp_path):
    """A batch norm's running statistics under a pipeline: the rank whose stage updates them
    holds them, and the other lets go of them as of its other stages' parameters, so each
    rank's `state_dict()` has them where its stages do and DCP writes the one current copy. A
    model of other initial values loaded from that checkpoint before compiling continues
    bit-exact: losses, parameters and the statistics (`full_state_dict`, on both ranks)."""
    from models import ConvNet
    runs = run_ranks(batch_norm_pipeline_worker, 2, str(tmp_path))
    plain_keys = set(ConvNet().state_dict())
    statistics = {"norm1.running_mean", "norm1.running_var", "norm1.num_batches_tracked"}
    held = [set(run["state_dict_keys"]) for run in runs]
    assert held[0] | held[1] == plain_keys and not statistics <= held[0] & held[1], held
    for rank, run in enumerate(runs):
        assert run["losses_resumed"] == run["losses"], rank
        for key, value in run["final"].items():
            assert np.array_equal(run["final_resumed"][key], value), (rank, key)
        assert np.array_equal(run["final"]["norm1.running_mean"], runs[0]["final"]["norm1.running_mean"]), rank
