"""Where a compile's time goes (`piper_fx.last_compile_stats()`, `compile_stats.txt`), and a
second compile of an identical model served from Inductor's FX graph cache (counted, not timed)."""
from __future__ import annotations

import multiprocessing
import os

from piper_fx.passes import PIPELINE


def _compile_twice(cache_dir: str, debug_dir: str) -> list[dict]:
    """In a fresh process with an empty Inductor cache: compile the example GPT, then an
    identical one after `torch._dynamo.reset()`; the compile stats of each."""
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache_dir
    import torch

    import piper_fx
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, global_batch

    cfg = GPTConfig(**SMALL)
    stats = []
    for run in range(2):
        torch.manual_seed(0)
        step = torch.compile(GPT(cfg), backend="piper",
                             options={"codegen": "inductor", "debug_dir": os.path.join(debug_dir, str(run))})
        step(*global_batch(0, 4, cfg)).backward()
        stats.append(piper_fx.last_compile_stats())
        torch._dynamo.reset()
    return stats


def test_compile_stats_time_each_phase_and_a_second_compile_reuses_every_task(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:  # a fresh process, whose Inductor cache starts empty
        cold, warm = pool.apply(_compile_twice, (str(tmp_path / "inductor"), str(tmp_path / "dumps")))

    tasks = [name.removeprefix("codegen:") for name in cold["seconds"] if name.startswith("codegen:")]
    assert sorted(tasks) == ["B0", "F0"]
    assert cold["tasks"] == {"compiled": 2}
    assert warm["tasks"] == {"cache_hit": 2}
    for stats in (cold, warm):
        assert [name for name in stats["seconds"] if name.startswith("pass:")] == \
            [f"pass:{p.name}" for p in PIPELINE]
        assert {"capture", "passes", "codegen"} <= stats["by_kind"].keys()
        assert abs(sum(stats["by_kind"].values()) - stats["total_s"]) < 1e-9
        assert all(seconds >= 0 for seconds in stats["seconds"].values())
    dumped = next((tmp_path / "dumps" / "1").rglob("compile_stats.txt")).read_text()
    assert dumped.splitlines()[0].endswith("tasks: 2 cache hit")
    assert "pass:split_stages" in dumped
