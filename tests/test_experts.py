"""Expert parallelism equals single-process training, alone and composed with DP, ZeRO and pipelines.

The MoE GPT (4 experts, top-2, sequence-wise balance loss) routes tokens
unevenly; every rank computes its own block of experts for the tokens of its
ep group, which reach it and return through all-to-alls.
"""
import pytest

from ranks import run_ranks
from training import expert_errors_worker, pipeline_worker

RTOL = 1e-5
EXPERTS = 4


def _ep(dp, ep, zero=0, **more):
    return {"mesh": {"dp": dp, "ep": ep, **more.pop("mesh", {})}, "zero": zero, **more}


def _check(results, configs, dp, ep):
    for rank, runs in enumerate(results):
        for config, run in zip(configs, runs):
            assert max(run["loss_errors"]) < RTOL, (rank, config, run["loss_errors"])
            worst = max(run["param_errors"], key=run["param_errors"].get)
            assert run["param_errors"][worst] < RTOL, (rank, config, worst, run["param_errors"][worst])
    # An expert block is held by the dp/ep ranks of the same ep index (and pipeline rank), bit-identical;
    # the other ranks of its ep group hold other experts.
    for index, config in enumerate(configs):
        for rank, runs in enumerate(results):
            mine = {n: v for n, v in runs[index]["trained_values"].items() if ".experts." in n}
            assert mine and all(v.shape[0] == EXPERTS // ep for v in mine.values()), (config, rank)
            for peer, peer_runs in enumerate(results):
                if peer == rank or peer // dp != rank // dp:
                    continue
                theirs = peer_runs[index]["trained_values"]
                same_block = peer % dp % ep == rank % dp % ep
                for name, value in mine.items():
                    assert ((value == theirs[name]).all()) == same_block, (config, name, rank, peer)


def _configs(*options, **common):
    return [{"options": {"codegen": "eager", **o}, "experts": EXPERTS, "per_rank_batch": 2, "steps": 5,
             **common} for o in options]


def test_expert_parallel_over_two_ranks():
    configs = _configs(_ep(2, 2), _ep(2, 2, zero=3))
    results = run_ranks(pipeline_worker, 2, configs, deadline_s=400)
    _check(results, configs, dp=2, ep=2)
    # Optimizer state of the experts is split over the ep group.
    full = results[0][0]["reference_state_bytes"]
    assert results[0][0]["optimizer_state_bytes"] < full


def test_expert_parallel_replicated_over_data_parallel_groups():
    configs = _configs(_ep(4, 2, zero=0), _ep(4, 2, zero=1))
    _check(run_ranks(pipeline_worker, 4, configs, deadline_s=500), configs, dp=4, ep=2)


def test_expert_parallel_in_pipelines():
    configs = _configs(
        _ep(2, 2, mesh={"pp": 2}, pipeline={"schedule": "1f1b", "microbatches": 2}),
        _ep(2, 2, mesh={"pp": 2}, pipeline={"schedule": "dualpipev", "microbatches": 4}),
        pp_regions=True, n_layer=4, per_rank_batch=4)
    _check(run_ranks(pipeline_worker, 4, configs, deadline_s=500), configs, dp=2, ep=2)


def test_bad_expert_parallel_setups_are_config_errors():
    errors = run_ranks(expert_errors_worker, 2)[0]
    assert errors["indivisible"][0] == "mesh.ep" and "number of experts" in errors["indivisible"][1], errors
    assert errors["unannotated"][0] == "mesh.ep" and "annotate('EP')" in errors["unannotated"][1], errors
    assert errors["unmarked"][0] == "mesh.ep" and "mark_experts" in errors["unmarked"][1], errors
