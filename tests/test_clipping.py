"""`piper_fx.clip_grad_norm_` clips by the whole model's gradient norm, however the model is split:
equal to single-process `torch.nn.utils.clip_grad_norm_` on the unsplit model."""
import math

import pytest
import torch

from clipping_workers import clipping_worker
from piper_fx.clipping import clip_grad_norm_
from ranks import run_ranks

RTOL = 1e-5
# Below the reference's gradient norms at every step (2-norm 0.65 .. 1.3, inf-norm 0.14 .. 0.24; the
# test asserts it): clipping is active.
MAX_NORM, MAX_NORM_INF = 0.4, 0.05
PIPELINE = {"mesh": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
CONFIGS = [
    # Shards over dp of each pipeline stage's parameters (the tied embedding read by both stages);
    # the inf-norm, a max over ranks.
    {"options": {**PIPELINE, "zero": 2}, "max_norm": MAX_NORM_INF, "norm_type": math.inf},
    {"options": {**PIPELINE, "zero": 3}, "max_norm": MAX_NORM},
    # Replicas (zero 0 over dp 4) of the dense parameters, blocks of experts over ep 2, each
    # block replicated over the 2 ep groups.
    {"options": {"mesh": {"dp": 4, "ep": 2}, "zero": 0}, "experts": 4, "max_norm": MAX_NORM},
]


@pytest.fixture(scope="module")
def four_ranks():
    # One set of four rank processes for every case: starting them costs more than a case.
    return run_ranks(clipping_worker, 4, CONFIGS, deadline_s=300)


def test_clipped_training_equals_torch_clipping_of_the_unsplit_model(four_ranks):
    for index, config in enumerate(CONFIGS):
        runs = [ranks["trainings"][index] for ranks in four_ranks]
        reference = runs[0]["reference_norms"]
        # Clipping was active at every step: the reference's norm exceeds max_norm.
        assert all(n > config["max_norm"] for n in reference), (config, reference)
        for rank, run in enumerate(runs):
            assert run["reference_norms"] == reference  # every rank's reference is the same model
            # Every rank returns the very same norm, the unsplit model's.
            assert run["norms"] == runs[0]["norms"], (config, rank, run["norms"], runs[0]["norms"])
            for norm, expected in zip(run["norms"], reference):
                assert abs(norm - expected) / expected < RTOL, (config, rank, run["norms"], reference)
            # Each gradient piece the rank holds, counted in the norm or not, was scaled like the reference's.
            assert run["pieces"] > 0 and max(run["grad_errors"]) < RTOL, (config, rank, run["grad_errors"])
            assert max(run["loss_errors"]) < RTOL, (config, rank, run["loss_errors"])
            worst = max(run["param_errors"], key=run["param_errors"].get)
            assert run["param_errors"][worst] < RTOL, (config, rank, worst, run["param_errors"][worst])


def test_one_ranks_own_gradients_give_another_norm(four_ranks):
    # What torch.nn.utils.clip_grad_norm_ computes from a rank's own gradients (shards, one pipeline
    # stage's parameters, a block of experts) is not the model's norm; piper_fx's is.
    for index, config in enumerate(CONFIGS):
        owns = []
        for rank, ranks in enumerate(four_ranks):
            run = ranks["trainings"][index]
            for own, norm, expected in zip(run["rank_local_norms"], run["norms"], run["reference_norms"]):
                assert abs(norm - expected) / expected < RTOL, (config, rank, norm, expected)
                assert own <= expected * (1 + RTOL), (config, rank, own, expected)  # a part of the whole
                owns.append(abs(own - expected) / expected)
        if config.get("norm_type", 2.0) == math.inf:
            assert max(owns) > 100 * RTOL, (config, owns)  # the largest element is on some ranks, not all
        else:
            assert min(owns) > 100 * RTOL, (config, owns)  # every rank misses some of the sum


def test_uneven_rows_torch_clipping_and_a_nonfinite_norm_raising_on_every_rank(four_ranks):
    linear = [ranks["linear"] for ranks in four_ranks]
    for rank, run in enumerate(linear):
        # Gradients are DTensors of the parameters' shapes; 3 rows over 4 ranks leave rank 3 none of the weight's.
        assert run["grad_shapes"] == [(3, 5), (3,)], (rank, run)
        assert run["local_rows"] == ([1, 1] if rank < 3 else [0, 0]), (rank, run)
        for norm_type in ("2.0", "inf"):
            assert run[f"norm_error_{norm_type}"] < RTOL, (rank, run)
            # Without a pipeline, torch's own clip_grad_norm_ sees the whole gradient through DTensor too
            # (ZeRO-3's Shard(0) rows, ZeRO-0's Replicate() replicas).
            for zero in (0, 3):
                assert run[f"torch_norm_error_{norm_type}_zero{zero}"] < RTOL, (rank, zero, run)
                assert run[f"torch_grad_error_{norm_type}_zero{zero}"] < RTOL, (rank, zero, run)
            assert run[f"raised_{norm_type}"] == _torch_nonfinite_message(float(norm_type)), (rank, run)
        assert math.isnan(run["returned_inf"]), (rank, run)


def _torch_nonfinite_message(norm_type: float) -> str:
    grad = torch.tensor([math.nan])
    with pytest.raises(RuntimeError) as raised:
        torch.nn.utils.get_total_norm([grad], norm_type, error_if_nonfinite=True)
    return str(raised.value)


def _model_with_grads(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(seed))
    model(x).square().sum().backward()
    model[0].bias.grad = None  # a parameter without a gradient is skipped, as by torch
    return model


@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
@pytest.mark.parametrize("max_norm", [0.1, 1e3])
def test_without_a_process_group_it_is_torchs_clip_grad_norm(norm_type, max_norm):
    ours, theirs = _model_with_grads(), _model_with_grads()
    norm = clip_grad_norm_(ours, max_norm, norm_type)  # a module stands for its parameters
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type)
    assert torch.equal(norm, expected) and norm.device == expected.device
    for p, q in zip(ours.parameters(), theirs.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    # A single tensor, and a generator, as torch takes them.
    weight = ours[2].weight
    assert torch.equal(clip_grad_norm_(weight, max_norm, norm_type),
                       torch.nn.utils.clip_grad_norm_(theirs[2].weight, max_norm, norm_type))
    assert torch.equal(clip_grad_norm_((p for p in ours.parameters()), max_norm, norm_type),
                       torch.nn.utils.clip_grad_norm_((p for p in theirs.parameters()), max_norm, norm_type))


def test_without_a_process_group_nonfinite_norms_raise_like_torch():
    for bad in (math.nan, math.inf):
        for norm_type in (2.0, math.inf):
            ours, theirs = _model_with_grads(), _model_with_grads()
            ours[2].weight.grad[0, 0] = theirs[2].weight.grad[0, 0] = bad
            with pytest.raises(RuntimeError) as expected:
                torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0, norm_type, error_if_nonfinite=True)
            with pytest.raises(RuntimeError) as raised:
                clip_grad_norm_(ours.parameters(), 1.0, norm_type, error_if_nonfinite=True)
            assert str(raised.value) == str(expected.value)
            # Without error_if_nonfinite both scale by the non-finite norm alike.
            norm = clip_grad_norm_(ours.parameters(), 1.0, norm_type)
            expected_norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0, norm_type)
            assert torch.equal(norm, expected_norm) or (norm.isnan() and expected_norm.isnan())
            for p, q in zip(ours.parameters(), theirs.parameters()):
                assert (p.grad is None and q.grad is None) or torch.equal(p.grad.nan_to_num(), q.grad.nan_to_num())


def test_without_gradients_the_norm_is_zero_and_nothing_is_scaled():
    model = torch.nn.Linear(3, 2)
    norm = clip_grad_norm_(model, 1.0)
    assert norm.item() == 0.0 and norm.device == model.weight.device
    with pytest.warns(UserWarning, match="empty generator"):
        clip_grad_norm_((p for p in []), 1.0)
