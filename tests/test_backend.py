"""The `piper` backend at world size 1: contract details, dumps, errors."""
import copy
import re
import subprocess
import sys
import weakref

import pytest
import torch

import piper_fx
from examples.gpt import GPT, GPTConfig
from piper_fx import PiperError
from piper_fx.passes import PIPELINE, dump_path
from piper_fx.runtime.step import CompiledStep
from training import SMALL, global_batch

EAGER = {"codegen": "eager"}


def _model(tied=True):
    torch.manual_seed(0)
    return GPT(GPTConfig(**SMALL, tied_embeddings=tied))


def test_backend_name_resolves_through_the_entry_point_without_import():
    code = ("import torch, sys\n"
            "from torch._dynamo.backends.registry import lookup_backend\n"
            "assert 'piper_fx' not in sys.modules\n"
            "print(lookup_backend('piper').__module__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "piper_fx.backend"


@pytest.mark.parametrize("zero", [0, 3])
def test_world_size_one_trains_like_eager(zero):
    model, reference = _model(), _model()
    options = {**EAGER, "zero": zero}
    piper_fx.prepare(model, options)  # a no-op at dp = 1
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    step = torch.compile(model, backend="piper", options=options)
    for i in range(3):
        x, y = global_batch(i, 2, model.cfg)
        loss, ref_loss = step(x, y), reference(x, y)
        loss.backward()
        ref_loss.backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_the_step_is_compiled_on_its_first_call_after_dynamo_has_timed_its_guards(monkeypatch):
    """The backend checks the options and returns; Dynamo then builds the frame's guards and times
    them after flushing the CPU's caches with a 32 MB buffer; only then does the step's first
    call plan and compile it, so no compile is held beside that buffer (`DeferredStep`). Once it
    has, Dynamo's examples (the model's parameters) are let go; its graph is kept, for a step of
    another model of the class (`test_a_second_model_of_the_same_class_gets_a_step_of_its_own`)."""
    import torch._dynamo.guards as guards
    from piper_fx import backend

    events, returned, traced = [], [], []
    profile_guards, compile_step, piper_backend = guards.profile_guard_manager, backend._compile, backend.piper_backend

    def timing_guards(*args):
        events.append("guards timed")
        return profile_guards(*args)

    def compiling(*args):
        events.append("compiled")
        return compile_step(*args)

    def returning(gm, example_inputs, **kwargs):
        traced.append(weakref.ref(gm))
        returned.append(piper_backend(gm, example_inputs, **kwargs))
        events.append("backend returned")
        return returned[-1]

    monkeypatch.setattr(guards, "profile_guard_manager", timing_guards)
    monkeypatch.setattr(backend, "_compile", compiling)
    torch._dynamo.reset()
    model, reference = _model(), _model()
    step = torch.compile(model, backend=returning, options=EAGER)
    x, y = global_batch(0, 2, model.cfg)
    torch.testing.assert_close(step(x, y), reference(x, y), rtol=1e-6, atol=0)
    assert events == ["backend returned", "guards timed", "compiled"]
    assert isinstance(returned[0].step, CompiledStep)
    step(x, y)
    assert events == ["backend returned", "guards timed", "compiled"]  # once
    assert returned[0]._build.first is None and traced[0]() is returned[0]._build.gm
    torch._dynamo.reset()


def test_a_dead_models_step_is_let_go_of_with_it():
    """Dynamo keeps the compiled frame, and with it the step's `DeferredStep`, for models to
    come; the steps of the model called last lived on with it after the model had died."""
    import gc

    returned = []

    def backend(gm, example_inputs):
        returned.append(piper_fx.piper_backend(gm, example_inputs, EAGER))
        return returned[-1]

    torch._dynamo.reset()
    model = _model()
    compiled = torch.compile(model, backend=backend)
    x, y = global_batch(0, 2, model.cfg)
    compiled(x, y).backward()
    step = weakref.ref(returned[0].step)
    del model, compiled
    gc.collect()
    assert step() is None and returned[0].step is None
    torch._dynamo.reset()


def test_the_step_tells_the_models_buffers_from_its_batch_arguments():
    """By Dynamo's sources of the compiled arguments, which Dynamo deletes once it has compiled the
    frame, before the step's first call plans the step: the backend keeps them."""
    from models import ScaledByBuffers, batch
    from piper_fx.ir import InputRole

    returned = []

    def backend(gm, example_inputs):
        returned.append(piper_fx.piper_backend(gm, example_inputs, EAGER))
        return returned[-1]

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = ScaledByBuffers()
    x, y = batch(0, 4)
    torch.compile(model, backend=backend)(x, y).backward()
    inputs = returned[0].step.inputs
    assert sorted(i.fqn for i in inputs if i.role is InputRole.BUFFER) == ["freq", "scale"]
    assert sum(i.role is InputRole.INPUT for i in inputs) == 2  # x and y
    torch._dynamo.reset()


def test_seed_scaling_and_accumulation_follow_autograd():
    model, reference = _model(tied=False), _model(tied=False)
    step = torch.compile(model, backend="piper", options=EAGER)
    x, y = global_batch(0, 2, model.cfg)
    x2, y2 = global_batch(1, 2, model.cfg)
    (3.0 * step(x, y)).backward()
    step(x2, y2).backward()  # a second call before the optimizer step accumulates
    (3.0 * reference(x, y)).backward()
    reference(x2, y2).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)


