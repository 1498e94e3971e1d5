"""A fused optimizer step over DTensor parameters runs on their local tensors, computing what
DTensor's own dispatch computes (`piper_fx.sharding.fused_optimizers`)."""
import pytest

from optimizer_workers import FUSED, STEPS, fused_step_fallback_worker, fused_step_worker
from ranks import run_ranks
from test_parity import ADAMW_PARAM_RTOL, LOSS_RTOL


@pytest.mark.parametrize("zero", [0, 3])
def test_fused_optimizers_step_local_tensors_as_dtensor_would(zero):
    # ZeRO-0: Replicate() parameters; ZeRO-3: Shard(0) rows, uneven over 2 ranks (vocab 37, block 9).
    for rank, report in enumerate(run_ranks(fused_step_worker, 2, zero)):
        assert set(report) == set(FUSED), report
        for name, run in report.items():
            assert run["calls"] == STEPS and run["local_calls"] == STEPS, (rank, name, run)
            assert run["equal"], (rank, name, run)


def test_other_fused_steps_go_through_dtensor_dispatch():
    for rank, report in enumerate(run_ranks(fused_step_fallback_worker, 2)):
        for case, run in report.items():
            assert run["calls"] == STEPS and run["local_calls"] == 0, (rank, case, run)
            assert run["equal"], (rank, case, run)


@pytest.mark.parametrize("world, zero", [(2, 0), (4, 3)])
def test_training_with_a_fused_adamw_matches_single_process(world, zero):
    from training import train_and_compare
    options = {"zero": zero, "codegen": "eager"}
    for rank, run in enumerate(run_ranks(train_and_compare, world, options, "adamw_fused", 3)):
        assert max(run["loss_errors"]) < LOSS_RTOL, (rank, run["loss_errors"])
        worst = max(run["param_errors"], key=run["param_errors"].get)
        assert run["param_errors"][worst] < ADAMW_PARAM_RTOL, (rank, worst, run["param_errors"][worst])
