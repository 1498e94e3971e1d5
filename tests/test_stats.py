"""Runtime stats and traces: where a step's time goes, and what each rank sends."""
import json

import pytest
import torch

from ranks import run_ranks
from training import stats_worker


def _check_times(stats):
    assert stats["step_s"] > 0 and stats["compute_s"] > 0 and stats["comm_wait_s"] >= 0, stats
    # Compute and waits are disjoint parts of the step (the rest is the runtime's own bookkeeping).
    assert stats["compute_s"] + stats["comm_wait_s"] <= stats["step_s"] * 1.001, stats
    assert stats["exposed_comm_fraction"] == pytest.approx(stats["comm_wait_s"] / stats["step_s"])
    assert sum(stats["comm_wait_s_by_kind"].values()) == pytest.approx(stats["comm_wait_s"])
    assert stats["compute_s"] + stats["comm_wait_s"] + stats["runtime_s"] == pytest.approx(stats["step_s"], rel=1e-3)
    assert 0 < stats["runtime_fraction"] < 1
    # The step's own work around its program, in the call and in `loss.backward()`, is counted apart.
    call = stats["step_call_s"]
    assert call > 0, stats
    assert stats["overhead_fraction"] == pytest.approx((stats["runtime_s"] + call) / (stats["step_s"] + call))
    if "step_call_s_before_backward" in stats:  # the hand-over in backward adds to what the call took
        assert 0 < stats["step_call_s_before_backward"] < call, stats


def test_on_a_device_with_streams_steps_are_timed_by_events_read_only_when_asked():
    """On a GPU the host only enqueues work: a step is timed by events on the device's stream
    (here a stand-in recording host time), and reading them waits for the work before them,
    so the runtime reads none while it steps (no host synchronisation in the hot path), only
    when the stats or the trace are asked for. The events of a step no longer kept are
    recorded again by a later one: from the third step on, a step makes none of its own
    (the step before it is still kept, as the last run, while it runs). Pipeline 1F1B:
    tasks, receives and sends."""
    from training import stream_clock_worker

    options = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    for run in run_ranks(stream_clock_worker, 2, options):
        assert run["read_while_stepping"] == 0 and run["read"] > 0, run
        made = run["made"]  # e.g. [28, 56, 56, 56]
        # Later steps make none, but where a step ends with sends still in flight that the ones
        # it reuses had not (a span of 2 stamps): gloo's sends complete when they complete.
        assert made[0] > 20 and made[1] == 2 * made[0] and made[-1] <= made[1] + 2 * (len(made) - 2), made
        _check_times(run["stats"])
        spans = [e for e in run["trace"]["traceEvents"] if e["ph"] == "X"]
        assert {e["cat"] for e in spans} >= {"compute", "comm wait"} and all(e["dur"] >= 0 for e in spans)
        # Issuing the sends and receives is communication (gloo writes the bytes then), not the runtime's.
        assert run["stats"]["comm_wait_s_by_kind"]["p2p issue"] > 0, run["stats"]
        assert any(e["cat"] == "comm wait" and e["name"].startswith("issue ") for e in spans)


def test_choosing_a_clock_by_device(monkeypatch):
    from piper_fx.runtime.timing import HostClock, StreamClock, clock_for
    from training import DeviceEvents

    assert isinstance(clock_for(None), HostClock) and isinstance(clock_for(torch.device("cpu")), HostClock)
    assert isinstance(clock_for(torch.device("meta")), HostClock)
    monkeypatch.setattr(torch, "get_device_module", lambda device_type: DeviceEvents)
    assert isinstance(clock_for(torch.device("cuda", 0)), StreamClock)


def test_ddp_all_reduces_every_gradient_byte_once_per_step():
    for run in run_ranks(stats_worker, 2, {"codegen": "eager"}):
        for stats in run["stats"]:
            _check_times(stats)
            assert stats["comm_bytes"] == {"all_reduce": run["param_bytes"]}, stats
        # Without `profile`, waits inside tasks are not timed: the trace has no wait_tensor.
        assert not any(e.get("name") == "wait_tensor" for e in run["trace"]["traceEvents"])