def test_gradients_reach_parameters_as_autograd_delivers_them():
    """autograd.grad, backward(inputs=...) and gradient hooks see the step's gradients as
    they would an eager model's (plain parameters at world size 1; DTensor ones, whose
    gradients the step adds into `.grad` itself where autograd would, in test_parity)."""
    model, reference = _model(tied=False), _model(tied=False)
    step = torch.compile(model, backend="piper", options=EAGER)
    x, y = global_batch(0, 2, model.cfg)
    params, ref_params = list(model.parameters()), list(reference.parameters())

    grads = torch.autograd.grad(step(x, y), params[:3])
    ref_grads = torch.autograd.grad(reference(x, y), ref_params[:3])
    torch.testing.assert_close(grads, ref_grads, rtol=1e-5, atol=1e-7)
    assert all(p.grad is None for p in params)

    step(x, y).backward(inputs=params[2:5])
    reference(x, y).backward(inputs=ref_params[2:5])
    assert [p.grad is not None for p in params] == [q.grad is not None for q in ref_params]
    assert sum(p.grad is not None for p in params) == 3

    seen = []
    for ps in (params, ref_params):
        for p in ps:
            p.grad = None
        ps[0].register_hook(lambda grad: 2 * grad)
        ps[1].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    step(x, y).backward()
    reference(x, y).backward()
    for (name, p), q in zip(model.named_parameters(), ref_params):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert len(seen) == 2
    torch.testing.assert_close(seen[0], seen[1], rtol=1e-5, atol=1e-7)


def test_inference_under_no_grad_runs_forward_only():
    model = _model()
    step = torch.compile(model, backend="piper", options=EAGER)
    x, y = global_batch(0, 2, model.cfg)
    with torch.no_grad():
        loss = step(x, y)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, model(x, y).detach())
    assert all(p.grad is None for p in model.parameters())


def test_non_scalar_output_is_refused():
    layer = torch.nn.Linear(3, 3)
    with pytest.raises(PiperError, match="scalar loss"):
        torch.compile(layer, backend="piper", options=EAGER)(torch.randn(2, 3))


def test_graph_break_is_refused_with_a_hint():
    layer = torch.nn.Linear(3, 3)

    def broken(x):
        h = layer(x)
        torch._dynamo.graph_break()
        return h.sum()

    # Where Dynamo broke the graph and why, in its own words (the line of `graph_break()` above).
    line = broken.__code__.co_firstlineno + 2
    with pytest.raises(PiperError, match=rf"graph break at {re.escape(__file__)}:{line} \(broken\): Call to "
                                         r"`torch._dynamo.graph_break\(\)`.*fullgraph"):
        torch.compile(broken, backend="piper", options=EAGER)(torch.randn(2, 3))
    # Said before the batch is split into microbatches: a graph that is part of the model may take
    # arguments that do not split (JetMoE's did, and was refused for its shape alone).
    torch._dynamo.reset()
    with pytest.raises(PiperError, match="scalar loss.*fullgraph"):
        torch.compile(broken, backend="piper", options={**EAGER, "pipeline": {"microbatches": 2}})(torch.randn(3, 3))


