"""Dropout under piper_fx equals single-device training of the global batch, however it is split.

Random ops are made counter-based (`passes.functionalize_random`, `piper_fx.philox`):
the mask of sample s is the same whichever microbatch, replica or pipeline rank
draws it. The reference is piper_fx itself at world 1 with one microbatch, not
eager PyTorch: eager dropout draws from torch's generator in its own order
(neither does torch.compile's Inductor reproduce eager's random values), so
only a counter-based run can equal a split one value for value.
"""
import math

import pytest
import torch
import torch.distributed as dist

import piper_fx
from piper_fx import PiperError
from piper_fx.philox import StepRandomness, Stream, philox4x32, stream_state, uniform

LOSS_RTOL = 1e-5
PARAM_RTOL = 1e-5
P = 0.1
STEPS = 3
BATCH = 8  # global batch rows
SIZES = [8, 4, 8]  # global batch rows, step by step, where the batch changes size


def dropout_worker(rank: int, world: int, configs: list[dict]) -> list[dict]:
    """Train the dropout GPT with SGD for each config ({"options", "p"}) on this rank's share
    of the global batch: the global loss of each step, (rank 0) the final full parameters, and
    how many steps the model's random stream drew. With "repeat", the same batch and parameters
    twice (no optimizer step): the two losses. With "sizes", step i's global batch has that many
    rows (each new size compiles a step of its own)."""
    from models import DropoutGPT, DropoutMLP, NoisyMLP, batch
    from training import global_batch, make_optimizer

    results = []
    for config in configs:
        torch._dynamo.reset()  # p is specialized: a new model must not reuse the last one's code
        options = {"codegen": "eager", **config["options"]}
        torch.manual_seed(0)  # also fixes the dropout seed, drawn when the step is compiled
        mlp = config.get("model") in ("mlp", "noisy")
        model = DropoutGPT(config.get("p", P), regions=True) if not mlp else \
            NoisyMLP() if config["model"] == "noisy" else DropoutMLP(config.get("p", P))
        batch_of = batch if mlp else (lambda i, rows: global_batch(i, rows, model.gpt.cfg))
        piper_fx.prepare(model, options)
        opt = make_optimizer("sgd", model.parameters())
        step = torch.compile(model, backend="piper", options=options)
        mesh = options.get("mesh", {})
        dp = mesh.get("dp", world // mesh.get("pp", 1))
        losses = []
        sizes = config.get("sizes", [BATCH] * (STEPS if not config.get("repeat") else 2))
        for i, rows in enumerate(sizes):
            x, y = batch_of(0 if config.get("repeat") else i, rows)
            loss = step(x.chunk(dp)[rank % dp], y.chunk(dp)[rank % dp])
            loss.backward()
            if not config.get("repeat"):
                opt.step()
            opt.zero_grad()
            mean = loss.detach().clone()
            if world > 1:  # every pipeline rank returns its replica's loss
                dist.all_reduce(mean)
                mean /= world
            losses.append(mean.item())
        state = {name: t.numpy().copy() for name, t in piper_fx.full_state_dict(model).items()}
        results.append({"losses": losses, "state": state if rank == 0 else None,
                        "stream_steps": (stream_state(list(model.parameters())) or (None, 0))[1]})
    return results


def _values(pool, world, configs):
    outcomes = pool.run(dropout_worker, configs, deadline_s=300)
    assert all("value" in o for o in outcomes), [o.get("error") for o in outcomes]
    losses = [o["value"] for o in outcomes]
    for rank_results in losses[1:]:  # every rank reports the same global losses
        for mine, first in zip(rank_results, losses[0]):
            assert mine["losses"] == first["losses"]
    return losses[0]


def _assert_equal(run: dict, reference: dict, label: str) -> None:
    for step, (loss, expected) in enumerate(zip(run["losses"], reference["losses"])):
        assert abs(loss - expected) <= LOSS_RTOL * abs(expected), (label, step, loss, expected)
    for name, expected in reference["state"].items():
        error = abs(run["state"][name] - expected).max() / max(abs(expected).max(), 1e-12)
        assert error < PARAM_RTOL, (label, name, error)


def test_dropout_matches_single_device_training(rank_pools):
    reference, no_dropout, microbatches, repeated, mlp, mlp_inductor, resized = _values(rank_pools(1), 1, [
        {"options": {}},
        {"options": {}, "p": 0.0},
        {"options": {"pipeline": {"microbatches": 4}}},
        {"options": {}, "repeat": True},
        {"options": {}, "model": "mlp"},
        {"options": {"codegen": "inductor", "pipeline": {"microbatches": 2}}, "model": "mlp"},
        {"options": {}, "sizes": SIZES},
    ])
    # Dropout acts, and each step draws new masks (the same batch and parameters, another loss).
    assert all(abs(a - b) > 1e-4 for a, b in zip(reference["losses"], no_dropout["losses"]))
    assert abs(repeated["losses"][0] - repeated["losses"][1]) > 1e-4, repeated["losses"]
    assert repeated["losses"][0] == reference["losses"][0]
    _assert_equal(microbatches, reference, "world 1, 4 microbatches")
    # Inductor's capture decomposes dropout into rand > p: it compiles the integer Philox ops
    # and draws the masks eager ATen does (a small model: Inductor compiles slowly on 2 cores).
    _assert_equal(mlp_inductor, mlp, "MLP, world 1, inductor, 2 microbatches")

    zero1, one_f_one_b, one_f_one_b_resized = _values(rank_pools(2), 2, [
        {"options": {"mesh": {"dp": 2}, "zero": 1}},
        {"options": {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 4}}},
        {"options": {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}, "sizes": SIZES},
    ])
    _assert_equal(zero1, reference, "dp2 ZeRO-1")
    _assert_equal(one_f_one_b, reference, "pp2 1F1B, 4 microbatches")
    # A step compiled for each batch size, all drawing from the model's one stream: each step
    # draws anew (a new stream per compile drew step 0's masks again).
    assert resized["stream_steps"] == one_f_one_b_resized["stream_steps"] == len(SIZES), (resized, one_f_one_b_resized)
    _assert_equal(one_f_one_b_resized, resized, "pp2 1F1B, 2 microbatches, batches of 8, 4 and 8 rows")