def test_zero3_stats_count_gathers_in_forward_and_backward_and_the_trace_is_written(tmp_path):
    options = {"zero": 3, "codegen": "eager", "debug_dir": str(tmp_path), "profile": True}
    for rank, run in enumerate(run_ranks(stats_worker, 2, options)):
        for stats in run["stats"]:
            _check_times(stats)
            # Every shard is gathered at least twice a step (for forward and again for backward) and
            # every gradient is reduce-scattered (from full, row-padded gradients).
            assert stats["comm_bytes"]["all_gather"] >= 2 * run["shard_bytes"], (stats, run["shard_bytes"])
            assert stats["comm_bytes"]["reduce_scatter"] >= run["param_bytes"], stats
            assert stats["comm_wait_s"] > 0, stats  # gathers are waited for, at least the first
        (graph_dir,) = (tmp_path / f"rank{rank}").iterdir()
        trace = json.loads((graph_dir / "trace.json").read_text())
        for events in (trace["traceEvents"], run["trace"]["traceEvents"]):
            spans = [e for e in events if e["ph"] == "X"]
            assert {e["name"] for e in spans if e["cat"] == "compute"} == {"F0.0", "B0.0"}  # as in the schedule
            assert any(e["cat"] == "comm wait" and e["name"] == "wait all_gather" for e in spans)
            # Each collective in flight is on the comm lane, from its issue to the end of its wait.
            assert {e["name"] for e in spans if e["cat"] == "comm"} == {"all_gather", "reduce_scatter"}
            assert {e["pid"] for e in spans} == {rank}


def test_profile_times_collective_waits_inside_inductor_tasks():
    for run in run_ranks(stats_worker, 2, {"zero": 3, "codegen": "inductor", "profile": True}, 2):
        _check_times(run["stats"][-1])
        waits = [e for e in run["trace"]["traceEvents"] if e.get("name") == "wait all_gather"]
        assert waits and all(e["cat"] == "comm wait" for e in waits)
        in_flight = [e for e in run["trace"]["traceEvents"] if e.get("cat") == "comm"]
        assert {e["name"] for e in in_flight} == {"all_gather", "reduce_scatter"}
        assert run["stats"][-1]["comm_wait_s_by_kind"]["all_gather"] > 0
        # Counted from the planned graphs, whatever Inductor made of the collectives (e.g. in place).
        assert run["stats"][-1]["comm_bytes"]["all_gather"] >= 2 * run["shard_bytes"], run["stats"][-1]
        assert run["stats"][-1]["comm_bytes"]["reduce_scatter"] >= run["param_bytes"], run["stats"][-1]


def test_two_models_compiled_in_one_process_keep_their_own_stats():
    """Each compiled step owns its last run; `last_step_stats()` is the step that ran last."""
    import torch

    import piper_fx
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, global_batch

    steps = {}

    def compiled(name, model, options):
        piper_fx.prepare(model, options)  # microbatches: the batch dimension is traced dynamic

        def backend(gm, example_inputs):
            steps[name] = piper_fx.piper_backend(gm, example_inputs, options)
            return steps[name]
        return torch.compile(model, backend=backend)

    torch.manual_seed(0)
    small, deep = GPT(GPTConfig(**SMALL)), GPT(GPTConfig(**{**SMALL, "n_layer": 3, "n_embd": 32}))
    run_small = compiled("small", small, {"codegen": "eager"})
    run_deep = compiled("deep", deep, {"codegen": "eager", "pipeline": {"microbatches": 2}})
    x, y = global_batch(0, 4, small.cfg)
    run_small(x, y).backward()
    small_stats = piper_fx.last_step_stats()
    assert steps["small"].step.last_run.stats == small_stats
    run_deep(x, y).backward()
    deep_stats = piper_fx.last_step_stats()
    assert deep_stats == steps["deep"].step.last_run.stats
    assert piper_fx.last_step_trace() == steps["deep"].step.last_run.trace()
    # The deep model's run replaced neither the small step's stats nor its trace.
    assert steps["small"].step.last_run.stats == small_stats
    assert {e["name"] for e in steps["small"].step.last_run.trace()["traceEvents"] if e.get("cat") == "compute"} == \
        {"F0.0", "B0.0"}
    assert small_stats["instructions"] == 2 and deep_stats["instructions"] == 4, (small_stats, deep_stats)
    assert deep_stats["peak_activation_bytes"] > 0 and small_stats["peak_activation_bytes"] > 0
    run_small(x, y).backward()
    assert piper_fx.last_step_stats() == steps["small"].step.last_run.stats != small_stats  # a new run, new times


