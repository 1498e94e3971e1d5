"""The graph verifier: runs after every pass in the test suite and names the pass that broke a graph."""
import multiprocessing
import os

import pytest
import torch
import torch.fx as fx

from piper_fx.verify import VERIFY_ENV, graph_problems


def test_the_test_suite_verifies_every_pass():
    assert os.environ.get(VERIFY_ENV) == "1"  # set by conftest.py, inherited by every spawned rank


def test_two_inputs_with_one_argument_name_are_rejected():
    """What fusing two tasks that both read a `tanh` made before it was fixed."""
    graph = fx.Graph()
    first, second = graph.placeholder("tanh"), graph.placeholder("tanh")
    graph.output((graph.call_function(torch.add, (first, second)),))
    problems = graph_problems(graph)
    assert "two inputs are the argument 'tanh'" in problems[0], problems


def test_a_value_read_before_it_is_defined_is_rejected():
    graph = fx.Graph()
    x = graph.placeholder("x")
    negated = graph.call_function(torch.neg, (x,))
    result = graph.call_function(torch.relu, (negated,))
    graph.output((result,))
    negated.prepend(result)  # `result` now runs first, reading `negated` before it exists
    problems = graph_problems(graph)
    assert problems and "lint" in problems[0] and "neg" in problems[0], problems


def _drop_an_input(dag, strategy):
    """A broken pass: the first backward task forgets one of its inputs."""
    task = next(t for t in dag.tasks if t.name.startswith("B"))
    task.inputs = task.inputs[1:]
    return dag


def _plan_with(extra_pass) -> str:
    """Plan the skip model for pp=2 1F1B on a fake process group, with `extra_pass` run
    right after `split_stages`; the verifier's message, or '' if none was raised."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import piper_fx
    from models import MODELS, batch
    from piper_fx.capture import capture
    from piper_fx.passes import PIPELINE, run_passes, split_stages
    from piper_fx.sharding.mesh import dp_group_name
    from piper_fx.verify import InvalidGraphError

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        options = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"schedule": "1f1b", "microbatches": 2}}
        model = MODELS["skip"]()
        piper_fx.prepare(model, options)
        captured = {}

        def keep_graph(gm, example_inputs):
            captured.update(gm=gm, example_inputs=example_inputs)
            return gm.forward

        torch.compile(model, backend=keep_graph)(*batch(0, 4))
        strategy = piper_fx.parse_options(options)
        dag = capture(captured["gm"], captured["example_inputs"], strategy, dp_group_name(strategy))
        at = PIPELINE.index(split_stages) + 1
        try:
            run_passes(dag, strategy, lambda *_: None, PIPELINE[:at] + (extra_pass,) + PIPELINE[at:])
        except InvalidGraphError as e:
            return str(e)
        return ""
    finally:
        dist.destroy_process_group()


def _keep(dag, strategy):
    return dag


@pytest.fixture(scope="module")
def messages():
    with multiprocessing.get_context("spawn").Pool(1) as pool:  # the fake process group stays in its process
        return dict(zip(("broken", "sound"), pool.map(_plan_with, (_drop_an_input, _keep))))


def test_a_pass_that_breaks_a_task_is_named(messages):
    assert messages["broken"].startswith("piper_fx pass '_drop_an_input' left an invalid program"), messages
    assert "task B" in messages["broken"] and "inputs named but the graph takes" in messages["broken"]


def test_the_passes_themselves_leave_valid_programs(messages):
    assert messages["sound"] == ""
