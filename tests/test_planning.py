"""Which collectives each ZeRO level plans, on a fake process group of 4 ranks, in one process.

Counted from the dumped per-rank program: what the runtime runs is what is dumped.
"""
import multiprocessing
import re

import pytest
import torch

from training import SMALL, global_batch


def _plan_one_step(zero: int, world: int, debug_dir: str) -> str:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import piper_fx
    from examples.gpt import GPT, GPTConfig

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    options = {"zero": zero, "codegen": "eager", "debug_dir": debug_dir}
    piper_fx.prepare(model, options)
    x, y = global_batch(0, 2, model.cfg)
    torch.compile(model, backend="piper", options=options)(x, y).backward()
    dist.destroy_process_group()
    return next((__import__("pathlib").Path(debug_dir) / "rank0").iterdir()).joinpath("program.txt").read_text()


def _collectives_by_task(program: str) -> dict[str, list[str]]:
    tasks: dict[str, list[str]] = {}
    current = None
    for line in program.splitlines():
        task = re.match(r"\s+\d+\s+(\w+)\s+lane=", line)
        if task:
            current = tasks.setdefault(task.group(1), [])
        found = re.search(r"collective \w+: _c10d_functional\.(\w+)\.default", line)
        if found:
            current.append(found.group(1))
    return tasks


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(1) as pool:  # a fresh process: the fake process group must not leak into other tests
        return {zero: _collectives_by_task(pool.apply(_plan_one_step, (zero, 4, str(tmp_path_factory.mktemp(f"z{zero}")))))
                for zero in (0, 1, 2, 3)}


def _counts(ops):
    return {kind: ops.count(kind) for kind in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")}


def test_ddp_all_reduces_each_gradient_once(plans):
    params = 2 + 2 * 12 + 2  # wte (tied with lm_head), wpe, 12 per block, ln_f
    assert _counts(plans[0]["F"]) == {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "all_reduce": 0}
    assert _counts(plans[0]["B"]) == {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "all_reduce": params}


def test_zero1_and_2_gather_each_parameter_once_per_step(plans):
    params, uses = 28, 29  # the tied embedding is used by two modules: two gradient reductions
    assert _counts(plans[1]["F"])["all_gather_into_tensor"] == params
    assert _counts(plans[1]["B"]) == {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "all_reduce": uses}
    assert _counts(plans[2]["F"])["all_gather_into_tensor"] == params
    assert _counts(plans[2]["B"]) == {"all_gather_into_tensor": 0, "reduce_scatter_tensor": uses, "all_reduce": 0}


def test_zero3_gathers_per_use_in_forward_and_again_in_backward(plans):
    uses = 29
    assert _counts(plans[3]["F"]) == {"all_gather_into_tensor": uses, "reduce_scatter_tensor": 0, "all_reduce": 0}
    backward = _counts(plans[3]["B"])
    # Every use whose backward reads the weight gathers it again (embeddings and
    # layer-norm/bias parameters feed their backward without needing the full value).
    assert 0 < backward["all_gather_into_tensor"] < uses
    assert backward["reduce_scatter_tensor"] == uses and backward["all_reduce"] == 0