def test_memory_counted_until_two_runs_agree_is_what_counting_every_run_reports():
    """The runtime counts the bytes a program makes value by value on its runs until two in a
    row count the same, then reports that count with what the step holds now (parameters,
    optimizer state, the gradients of earlier steps): the same stats as counting every run,
    as optimizer state appears and gradients accumulate over steps."""
    import piper_fx
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, global_batch

    options = {"codegen": "eager", "pipeline": {"microbatches": 2}}
    steps, stats, models = {}, {"profiled": [], "counted": []}, []
    for name in stats:
        torch._dynamo.reset()  # compiled by `backend` here, not by a frame an earlier test cached
        torch.manual_seed(0)
        model = piper_fx.prepare(GPT(GPTConfig(**SMALL)), options)
        models.append(model)  # alive to the end: a dead model's step is let go of

        def backend(gm, example_inputs, name=name):
            steps[name] = piper_fx.piper_backend(gm, example_inputs, options)
            return steps[name]
        run = torch.compile(model, backend=backend)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for i in range(5):
            if name == "counted" and name in steps:
                steps[name].step.executor.profile = None  # count this run too
            x, y = global_batch(i, 4, model.cfg)
            run(x, y).backward()
            stats[name].append(piper_fx.last_step_stats())
            opt.step()
            if i % 2:  # gradients of the step before are held through the next one
                opt.zero_grad()
    assert steps["profiled"].step.executor.profile is not None
    for profiled, counted in zip(stats["profiled"], stats["counted"], strict=True):
        assert profiled["memory"] == counted["memory"], (profiled["memory"], counted["memory"])
        assert profiled["peak_activation_bytes"] == counted["peak_activation_bytes"]
    memories = [s["memory"] for s in stats["profiled"]]
    assert memories[0]["optimizer_state"] == 0 < memories[1]["optimizer_state"] == memories[4]["optimizer_state"]
    assert memories[1]["gradients"] > memories[2]["gradients"]  # step 1's gradients held through step 2


def test_under_inductor_every_rank_counts_the_collectives_of_its_program():
    """Found adding `no_sync`: Inductor rewrites the graph it compiles in place (piper_fx's
    `KeepCollectiveOrder` wraps each collective in a `control_deps`), and it was given the task's
    own graph, from which the executor then counted the bytes each collective sends. The rank
    that compiled a task counted none of that task's collectives, the rank that loaded its code
    (`codegen.shared`) all of them: at ZeRO-3 rank 0 reported no reduce-scatter at all. The
    executor now reads the graphs before they are compiled; every rank counts the same bytes, its
    reduce-scatters those of eager code (its all-gathers may differ: Inductor's decompositions give
    another graph). Compiled without Inductor's caches, as a hit skips the passes that rewrite."""
    eager = run_ranks(stats_worker, 2, {"zero": 3, "codegen": "eager"}, 1)
    inductor = run_ranks(stats_worker, 2, {"zero": 3, "codegen": "inductor", "regions": True}, 1, False)
    counted = [run["stats"][0]["comm_bytes"] for run in inductor]
    assert counted[0] == counted[1] and counted[0]["all_gather"] > 0, counted
    assert counted[0]["reduce_scatter"] == eager[0]["stats"][0]["comm_bytes"]["reduce_scatter"] > 0, (counted, eager)
