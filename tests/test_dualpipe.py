"""DualPipeV and bidirectional DualPipe, and parameters shared by pipeline ranks, equal single-process training.

Under DualPipe every stage exists twice (one copy per direction), and a
parameter tied across the first and last stage is read on two pipeline ranks:
both ranks must end every step with the same, summed gradient, so their
copies stay equal.
"""

import pytest

from ranks import processes, run_ranks
from training import pipeline_worker

RTOL = 1e-5


def _pp(pp, schedule, microbatches, **mesh):
    return {"mesh": {"pp": pp, **mesh}, "pipeline": {"schedule": schedule, "microbatches": microbatches}}


def _check(results, configs, dp=1):
    for rank, runs in enumerate(results):
        for config, run in zip(configs, runs):
            assert max(run["loss_errors"]) < RTOL, (rank, config, run["loss_errors"])
            worst = max(run["param_errors"], key=run["param_errors"].get)
            assert run["param_errors"][worst] < RTOL, (rank, config, worst, run["param_errors"][worst])
    # Pipeline ranks of one replica that hold the same parameter hold the same values.
    for index, config in enumerate(configs):
        for rank, runs in enumerate(results):
            peer_ranks = [r for r in range(len(results)) if r % dp == rank % dp and r != rank]
            for name, value in runs[index]["trained_values"].items():
                for peer in peer_ranks:
                    other = results[peer][index]["trained_values"].get(name)
                    if other is not None:
                        assert (value == other).all(), (config, name, rank, peer)


def _holders(results, config_index=0):
    """How many pipeline ranks trained each parameter."""
    counts = {}
    for runs in results:
        for name in runs[config_index]["params_with_state"]:
            counts[name] = counts.get(name, 0) + 1
    return counts


def test_dualpipe_and_dualpipev_on_two_ranks_and_tied_embeddings():
    configs = [
        {"options": _pp(2, "dualpipev", 4), "pp_regions": True, "n_layer": 4, "per_rank_batch": 4, "steps": 5},
        {"options": _pp(2, "dualpipe", 4), "pp_regions": True, "per_rank_batch": 4, "steps": 5},
        {"options": _pp(2, "dualpipe", 6), "pp_regions": True, "per_rank_batch": 6, "steps": 5, "tied": True},
        # Embeddings tied across the first and the last stage, on two pipeline ranks.
        {"options": _pp(2, "1f1b", 2), "per_rank_batch": 4, "steps": 5, "tied": True},
        # A value crossing every stage boundary: both halves of a fused F&B pair read one (a `tanh`).
        {"options": _pp(2, "dualpipev", 4), "model": "cross", "per_rank_batch": 4},
        {"options": _pp(2, "dualpipe", 4), "model": "cross", "per_rank_batch": 4},
    ]
    results = run_ranks(pipeline_worker, 2, configs, deadline_s=500)
    _check(results, configs)
    assert set(_holders(results, 0).values()) == {1}  # DualPipeV: one copy of every stage
    assert set(_holders(results, 1).values()) == {2}  # DualPipe: every parameter on both ranks
    tied = [name for name, count in _holders(results, 3).items() if count == 2]
    assert len(tied) == 1 and tied[0].endswith("wte.weight"), _holders(results, 3)  # only the tied embedding


def test_dualpipe_and_dualpipev_on_four_ranks():
    configs = [
        {"options": _pp(4, "dualpipev", 8), "pp_regions": True, "n_layer": 8, "per_rank_batch": 8, "steps": 5},
        {"options": _pp(4, "dualpipe", 8), "pp_regions": True, "n_layer": 4, "per_rank_batch": 8, "steps": 5},
    ]
    _check(run_ranks(pipeline_worker, 4, configs, deadline_s=500), configs)


def test_dualpipev_and_dualpipe_with_data_parallel_zero():
    configs = [{"options": {**_pp(2, "dualpipev", 4, dp=2), "zero": 1}, "pp_regions": True, "n_layer": 4,
                "per_rank_batch": 4, "steps": 5},
               # Both copies gather ZeRO-3 shards and reduce-scatter over dp, then sum over the copies.
               {"options": {**_pp(2, "dualpipe", 4, dp=2), "zero": 3}, "pp_regions": True,
                "per_rank_batch": 4, "steps": 5, "tied": True},
               {"options": {**_pp(2, "dualpipev", 4, dp=2), "zero": 1}, "model": "cross", "per_rank_batch": 4}]
    _check(run_ranks(pipeline_worker, 4, configs, deadline_s=500), configs, dp=2)


