"""Where a compile's time goes (`piper_fx.last_compile_stats()`, `compile_stats.txt`), and
later compiles of an identical model, in the same process and in a fresh one sharing the
cache directory, served from the plan cache and Inductor's FX graph cache (counted, not
timed), training alike."""
from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from piper_fx.passes import PIPELINE, dump_path
from ranks import processes

STEPS = 3


def _compile(runs: int, cache_dir: str, debug_dir: str, plan_cache: str = "1", codegen: str = "inductor") -> list[dict]:
    """In a fresh process: compile the example GPT and train it `STEPS` SGD steps, `runs`
    times (`torch._dynamo.reset()` between them); per run its compile stats, its losses
    and its final parameters."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    os.environ["PIPER_PLAN_CACHE"] = plan_cache
    import torch

    import piper_fx
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, global_batch

    cfg = GPTConfig(**SMALL)
    results = []
    for run in range(runs):
        torch.manual_seed(0)
        model = GPT(cfg)
        step = torch.compile(model, backend="piper",
                             options={"codegen": codegen, "debug_dir": os.path.join(debug_dir, str(run))})
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        losses = []
        for i in range(STEPS):
            loss = step(*global_batch(i, 4, cfg))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if i == 0:
                stats = piper_fx.last_compile_stats()
        results.append({"stats": stats, "losses": losses,
                        "params": {name: p.detach().clone() for name, p in model.named_parameters()}})
        torch._dynamo.reset()
    return results


def _in_fresh_process(*args) -> list[dict]:
    with processes().Pool(1) as pool:
        return pool.apply(_compile, args)


def _assert_same_training(run: dict, reference: dict) -> None:
    assert run["losses"] == reference["losses"]
    for name, value in reference["params"].items():
        assert run["params"][name].equal(value), name


def test_compile_stats_time_each_phase_and_later_compiles_reuse_the_plan_and_every_task(tmp_path):
    cache, dumps = str(tmp_path / "inductor"), str(tmp_path / "dumps")
    cold, again = _in_fresh_process(2, cache, dumps)  # the cache directory starts empty
    (fresh,) = _in_fresh_process(1, cache, str(tmp_path / "fresh_dumps"))

    tasks = [name.removeprefix("codegen:") for name in cold["stats"]["seconds"] if name.startswith("codegen:")]
    assert sorted(tasks) == ["B0", "F0"]
    assert cold["stats"]["tasks"] == {"compiled": 2}
    assert cold["stats"]["plan"] == "planned, cached"
    assert [name for name in cold["stats"]["seconds"] if name.startswith("pass:")] == \
        [f"pass:{p.name}" for p in PIPELINE]
    assert {"plan cache", "capture", "passes", "codegen"} <= cold["stats"]["by_kind"].keys()
    # Inductor's per-process CPU probe ran beside planning; the compile waited for what was left of it.
    assert "codegen warm-up" in cold["stats"]["seconds"]
    # The same process after `torch._dynamo.reset()`, and a fresh one: neither plans nor compiles.
    for warm in (again, fresh):
        assert warm["stats"]["plan"] == "cache hit"
        assert warm["stats"]["tasks"] == {"cache_hit": 2}
        assert not any(name == "capture" or name.startswith("pass:") for name in warm["stats"]["seconds"])
        _assert_same_training(warm, cold)
    for run in (cold, again, fresh):
        stats = run["stats"]
        assert abs(sum(stats["by_kind"].values()) - stats["total_s"]) < 1e-9
        assert all(seconds >= 0 for seconds in stats["seconds"].values())
        # Dynamo's trace of the frame, before the compile and not in its total, leads the summary.
        assert stats["dynamo_trace_s"] > 0
        assert stats["summary"].startswith(f"Dynamo trace {stats['dynamo_trace_s']:.2f} s, then compile "
                                           f"{stats['total_s']:.2f} s (")
        # Its garbage collections scanned only what it made: the process's own objects were frozen.
        assert stats["frozen_objects"] > 100_000 and stats["gc_s"] >= 0
    dumped = next((tmp_path / "dumps" / "0").rglob("compile_stats.txt")).read_text()
    assert "plan: planned, cached; tasks: 2 compiled" in dumped.splitlines()[0]
    assert "pass:split_stages" in dumped
    # A plan from the cache writes the dumps planning wrote: the joint graph and every pass's.
    fresh_graph = next((tmp_path / "fresh_dumps" / "0").rglob("compile_stats.txt")).parent
    cold_graph = next((tmp_path / "dumps" / "0").rglob("compile_stats.txt")).parent
    assert fresh_graph.joinpath("compile_stats.txt").read_text().splitlines()[0].endswith(
        "plan: cache hit; tasks: 2 cache hit")
    for index, strategy_pass in enumerate(PIPELINE):
        path = dump_path(index, strategy_pass.name)
        assert fresh_graph.joinpath(path).read_text() == cold_graph.joinpath(path).read_text()


def _compile_beside_a_freeze(cache_dir: str) -> list[dict]:
    """In a fresh process: compile the example GPT (eager codegen) and take a step, twice: as
    it is, then with objects the process froze itself (`gc.freeze`, as before forking data
    loader workers). Per compile: the process's freeze count before and after it, and what
    its stats say it froze."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import gc

    import torch

    import piper_fx
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, global_batch

    cfg = GPTConfig(**SMALL)
    results = []
    for own_freeze in (False, True):
        torch._dynamo.reset()
        step = torch.compile(GPT(cfg), backend="piper", options={"codegen": "eager"})
        if own_freeze:
            gc.freeze()
        before = gc.get_freeze_count()
        step(*global_batch(0, 4, cfg)).backward()
        results.append({"before": before, "after": gc.get_freeze_count(),
                        "frozen": piper_fx.last_compile_stats()["frozen_objects"]})
        gc.unfreeze()
    return results