def test_a_part_of_the_model_compiled_apart_after_a_break_names_dynamos_latest_break():
    """Where Dynamo gives up on an enclosing frame (transformers 5.25's attention under
    activation checkpointing: a side effect in the checkpointed layer), it compiles the modules
    that frame calls as graphs of their own, which end at their return: the error names the
    latest break Dynamo recorded, here one in another function compiled just before."""
    def broken(x):
        torch._dynamo.graph_break()
        return x

    torch.compile(broken, backend="eager")(torch.randn(2))
    line = broken.__code__.co_firstlineno + 1
    with pytest.raises(PiperError, match=rf"Dynamo broke the model's graph at {re.escape(__file__)}:{line} \(broken\) "
                                         r"\(its latest break since torch._dynamo.reset\(\)\): Call to "
                                         r"`torch._dynamo.graph_break\(\)`.*on its own. So the compiled graph"):
        torch.compile(torch.nn.Linear(3, 3), backend="piper", options=EAGER)(torch.randn(2, 3))


class KeepsItsState(torch.nn.Module):
    """A recurrence that keeps its last state on itself, as RecurrentGemma's RG-LRU does."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(3, 3)
        self.state = None

    def forward(self, x):
        state = torch.tanh(self.fc(x))
        self.state = state
        return state.square().mean()


def test_a_tensor_the_model_keeps_from_its_forward_is_the_steps_and_refuses_a_gradient_naming_where_it_is_made():
    """Dynamo returns a tensor stored on a module from the graph, beside the loss, and its code
    stores what the step returns: the module keeps the state one process computes, attached to
    the step's autograd node, and a gradient reaching it names it and the line that made it."""
    torch.manual_seed(0)
    model, reference = KeepsItsState(), KeepsItsState()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 3)
    step = torch.compile(model, backend="piper", options={**EAGER, "pipeline": {"microbatches": 2}})
    step(x).backward()
    reference(x).backward()
    torch.testing.assert_close(model.state, reference.state.detach(), rtol=1e-6, atol=1e-7)
    assert model.state.requires_grad
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    step(x)
    with pytest.raises(PiperError, match=r"output 1 \(state, made at test_backend.py:\d+ in "
                                         r"forward \(state = torch.tanh\(self.fc\(x\)\)\)\)"):
        model.state.sum().backward()


