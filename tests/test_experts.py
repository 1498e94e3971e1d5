"""Expert parallelism equals single-process training, alone and composed with DP, ZeRO and pipelines.

The MoE GPT (4 experts, top-2, sequence-wise balance loss) routes tokens
unevenly; every rank computes its own block of experts for the tokens of its
ep group, which reach it and return through all-to-alls.
"""
import json
import re

from ranks import processes, run_ranks
from training import expert_errors_worker, pipeline_worker

RTOL = 1e-5
EXPERTS = 4


def _ep(dp, ep, zero=0, **more):
    return {"mesh": {"dp": dp, "ep": ep, **more.pop("mesh", {})}, "zero": zero, **more}


def _check(results, configs, dp, ep):
    for rank, runs in enumerate(results):
        for config, run in zip(configs, runs):
            # The router spreads tokens unevenly: experts of one layer got different numbers of them.
            assert any(len(set(loads)) > 1 for loads in run["expert_loads"]), run["expert_loads"]
            assert max(run["loss_errors"]) < RTOL, (rank, config, run["loss_errors"])
            worst = max(run["param_errors"], key=run["param_errors"].get)
            assert run["param_errors"][worst] < RTOL, (rank, config, worst, run["param_errors"][worst])
    # Expert weights are DTensors of this rank's experts on the ep mesh; the rest as ZeRO holds them.
    for index, config in enumerate(configs):
        zero = config["options"].get("zero", 0)
        for rank, runs in enumerate(results):
            for name, placement in runs[index]["placements"].items():
                expected = "ep:Shard(dim=0)" if ".experts." in name else "dp:Shard(dim=0)" if zero else "dp:Replicate()"
                assert placement == expected, (config, rank, name, placement)
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
    # Capacity 5 of a sequence's 9 tokens per expert: overflowing choices are dropped, alike on both sides.
    configs += _configs(_ep(2, 2), capacity_factor=1.0)
    results = run_ranks(pipeline_worker, 2, configs, deadline_s=400)
    _check(results, configs, dp=2, ep=2)
    # Optimizer state of the experts is split over the ep group.
    full = results[0][0]["reference_state_bytes"]
    assert results[0][0]["optimizer_state_bytes"] < full


def test_expert_parallel_replicated_over_data_parallel_groups():
    # With microbatches, the replicas average the expert gradient once per step, on its sum.
    configs = _configs(_ep(4, 2, zero=0), _ep(4, 2, zero=1), _ep(4, 2, zero=1, pipeline={"microbatches": 2}))
    _check(run_ranks(pipeline_worker, 4, configs, deadline_s=500), configs, dp=4, ep=2)


def test_expert_parallel_in_pipelines(tmp_path):
    dualpipev = _ep(2, 2, mesh={"pp": 2}, pipeline={"schedule": "dualpipev", "microbatches": 4},
                    debug_dir=str(tmp_path), profile=True)
    configs = _configs(_ep(2, 2, mesh={"pp": 2}, pipeline={"schedule": "1f1b", "microbatches": 2}), dualpipev,
                       pp_regions=True, n_layer=4, per_rank_batch=4)
    _check(run_ranks(pipeline_worker, 4, configs, deadline_s=500), configs, dp=2, ep=2)

    # The dumps show each all-to-all, on the comm lane, and in the trace its time in flight under
    # the compute of the overlapped pair that issued it.
    graph_dir = next((tmp_path / "rank0").iterdir())
    program = (graph_dir / "program.txt").read_text()
    assert re.search(r"collective all_to_all\w*: .*all_to_all dispatch .*\[comm lane: ops \d+\.\.\d+ of \d+\]",
                     program), program
    assert "all_to_all combine" in program and re.search(r"run   F0\.\d&B3\.\d", program), program
    events = [e for e in json.loads((graph_dir / "trace.json").read_text())["traceEvents"] if e["ph"] == "X"]
    pairs = [e for e in events if e["cat"] == "compute" and "&" in e["name"]]
    in_flight = [e for e in events if e["cat"] == "comm" and e["name"] == "all_to_all"]
    assert pairs and in_flight
    inside_pairs = [a for a in in_flight
                    if any(p["ts"] <= a["ts"] and a["ts"] + a["dur"] <= p["ts"] + p["dur"] for p in pairs)]
    assert len(inside_pairs) >= 4 * len(pairs), (len(inside_pairs), len(pairs))  # 2 blocks x dispatch, combine