def test_dropout_matches_under_pipeline_and_data_parallel_together(rank_pools):
    reference, both = _values(rank_pools(1), 1, [{"options": {}}]), _values(rank_pools(4), 4, [
        {"options": {"mesh": {"pp": 2, "dp": 2}, "zero": 1, "pipeline": {"schedule": "1f1b", "microbatches": 2}}},
    ])
    _assert_equal(both[0], reference[0], "pp2 x dp2 ZeRO-1 1F1B")


def test_noise_drawn_in_place_matches_single_device_training(rank_pools):
    """Found probing Hugging Face models: PhiMoE samples its experts with Gumbel noise
    (`exponential_`), and planning refused it ("exponential is the random op
    aten.exponential.default, which piper_fx cannot make reproducible"); Mixtral's router
    jitter (`uniform_`) and `normal_` noise met the same. Each is now a transform of the
    counter-based values (`functionalize_random.TRANSFORMED`)."""
    noisy = {"model": "noisy"}
    reference, repeated, microbatches, inductor = _values(rank_pools(1), 1, [
        {"options": {}, **noisy},
        {"options": {}, "repeat": True, **noisy},
        {"options": {"pipeline": {"microbatches": 4}}, **noisy},
        {"options": {"codegen": "inductor", "pipeline": {"microbatches": 2}}, **noisy},
    ])
    assert abs(repeated["losses"][0] - repeated["losses"][1]) > 1e-6, repeated["losses"]  # each step draws anew
    _assert_equal(microbatches, reference, "noisy MLP, world 1, 4 microbatches")
    _assert_equal(inductor, reference, "noisy MLP, world 1, inductor, 2 microbatches")
    zero1, one_f_one_b = _values(rank_pools(2), 2, [
        {"options": {"mesh": {"dp": 2}, "zero": 1}, **noisy},
        {"options": {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 4}}, **noisy},
    ])
    _assert_equal(zero1, reference, "noisy MLP, dp2 ZeRO-1")
    _assert_equal(one_f_one_b, reference, "noisy MLP, pp2 1F1B, 4 microbatches")