def _dualpipe_option_errors(world: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import piper_fx

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    errors = {}
    for name, pipeline in {"odd_ranks": {"schedule": "dualpipe", "microbatches": 2 * world},
                           "few_microbatches": {"schedule": "dualpipe", "microbatches": 2 * world - 2},
                           "odd_microbatches": {"schedule": "dualpipe", "microbatches": 2 * world + 1},
                           "few_microbatches_v": {"schedule": "dualpipev", "microbatches": 2 * world - 1},
                           "stages_v": {"schedule": "dualpipev", "microbatches": 2 * world, "stages_per_rank": 1}
                           }.items():
        try:
            piper_fx.parse_options({"mesh": {"pp": world}, "pipeline": pipeline})
        except piper_fx.PiperConfigError as e:
            errors[name] = str(e)
    dist.destroy_process_group()
    return errors


def test_bad_dualpipe_options_are_config_errors():
    with processes().Pool(1) as pool:  # the fake process group must not leak
        three, four = pool.map(_dualpipe_option_errors, (3, 4))
    assert three["odd_ranks"].startswith("options['mesh.pp'] = 3 is invalid: an even number")
    assert "options['pipeline.microbatches'] = 6 is invalid: an int >= 8 for dualpipe" in four["few_microbatches"]
    assert "options['pipeline.microbatches'] = 9 is invalid: an even number" in four["odd_microbatches"]
    assert "an int >= 8 for dualpipev" in four["few_microbatches_v"]
    assert "2 for dualpipev (two stages per rank, in a V)" in four["stages_v"]
    assert "odd_ranks" not in four


def _plan(schedule: str) -> dict:
    from piper_fx import schedules
    from piper_fx.ir import Recv, Run, Send
    from training import plan_all_ranks

    options = {"mesh": {"pp": 4}, "codegen": "eager", "pipeline": {"schedule": schedule, "microbatches": 8}}
    programs, _ = plan_all_ranks(options, world=4, n_layer=8 if schedule == "dualpipev" else 4, batch_rows=8)
    built = schedules.build(schedule, 4, 8, 2 if schedule == "dualpipev" else 1)
    sends = {(r, i.peer, i.tag) for r, p in programs.items() for i in p.instructions if isinstance(i, Send)}
    recvs = {(i.peer, r, i.tag) for r, p in programs.items() for i in p.instructions if isinstance(i, Recv)}
    report = {"unmatched": len(sends ^ recvs), "pairs": 0, "fused": 0, "pair_inputs_late": [], "posted_ahead": 0,
              "received": 0, "summed_grads": {}}
    for rank, program in programs.items():
        runs = [(k, run) for k, i in enumerate(program.instructions) if isinstance(i, Run) for run in i.runs]
        position = {(i.task[0], i.task[1:], i.microbatch): k for k, i in runs}
        report["fused"] += sum(1 for i in program.instructions if isinstance(i, Run) and len(i.runs) == 2)
        received_at = {(i.value, i.microbatch): k for k, i in enumerate(program.instructions) if isinstance(i, Recv)}
        for group in built.steps(rank):
            if len(group) != 2:
                continue
            report["pairs"] += 1
            starts = [position[(a.kind, str(built.model_stage(a.stage)), a.microbatch)] for a in group]
            for action in group:
                task = program.tasks[f"{action.kind}{built.model_stage(action.stage)}"]
                for name in task.inputs:
                    k = received_at.get((name, action.microbatch))
                    if k is not None and k > min(starts):
                        report["pair_inputs_late"].append((rank, str(action), name))
        for k, instruction in runs:
            task = program.tasks[instruction.task]
            for name in task.inputs:
                if (name, instruction.microbatch) in received_at:
                    report["received"] += 1
                    previous_run = max((j for j, _ in runs if j < k), default=-1)  # the instruction before
                    report["posted_ahead"] += received_at[(name, instruction.microbatch)] < previous_run
        report["summed_grads"][rank] = sum(1 for i in program.instructions if isinstance(i, Recv) and i.accumulate)
    return report


@pytest.mark.parametrize("schedule", ["dualpipe", "dualpipev"])
def test_programs_run_pairs_with_their_receives_posted_ahead(schedule):
    with processes().Pool(1) as pool:
        report = pool.apply(_plan, (schedule,))
    assert report["unmatched"] == 0  # every send has its receive on the peer
    assert report["pairs"] > 0 and report["pair_inputs_late"] == []  # a pair's receives precede its run
    assert report["fused"] == report["pairs"]  # each pair runs as one fused task
    # Receives are posted a step ahead, so they arrive while the previous step computes.
    assert report["posted_ahead"] >= 0.8 * report["received"], report
    if schedule == "dualpipe":  # every rank sums its gradients with the other copy's, and the loss
        assert all(count > 1 for count in report["summed_grads"].values()), report["summed_grads"]
    else:  # only the loss, from the rank of the last stage
        assert report["summed_grads"] == {0: 0, 1: 1, 2: 1, 3: 1}