class ReturnsLogits(torch.nn.Module):
    """A classifier returning its loss, its logits and whether each row's guess is right."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)

    def forward(self, x, y):
        logits = self.fc(x)
        return torch.nn.functional.cross_entropy(logits, y), logits, logits.argmax(-1) == y


@pytest.mark.parametrize("microbatches", [1, 2])
def test_outputs_beside_the_loss_are_those_of_one_call_on_the_whole_batch(microbatches):
    """The program handed back the loss alone, and the step returned None for a model's other
    outputs (autograd then refused them: "mark_non_differentiable only accepts variable
    arguments"). Now each comes back as eager PyTorch returns it, the microbatches'
    concatenated along dim 0; the logits, which the model made with a gradient, attached, and a
    gradient reaching them is refused, not dropped."""
    torch.manual_seed(0)
    model, reference = ReturnsLogits(), ReturnsLogits()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    step = torch.compile(model, backend="piper", options={**EAGER, "pipeline": {"microbatches": microbatches}})
    loss, logits, right = step(x, y)
    ref_loss, ref_logits, ref_right = reference(x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(right, ref_right) and logits.requires_grad and not right.requires_grad
    loss.backward()
    ref_loss.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    loss, logits, _ = step(x, y)
    with pytest.raises(PiperError, match=r"output 1 \(logits, made at test_backend.py:\d+ in forward "
                                         r"\(logits = self.fc\(x\)\)\).*differentiates the loss"):
        (loss + logits.square().mean()).backward()
    with torch.no_grad():  # the loss of an evaluation, averaged over microbatches as in training
        for value, expected in zip(step(x, y), reference(x, y)):
            torch.testing.assert_close(value, expected, rtol=1e-6, atol=1e-7)


def test_inference_returns_a_first_output_of_rows_as_one_call_on_the_whole_batch():
    """Under no_grad, an output 0 that is not a scalar is not a loss to average over microbatches
    (the step added the microbatches' logits, and failed on their shapes)."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(4, 4)
    with torch.no_grad():
        logits = torch.compile(layer, backend="piper", options={**EAGER, "pipeline": {"microbatches": 2}})(x)
        torch.testing.assert_close(logits, layer(x), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("microbatches", [1, 2])
def test_a_loss_returned_after_other_outputs_is_the_loss(microbatches):
    """The loss is the model's first floating-point scalar that requires grad, wherever it is
    among its outputs (`outputs.loss_index`); it was refused unless first. A model returning its
    logits, then its loss, trains, its outputs in their order; so does Hugging Face's Llama
    compiled itself with its key and value cache on (as its config has it), whose tensors
    Dynamo returns before the loss: the cache comes back with the model's keys and values."""
    class LogitsFirst(ReturnsLogits):
        def forward(self, x, y):
            loss, logits, right = super().forward(x, y)
            return logits, loss, right

    options = {**EAGER, "pipeline": {"microbatches": microbatches}}
    torch.manual_seed(0)
    model, reference = LogitsFirst(), LogitsFirst()
    reference.load_state_dict(model.state_dict())
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    step = torch.compile(model, backend="piper", options=options)
    (logits, loss, right), (ref_logits, ref_loss, ref_right) = step(x, y), reference(x, y)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=0)
    torch.testing.assert_close(logits, ref_logits.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(right, ref_right)
    loss.backward()
    ref_loss.backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)
    logits, loss, _ = step(x, y)
    with pytest.raises(PiperError, match=r"output 0 \(logits, made at .*differentiates the loss \(output 1\)"):
        (loss + logits.square().mean()).backward()

    from training import llama_batch, tiny_llama

    torch._dynamo.reset()
    torch.manual_seed(0)
    llama, reference = tiny_llama(), tiny_llama()
    reference.load_state_dict(llama.state_dict())
    piper_fx.prepare(llama, options)
    x, y = llama_batch(0, 4)
    out, expected = torch.compile(llama, backend="piper", options=options)(input_ids=x, labels=y), \
        reference(input_ids=x, labels=y)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-6, atol=0)
    layers = [(layer.keys, layer.values) for layer in out.cache.layers]
    assert len(layers) == 2 and all(t.shape == (4, 2, 8, 16) for pair in layers for t in pair)
    torch.testing.assert_close(layers, [(layer.keys.detach(), layer.values.detach()) for layer in expected.cache.layers],
                               rtol=1e-5, atol=1e-6)
    out.loss.backward()
    expected.loss.backward()
    for p, q in zip(llama.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_an_output_a_reduction_over_the_rows_made_is_the_batchs_from_its_microbatches():
    """With microbatches the step returns an output beside the loss as the microbatches'
    concatenated, which needs the microbatch's rows at dim 0. One that a reduction over the
    rows made (an accuracy's mean, a count's sum, a largest logit, whether every guess is
    right) was refused: it is now the microbatches' reduced alike, as one call on the whole
    batch returns it; one that reads no batch argument (a sum of a weight), any microbatch's.
    One of no rows made otherwise (the count's square) has no such whole, and
    is refused naming where the model made it."""
    class Metrics(ReturnsLogits):
        def forward(self, x, y):
            loss, logits, right = super().forward(x, y)
            return (loss, right.float().mean(), right.sum(), logits.amax(dim=(0, 1)), right.all(),
                    logits.sum(0, keepdim=True), self.fc.weight.sum())

    class CountSquared(ReturnsLogits):
        def forward(self, x, y):
            loss, logits, right = super().forward(x, y)
            return loss, right.sum() ** 2

    torch.manual_seed(0)
    model = Metrics()
    x, y = torch.randn(8, 4), torch.tensor([0, 1, 2, 0, 1, 1, 2, 0])
    expected = model(x, y)
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            outputs = torch.compile(model, backend="piper", options={**EAGER, "pipeline": {"microbatches": 4}})(x, y)
        for value, reference in zip(outputs, expected, strict=True):
            assert value.dtype == reference.dtype and value.shape == reference.shape, (value, reference)
            torch.testing.assert_close(value, reference.detach(), rtol=1e-6, atol=1e-7)
        torch._dynamo.reset()
    assert 0 < expected[1].item() < 1 and not expected[4]  # some guesses right, some not
    x, y = x[:4], y[:4]
    with pytest.raises(PiperError, match=r"output 1 \(pow_1, made at test_backend.py:\d+ in forward "
                                         r"\(return loss, right.sum\(\) \*\* 2\)\) has shape \(\) in a "
                                         r"microbatch of \[2\] rows"):
        torch.compile(CountSquared(), backend="piper", options={**EAGER, "pipeline": {"microbatches": 2}})(x, y)
    torch._dynamo.reset()
    loss, count = torch.compile(CountSquared(), backend="piper", options=EAGER)(x, y)  # one microbatch: as it is
    assert count.dim() == 0


def test_a_number_among_the_outputs_is_the_calls():
    """Found with Hugging Face's Gemma 2 compiled itself, its cache on: its sliding-window cache
    keeps its length, a size Dynamo made symbolic once a call changed the sequence's length,
    and Dynamo's graph returns it as a number. Traced at static microbatch sizes, the joint
    graph had it as a constant, and capture failed on it ("'int' object has no attribute
    'name'"). The step returns it at the call's sizes, as one call on the whole batch does
    (`outputs.returned_numbers`), though the program runs microbatches."""
    class CountsTokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 3)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.fc(x).flatten(0, 1), y.flatten()), x.shape[0] * x.shape[1]

    torch.manual_seed(0)
    model = CountsTokens()
    step = torch.compile(model, backend="piper", options={**EAGER, "pipeline": {"microbatches": 2}})
    for tokens in (5, 7, 6):  # a second length makes the tokens' dimension symbolic
        x, y = torch.randn(4, tokens, 4), torch.randint(0, 3, (4, tokens))
        loss, count = step(x, y)
        torch.testing.assert_close(loss, model(x, y)[0], rtol=1e-6, atol=0)
        assert count == 4 * tokens, (tokens, count)


