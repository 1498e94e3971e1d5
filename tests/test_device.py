"""The device follows the model: every tensor the runtime makes is on the model's device.

A rank computes where its parameters and batch live (`cuda:LOCAL_RANK` under
NCCL, `cpu` under gloo). This machine has no GPU, so the model stays on the
CPU and the step runs with the *default* device set to `meta`: a receive
buffer, gradient seed, flat bucket or all-to-all buffer that the runtime made
on the default device (or any other but the model's) shows up as a tensor off
the CPU, as it would land on the CPU under NCCL. Each case runs one rank's
whole step (forward, backward, sends, receives, collectives) of the example
GPT at pp=2 x dp=2 on a fake process group of 4 ranks, under a dispatch mode
that records the device of every tensor an op creates.

(The model itself cannot go on `meta`: AOTAutograd traces the GPT's
cross-entropy on meta tensors without a backward, so there is no training step.)
"""
import pytest

from ranks import processes

# (schedule, ZeRO level, rank): every schedule, every ZeRO level, first-stage ranks (0, 1) and
# last-stage ranks (2, 3); under the V-shaped schedules every rank holds a first and a last stage.
CASES = [
    ("gpipe", 0, 2),
    ("1f1b", 3, 1),
    ("interleaved_1f1b", 2, 3),
    ("zb1p", 1, 0),
    ("zbv", 0, 1),
    ("dualpipev", 3, 0),
    ("dualpipe", 1, 2),
]
MODEL_DEVICE = "cpu"  # the model's and its batch's; the default device is meta while the step runs
MICROBATCHES = 4  # what every schedule accepts at pp=2 (dualpipe and dualpipev need 2 * pp, even)
N_LAYER = 4  # PP regions: pp * stages_per_rank for the V-shaped and interleaved schedules


def _run_cases(cases: list) -> list:
    """For each (schedule or None, zero, rank, world): the ops whose result was not on the
    model's device (cpu) while that rank ran one whole step and its backward with the default
    device `meta`, and the ops that ran at all."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    import piper_fx
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, _capture_compiled_step, global_batch

    class DeviceRecorder(TorchDispatchMode):
        """Records every op whose result is a tensor off the model's device."""

        def __init__(self):
            super().__init__()
            self.off_device: list[str] = []
            self.ops: set[str] = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.ops.add(str(func))
            for value in tree_leaves(out):
                if isinstance(value, torch.Tensor) and value.device.type != MODEL_DEVICE:
                    self.off_device.append(f"{func} -> {value.device} {tuple(value.shape)}")
            return out

    torch.set_num_threads(1)
    results = []
    for schedule, zero, rank, world in cases:
        torch._dynamo.reset()  # a fresh model per case: no recompile limit, no guard on the last one
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        try:
            torch.manual_seed(0)
            model = GPT(GPTConfig(**{**SMALL, "n_layer": N_LAYER}, tied_embeddings=False))
            model.block_context = lambda: piper_fx.annotate("PP")
            options = {"zero": zero, "codegen": "eager", "mesh": {"pp": 2, "dp": 2} if world == 4 else {"pp": 1}}
            if schedule is not None:
                options["pipeline"] = {"schedule": schedule, "microbatches": MICROBATCHES}
            piper_fx.prepare(model, options)
            dp = world // 2 if world == 4 else 1
            x, y = global_batch(0, 2 * MICROBATCHES * dp, model.cfg)
            x, y = x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp]
            compiled, captured = _capture_compiled_step(model, options)
            compiled(x, y).backward()  # compiles; Dynamo runs no frame under a mode
            recorder = DeviceRecorder()
            with torch.device("meta"), recorder:  # the step itself, called as Dynamo calls it, and its backward
                loss = captured["step"](*captured["args"])[0]
                loss.backward()
            stats = piper_fx.last_step_stats()
            results.append({"off_device": recorder.off_device, "ops": sorted(recorder.ops), "loss_device": str(loss.device),
                            "grad_devices": sorted({str(p.grad.device) for p in model.parameters()
                                                    if p.grad is not None}),
                            "peak_activation_bytes": stats["peak_activation_bytes"]})
        finally:
            dist.destroy_process_group()
    return results


@pytest.fixture(scope="module")
def outcomes():
    """Every case's outcome, run in two fresh processes (the fake process group must not leak)."""
    cases = [(schedule, zero, rank, 4) for schedule, zero, rank in CASES] + [(None, 0, 0, 1)]
    halves = [cases[0::2], cases[1::2]]
    ctx = processes()
    with ctx.Pool(2) as pool:
        runs = pool.map(_run_cases, halves)
    return {case: outcome for half, run in zip(halves, runs) for case, outcome in zip(half, run)}


@pytest.mark.parametrize("case", [(s, z, r, 4) for s, z, r in CASES] + [(None, 0, 0, 1)],
                         ids=lambda c: f"{c[0] or 'single_rank'}-zero{c[1]}-rank{c[2]}")
def test_every_tensor_the_step_makes_is_on_the_models_device(outcomes, case):
    outcome = outcomes[case]
    assert not outcome["off_device"], outcome["off_device"]
    assert outcome["loss_device"] == "cpu" and outcome["grad_devices"] == ["cpu"], outcome
    # The step did make tensors: the gradient seed at least, and receive buffers on pipeline ranks.
    assert "aten.full.default" in outcome["ops"], outcome["ops"]
    if case[0] is not None:
        assert "aten.empty.memory_format" in outcome["ops"], outcome["ops"]
    assert outcome["peak_activation_bytes"] > 0, outcome