def test_a_compile_scans_only_the_objects_it_makes_and_leaves_a_freeze_of_the_process_alone(tmp_path):
    """While the backend compiles, the objects the process held already are frozen, so that the
    garbage collections the compile sets off scan only what it made; they are thawed after.
    Where the process had frozen objects itself, the compile freezes nothing (thawing its own
    would thaw the process's too) and leaves them frozen."""
    with processes().Pool(1) as pool:
        plain, beside = pool.apply(_compile_beside_a_freeze, (str(tmp_path / "inductor"),))
    assert plain["before"] == 0 and plain["frozen"] > 100_000 and plain["after"] == 0, plain
    # Still frozen after, but for the frozen objects the step let go of (freed, and so no longer counted).
    assert beside["before"] > 100_000 and beside["frozen"] == 0 and beside["after"] > 0.9 * beside["before"], beside


def test_a_compile_collects_its_youngest_generation_less_often_and_restores_the_threshold():
    """Inside the compile's collection context (the one that freezes the process's objects,
    above), the youngest generation collects after `COMPILE_GC_THRESHOLD` allocations, whether
    or not the process froze objects itself; after it, the process's thresholds are back."""
    import gc

    from piper_fx.backend import COMPILE_GC_THRESHOLD, _collecting_only_new_objects

    before = gc.get_threshold()
    for own_freeze in (False, True):
        if own_freeze:
            gc.freeze()
        try:
            with _collecting_only_new_objects():
                assert gc.get_threshold() == (max(before[0], COMPILE_GC_THRESHOLD), *before[1:])
            assert gc.get_threshold() == before
        finally:
            gc.unfreeze()


def test_plan_cache_off_plans_every_compile(tmp_path):
    first, second = _in_fresh_process(2, str(tmp_path / "inductor"), str(tmp_path / "dumps"), "0", "eager")
    assert first["stats"]["plan"] == second["stats"]["plan"] == "planned"
    assert not (tmp_path / "inductor" / "piper_plans").exists()
    _assert_same_training(second, first)


def test_a_plan_from_the_cache_trains_as_planned_on_real_ranks(tmp_path):
    """Two ranks over gloo, each config compiled twice from an empty cache directory: the second
    compile loads the first one's plan, and both train alike, bit for bit, and like
    single-process training. DualPipeV (fused overlapped pairs, V-shaped stages) and ZeRO-3
    (row-sharded DTensor parameters, per-unit gathers)."""
    from ranks import run_ranks
    from training import plan_cache_worker

    configs = [
        {"options": {"mesh": {"pp": 2}, "pipeline": {"schedule": "dualpipev", "microbatches": 4}},
         "n_layer": 4, "tied": False, "pp_regions": True, "per_rank_batch": 4},
        {"options": {"zero": 3}},
    ]
    results = run_ranks(plan_cache_worker, 2, configs, str(tmp_path), deadline_s=400)
    for rank, by_config in enumerate(results):
        for config, (first, second) in zip(configs, by_config):
            assert (first["plan"], second["plan"]) == ("planned, cached", "cache hit"), (rank, config)
            assert second["loss_errors"] == first["loss_errors"], (rank, config)
            assert max(first["loss_errors"]) < 1e-5 and max(first["param_errors"].values()) < 1e-4, (rank, config)
            assert first["trained_values"].keys() == second["trained_values"].keys()
            for name, value in first["trained_values"].items():
                assert (second["trained_values"][name] == value).all(), (rank, config, name)


def test_ranks_compile_each_task_they_share_once(tmp_path):
    """Two data-parallel ranks run the same task graphs (ZeRO-3's gathers name no rank): from an
    empty cache directory they share, each of the two tasks is compiled by one of them (the
    first to claim it) and loaded from the cache by the other, and they train like
    single-process training."""
    from ranks import run_ranks
    from training import shared_compile_worker

    results = run_ranks(shared_compile_worker, 2, str(tmp_path / "inductor"), deadline_s=600)
    assert sum(run["tasks"].get("compiled", 0) for run in results) == 2, results
    for rank, run in enumerate(results):
        assert sum(run["tasks"].values()) == 2 and set(run["tasks"]) <= {"compiled", "cache_hit"}, \
            (rank, run["tasks"])
        assert {"codegen exchange", "codegen wait for peers"} <= set(run["phases"])
        assert max(run["loss_errors"]) < 1e-5 and max(run["param_errors"].values()) < 1e-5, rank


