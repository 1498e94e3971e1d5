"""What a compiled step keeps once planning is over: its compiled tasks and what the runtime
reads, not the graphs it was planned from. A task graph carries the fake value of every
intermediate of a stage, and the joint graph those of the whole step; kept, they live as
long as the step (on the example GPT at ZeRO-3, about a fifth of the Python heap piper_fx
left behind after a cold compile, and the frames of the whole pass pipeline with them,
through a cached DTensor refusal's traceback). Counted in a fresh process on a fake
process group of 2 ranks, not timed."""
import pytest

from ranks import processes

CASES = {  # name -> (options (2 ranks), global batch rows)
    # Captured with Inductor's decompositions, among whose ops DTensor's propagator refuses
    # one it is asked about (and the refusal is cached). The model and batch of
    # test_codegen_inductor's ZeRO-3 run, whose code Inductor's cache then holds.
    "dp2 zero3 inductor": ({"zero": 3, "codegen": "inductor"}, 4),
    "pp2 1f1b eager": ({"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 4}, "codegen": "eager"}, 8),
}


def _left_behind(options: dict, rows: int) -> dict:
    """After one compiled step and its backward on rank 0 of 2 (fake process group), alive:
    the step's planned graphs (by node count) and the frames of piper_fx's planning."""
    import gc
    import os
    import types

    os.environ["PIPER_PLAN_CACHE"] = "0"  # planned here, not loaded from an earlier test's plan

    import torch
    import torch.distributed as dist
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import piper_fx
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, global_batch

    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL))
        if "pipeline" in options:
            model.block_context = lambda: piper_fx.annotate("PP")
        piper_fx.prepare(model, options)
        step = torch.compile(model, backend="piper", options=options)
        dp = options.get("mesh", {}).get("dp", 2 // options.get("mesh", {}).get("pp", 1))
        x, y = global_batch(0, rows, model.cfg)
        loss = step(x.chunk(dp)[0], y.chunk(dp)[0])
        if loss.requires_grad:
            loss.backward()
        gc.collect()
        objects = gc.get_objects()
        graphs = [g for g in objects if isinstance(g, fx.Graph)]
        # The step's planned graphs: the joint graph, stage tasks (graphs that compute the
        # model, a matmul or the joint graph's inputs, with fake values). Eager codegen's code
        # keeps a copy without values; collective lowerings traced while planning (a handful
        # of ops each, `collectives.emit`) are not counted here.
        planned = [len(g.nodes) for g in graphs
                   if any(isinstance(n.meta.get("val"), FakeTensor) for n in g.nodes)
                   and any(n.target is torch.ops.aten.mm.default or n.name.startswith(("primals_", "tangents_"))
                           for n in g.nodes)]
        frames = sorted({f"{f.f_code.co_filename.rsplit('piper_fx', 1)[-1]}:{f.f_code.co_name}" for f in objects
                         if isinstance(f, types.FrameType) and "piper_fx" in f.f_code.co_filename})
        return {"graphs": planned, "frames": frames}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("case", list(CASES))
def test_a_compiled_step_keeps_no_graph_of_its_planning(case):
    with processes().Pool(1) as pool:
        left = pool.apply(_left_behind, CASES[case])
    assert left["graphs"] == [], f"the step's graphs alive after compiling, by node count: {left['graphs']}"
    assert left["frames"] == [], "frames of planning kept alive (a traceback held somewhere)"