def test_noise_drawn_in_place_has_its_distribution():
    """The transforms of `functionalize_random` on counter-based values: uniform on [a, b),
    exponential of rate λ (mean 1/λ), normal and log-normal of the given mean and deviation."""
    from piper_fx.passes.functionalize_random import _exponential, _normal_with, _uniform_between
    from piper_fx.philox import normal

    (rng,) = StepRandomness(Stream(7), samples_per_microbatch=1, first_sample=0,
                            device=torch.device("cpu")).next_inputs(microbatches=1)
    u = uniform(rng, torch.tensor(0), shape=(200_000,), per_sample=1, dtype=torch.float32)
    n = normal(rng, torch.tensor(1), shape=(200_000,), per_sample=1, dtype=torch.float32)
    between = _uniform_between(u, low=0.9, high=1.1, dtype=torch.float32)
    assert 0.9 <= between.min() and between.max() < 1.1 and abs(between.mean().item() - 1.0) < 1e-3
    exponential = _exponential(u, rate=4.0, dtype=torch.float32)
    assert exponential.min() >= 0 and abs(exponential.mean().item() - 0.25) < 0.005
    assert abs((exponential > 0.25).float().mean().item() - math.exp(-1.0)) < 0.005  # P(X > 1/λ) = 1/e
    shifted = _normal_with(n, mean=2.0, std=0.5, log=False, dtype=torch.float32)
    assert abs(shifted.mean().item() - 2.0) < 0.01 and abs(shifted.std().item() - 0.5) < 0.01
    about = _normal_with(n, torch.full((200_000,), -1.0), mean=None, std=0.5, log=False, dtype=torch.float32)
    assert abs(about.mean().item() + 1.0) < 0.01
    log_normal = _normal_with(n, mean=0.0, std=0.25, log=True, dtype=torch.float32)
    assert abs(log_normal.log().std().item() - 0.25) < 0.01 and log_normal.min() > 0


def test_a_random_op_it_cannot_draw_is_an_error_naming_it():
    from models import DropoutMLP, batch

    from piper_fx.capture import capture, keep_input_sources
    from piper_fx.passes.functionalize_random import functionalize_random

    class CauchyNoise(DropoutMLP):
        def forward(self, x, y):
            h = self.fc(x)
            return torch.nn.functional.mse_loss(self.out(h + torch.empty_like(h).cauchy_()), y)

    strategy = piper_fx.parse_options({"codegen": "eager"})

    def backend(gm, example_inputs):
        keep_input_sources(gm)
        functionalize_random(capture(gm, example_inputs, strategy, None), strategy)
        return gm.forward

    torch._dynamo.reset()
    with pytest.raises(PiperError, match=r"cauchy is the random op aten.cauchy.default, which piper_fx cannot"):
        torch.compile(CauchyNoise(), backend=backend)(*batch(0, 4))


def test_philox_known_answers():
    """Random123's known-answer vectors for Philox-4x32-10, on Python ints and on tensors."""
    cases = [([0, 0, 0, 0], [0, 0], [0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8]),
             ([0xffffffff] * 4, [0xffffffff] * 2, [0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd]),
             ([0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344], [0xa4093822, 0x299f31d0],
              [0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1])]
    for counter, key, expected in cases:
        assert philox4x32(counter, key) == expected
        as_tensors = philox4x32([torch.tensor(c) for c in counter], [torch.tensor(k) for k in key])
        assert [int(t) for t in as_tensors] == expected