def test_a_rank_failing_to_compile_stops_its_peers_naming_it():
    from ranks import run_ranks
    from training import failing_compile_worker

    raised = run_ranks(failing_compile_worker, 2, 1, deadline_s=300)
    assert "RuntimeError: no compiler for" in raised[1]
    assert "PiperError" in raised[0] and "rank 1 failed to compile its tasks" in raised[0] \
        and "no compiler for" in raised[0], raised[0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["host0:/cache", "host1:/cache", None]),
                          st.lists(st.sampled_from(["k0", "k1", "k2", "k3", "k4"]), max_size=7)),
                min_size=1, max_size=8),
       st.lists(st.integers(0, 7), max_size=60))
def test_each_task_shared_through_a_cache_is_compiled_by_the_one_rank_that_claims_it(ranks, turns):
    """`codegen.shared`: ranks claiming their tasks in a store, in any interleaving (`turns`:
    which rank claims next), each costliest first. Every task key held through a cache is
    compiled by exactly one rank holding it through that cache; a rank without a shared
    cache compiles everything it holds; repeats of a key are never claimed."""
    import torch.distributed as dist

    from piper_fx.codegen.shared import Claims, order

    costs = {"k0": 500, "k1": 300, "k2": 300, "k3": 40, "k4": 1}
    store = dist.HashStore()
    queues, compiled = [], [set() for _ in ranks]
    for cache, keys in ranks:
        firsts, rest = order([costs[key] for key in keys], keys)
        assert sorted(firsts + rest) == list(range(len(keys)))
        claimed = [keys[index] for index in firsts]
        assert len(set(claimed)) == len(claimed) and set(claimed) == set(keys)
        assert claimed == sorted(claimed, key=lambda key: (-costs[key], key))
        queues.append((Claims(store, "compile/0", cache), claimed))
    for rank in turns + [rank for rank, _ in enumerate(ranks) for _ in range(7)]:
        if rank < len(ranks) and queues[rank][1]:
            claims, claimed = queues[rank]
            key = claimed.pop(0)
            if claims(key):
                compiled[rank].add(key)
    for rank, (cache, keys) in enumerate(ranks):
        assert compiled[rank] <= set(keys)
        if cache is None:
            assert compiled[rank] == set(keys)
    for cache in {cache for cache, _ in ranks} - {None}:
        holding = [rank for rank, (held_through, _) in enumerate(ranks) if held_through == cache]
        for key in {key for rank in holding for key in ranks[rank][1]}:
            assert sum(key in compiled[rank] for rank in holding) == 1, (cache, key)
    # Once claimed, a task is no one else's; a later compile claims under a prefix of its own.
    first, again = Claims(store, "compile/0", "host0:/cache"), Claims(store, "compile/0", "host0:/cache")
    assert first("k9") and not again("k9") and not first("k9")
    assert Claims(store, "compile/1", "host0:/cache")("k9")


def test_a_task_a_peer_claimed_is_compiled_once_it_is_marked_and_its_failure_is_named():
    """`codegen.shared` in a later compile, where no rank waits for all the others: a rank
    compiles a task a peer claimed once the peer marks it done, from the cache; a peer that
    failed to compile it marks its error, which the rank raises as a `PiperError`."""
    import torch.distributed as dist

    from piper_fx.codegen.shared import Claims
    from piper_fx.errors import PiperError

    store = dist.HashStore()
    peer, mine = Claims(store, "compile/later", "host0:/cache"), Claims(store, "compile/later", "host0:/cache")
    assert peer("k1") and not mine("k1")
    peer.mark("k1")
    mine.wait("k1")
    assert peer("k2") and not mine("k2")
    peer.mark("k2", "rank 1 failed to compile a task this rank compiles too: RuntimeError: no compiler")
    with pytest.raises(PiperError, match="rank 1 failed to compile .* RuntimeError: no compiler"):
        mine.wait("k2")
    alone = Claims(store, "compile/later", None)  # no shared cache: compiles everything, waits for no one
    assert alone("k1") and alone("k2")
    alone.mark("k3")
    alone.wait("k3")


def test_dynamo_trace_is_the_frames_being_compiled_and_none_outside_a_compile():
    import torch

    from piper_fx.compat import dynamo_trace_seconds
    from piper_fx.compile_stats import CompileStats

    seen = []

    def backend(gm, example_inputs):
        seen.append(dynamo_trace_seconds())
        return gm.forward

    torch.compile(lambda x: (x * 2).sum(), backend=backend)(torch.ones(3))
    assert len(seen) == 1 and seen[0] > 0
    # After the compile, and in a compile stats made outside one (a plan made by hand): none.
    assert dynamo_trace_seconds() is None
    assert CompileStats().summary().startswith("compile 0.00 s (")