def test_debug_dumps_show_every_stage(tmp_path):
    model = _model()
    step = torch.compile(model, backend="piper", options={**EAGER, "debug_dir": str(tmp_path)})
    x, y = global_batch(0, 2, model.cfg)
    step(x, y).backward()
    (graph_dir,) = (tmp_path / "rank0").iterdir()
    names = {p.relative_to(graph_dir).as_posix() for p in graph_dir.rglob("*") if p.is_file()}
    for expected in ["00_dynamo_graph.py", "01_joint_graph.py", "placement_table.txt", "program.txt",
                     "codegen/F0.py", "codegen/B0.py", "schedule.txt", "schedule.svg", "compile_stats.txt",
                     *(dump_path(index, p.name) for index, p in enumerate(PIPELINE))]:
        assert expected in names, (expected, sorted(names))
    table = (graph_dir / "placement_table.txt").read_text()
    assert "dp:S(0)" in table and "dp:R" in table and "dp:P(" in table
    program = (graph_dir / "program.txt").read_text()
    assert "run   F0.0" in program and "run   B0.0" in program


def test_prepared_model_still_runs_eagerly_and_state_dict_has_original_names():
    model = _model()
    expected = copy.deepcopy(model.state_dict())
    state = piper_fx.full_state_dict(model)
    assert state.keys() == expected.keys()
    for k in expected:
        torch.testing.assert_close(state[k], expected[k])


def test_model_and_batch_on_different_devices_is_refused_when_compiling():
    class MovesItsInput(torch.nn.Module):  # gets through Dynamo: the model itself moves the batch
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.layer(x.to(self.layer.weight.device)).sum()

    model = MovesItsInput().to("meta")
    with pytest.raises(PiperError, match=r"compiled argument \d+ is on device cpu, but the model's parameters "
                                         r"are on meta.*model.to_empty\(device=\.\.\.\) after piper_fx.prepare"):
        torch.compile(model, backend="piper", options=EAGER)(torch.randn(2, 3))


def test_a_frame_dynamic_in_the_batch_compiles_a_step_per_shape_and_warns_past_many():
    """`DeferredStep` for a frame whose batch size Dynamo made symbolic: a step is built for
    each new shape of the call (its size input and its batch) and reused for that shape again;
    past `MANY_SHAPES` shapes each new one warns, as Dynamo warns of recompiles."""
    from piper_fx.backend import MANY_SHAPES, DeferredStep

    built = []

    def build(args, sizes):
        built.append(args[0])
        return lambda *call: (args[0], call[0])  # the step: the size it was built for, and the call's

    deferred = DeferredStep(build, sized=(0, 1))
    sizes = [4, 4, 2, 4, *range(5, 5 + MANY_SHAPES - 2)]  # MANY_SHAPES shapes, 4 of them again
    for size in sizes:
        assert deferred(size, torch.zeros(size, 3)) == (size, size)
    assert built == list(dict.fromkeys(sizes))
    with pytest.warns(UserWarning, match=rf"compiled a step for each of {MANY_SHAPES} batch shapes"):
        deferred(99, torch.zeros(99, 3))
    assert deferred(2, torch.zeros(2, 3)) == (2, 2) and built[-1] == 99 and len(built) == MANY_SHAPES + 1