def test_bad_expert_parallel_setups_are_config_errors():
    errors = run_ranks(expert_errors_worker, 2)[0]
    assert errors["indivisible"][0] == "mesh.ep" and "number of experts" in errors["indivisible"][1], errors
    assert errors["unannotated"][0] == "mesh.ep" and "annotate('EP')" in errors["unannotated"][1], errors
    assert errors["unmarked"][0] == "mesh.ep" and "mark_experts" in errors["unmarked"][1], errors


def _plan_dualpipev_with_experts(overlap: bool) -> dict:
    """pp=2 x dp=8 with ep=4 and DualPipeV on a fake process group: where each all-to-all runs."""
    import torch

    from piper_fx.ir import Run
    from piper_fx.ops import collective_kind
    from training import plan_all_ranks

    options = {"mesh": {"pp": 2, "dp": 8, "ep": 4}, "codegen": "eager", "overlap": overlap,
               "pipeline": {"schedule": "dualpipev", "microbatches": 4}}
    programs, _ = plan_all_ranks(options, world=16, n_layer=4, batch_rows=8, experts=EXPERTS)
    matmuls = (torch.ops.aten.bmm.default, torch.ops.aten.mm.default, torch.ops.aten.addmm.default)
    report = {"ranks": len(programs), "a2a_per_task": {}, "fused": 0, "a2a_in_pairs": 0, "a2a_overlapped": 0}
    for program in programs.values():
        for task in program.tasks.values():
            nodes = list(task.graph.graph.nodes)
            starts = [n for n in nodes if collective_kind(n) == "all_to_all"]
            if "&" not in task.name:
                report["a2a_per_task"][task.name] = len(starts)
                continue
            report["fused"] += 1
            for start in starts:  # a matmul not waiting for it runs between its issue and its wait
                wait = next(iter(start.users))
                between = nodes[nodes.index(start) + 1:nodes.index(wait)]
                dependent = {start}
                for node in between:
                    if any(i in dependent for i in node.all_input_nodes):
                        dependent.add(node)
                report["a2a_in_pairs"] += 1
                report["a2a_overlapped"] += any(n.target in matmuls and n not in dependent for n in between)
        assert any(isinstance(i, Run) and i.parts for i in program.instructions)
    return report


def test_dualpipev_pairs_overlap_one_microbatchs_all_to_all_with_the_others_compute():
    # A fresh process per plan, side by side: each makes (and destroys) its own fake process group.
    with processes().Pool(2, maxtasksperchild=1) as pool:
        on, off = pool.map(_plan_dualpipev_with_experts, (True, False), chunksize=1)
    assert on["ranks"] == 16
    # One MoE block per stage: a dispatch and a combine in forward, and again in backward.
    assert on["a2a_per_task"]["F0"] == 2 and on["a2a_per_task"]["B0"] == 2, on
    assert on["fused"] > 0 and on["a2a_overlapped"] == on["a2a_in_pairs"] > 0, on
    assert off["a2a_overlapped"] < off["a2a_in_pairs"], off  # one half after the other: exposed


def test_without_expert_parallelism_zero_shards_and_reduces_experts_like_any_parameter():
    """mesh.ep = 1 with marked experts: ZeRO shards them over dp and averages their gradients
    (they were kept whole and never reduced, off by 15% after 3 steps; found by test_strategies)."""
    configs = _configs(_ep(2, 1, zero=2), _ep(2, 1, zero=1, pipeline={"schedule": "1f1b", "microbatches": 2}))
    results = run_ranks(pipeline_worker, 2, configs, deadline_s=400)
    for rank, runs in enumerate(results):
        for config, run in zip(configs, runs):
            assert max(run["loss_errors"]) < RTOL, (rank, config, run["loss_errors"])
            worst = max(run["param_errors"], key=run["param_errors"].get)
            assert run["param_errors"][worst] < RTOL, (rank, config, worst, run["param_errors"][worst])
            experts = {n: v.shape for n, v in run["trained_values"].items() if ".experts." in n}
            assert experts and all(shape[0] == EXPERTS // 2 for shape in experts.values()), experts  # row shards