def test_uniform_values_depend_only_on_the_global_sample():
    """A microbatch's values are the rows of the whole batch's that its samples have; they are
    uniform on [0, 1) and differ between ops and steps."""
    stream = StepRandomness(Stream(12345, step=3), samples_per_microbatch=8, first_sample=0, device=torch.device("cpu"))
    (whole,) = stream.next_inputs(microbatches=1)
    full = uniform(whole, torch.tensor(2), shape=(8, 5, 7), per_sample=35, dtype=torch.float32)
    split = StepRandomness(Stream(12345, step=3), samples_per_microbatch=2, first_sample=0, device=torch.device("cpu"))
    parts = [uniform(rng, torch.tensor(2), shape=(2, 5, 7), per_sample=35, dtype=torch.float32)
             for rng in split.next_inputs(microbatches=4)]
    assert torch.equal(torch.cat(parts), full)
    assert not torch.equal(uniform(whole, torch.tensor(3), shape=(8, 5, 7), per_sample=35, dtype=torch.float32), full)
    (next_step,) = stream.next_inputs(microbatches=1)  # step 4
    assert not torch.equal(uniform(next_step, torch.tensor(2), shape=(8, 5, 7), per_sample=35,
                                   dtype=torch.float32), full)
    many = uniform(whole, torch.tensor(0), shape=(200_000,), per_sample=1, dtype=torch.float32)
    assert 0.0 <= many.min() and many.max() < 1.0
    assert abs(many.mean().item() - 0.5) < 0.005 and abs((many > 0.1).float().mean().item() - 0.9) < 0.005


def _captured(p: float):
    """The dropout GPT's joint graph (world 1), before and after `functionalize_random`."""
    from models import DropoutGPT
    from training import global_batch

    from piper_fx.capture import capture, keep_input_sources
    from piper_fx.passes.functionalize_random import functionalize_random

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = DropoutGPT(p)
    strategy = piper_fx.parse_options({"codegen": "eager"})
    graphs = {}

    def backend(gm, example_inputs):
        keep_input_sources(gm)
        dag = capture(gm, example_inputs, strategy, None)
        graphs["before"] = dag.joint.code
        graphs["dag"] = functionalize_random(dag, strategy)
        return gm.forward

    torch.compile(model, backend=backend)(*global_batch(0, 4, model.gpt.cfg))
    return graphs["before"], graphs["dag"]


def test_random_ops_become_philox_of_a_per_microbatch_input():
    from piper_fx.ir import InputRole

    _, dag = _captured(P)  # (Inductor's capture, with rand for dropout: the parity test's inductor case)
    assert [i.role for i in dag.inputs].count(InputRole.RNG) == 1
    ops = {n.target for n in dag.joint.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.native_dropout.default not in ops
    # Without dropout the graph is left as captured, with no new input.
    before, dag = _captured(0.0)
    assert dag.joint.code == before and InputRole.RNG not in {i.role for i in dag.inputs}


def test_compiling_leaves_the_global_random_stream_where_it_was():
    """The step draws its dropout seed from torch's generator when it is compiled (on its
    first call) and puts the generator back, as Dynamo does around a backend: the
    stream a training loop draws from (shuffling, noise) runs on as it would without it, and
    the same seed before compiling still gives the same dropout."""
    from models import DropoutMLP, batch

    def first_step_then_draw(seed: int):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = DropoutMLP(P)
        step = torch.compile(model, backend="piper", options={"codegen": "eager"})
        x, y = batch(0, BATCH)
        torch.manual_seed(seed)
        loss = step(x, y)
        return loss.detach(), torch.rand(4)

    torch.manual_seed(1)
    expected = torch.rand(4)
    loss, drawn = first_step_then_draw(1)
    torch.testing.assert_close(drawn, expected, rtol=0, atol=0)
    again, _ = first_step_then_draw(1)
    other, _ = first_step_then_draw(2)
    assert torch.equal(loss, again) and not torch.equal(loss, other)  # the seed still comes from the stream
    torch._dynamo.reset()
