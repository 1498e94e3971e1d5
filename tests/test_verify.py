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


def _all_programs(schedule: str, pp: int, dp: int, zero: int) -> dict:
    """Every rank's program for a pp x dp strategy of the example GPT, planned on a fake process group."""
    from models import reversed_gpipe
    from training import plan_all_ranks

    stages_per_rank = 2 if schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1
    if schedule == "reversed_gpipe":
        pipeline, stages_per_rank = {"schedule": reversed_gpipe}, 1
    else:
        microbatches = 2 * pp if schedule.startswith("dualpipe") else pp
        pipeline = {"schedule": schedule, "microbatches": microbatches}
    options = {"mesh": {"pp": pp, "dp": dp}, "zero": zero, "codegen": "eager", "bucket_mb": 1e-4,
               "pipeline": pipeline}
    programs, _ = plan_all_ranks(options, world=pp * dp, n_layer=pp * stages_per_rank, batch_rows=4 * pp)
    return programs


def _check_programs(schedule: str, pp: int, dp: int, zero: int) -> list[str]:
    from piper_fx.verify import (collective_order_problems, point_to_point_problems,
                                 use_before_definition_problems)

    programs = _all_programs(schedule, pp, dp, zero)
    same_dp_group = lambda rank, name: (rank // dp, name)  # noqa: E731 - one plan names every rank's dp group alike
    problems = point_to_point_problems(programs) + collective_order_problems(programs, same_dp_group)
    for program in programs.values():
        problems += use_before_definition_problems(program)
    return problems


PRESETS = ["gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev", "dualpipe", "reversed_gpipe"]


def test_every_schedules_programs_match_messages_in_order_and_collectives_across_ranks():
    """pp = 2 x dp = 2 with ZeRO-3 (a collective per layer, per microbatch) for every preset and a
    hand-written schedule: every pair of ranks sends and receives the same messages in the same
    order (as NCCL needs), and every process group's ranks issue the same collectives in order."""
    # A process per plan: each makes its own fake process group.
    with multiprocessing.get_context("spawn").Pool(2, maxtasksperchild=1) as pool:
        results = pool.starmap(_check_programs, [(s, 2, 2, 3) for s in PRESETS])
    assert dict(zip(PRESETS, results)) == {s: [] for s in PRESETS}


def _broken_programs() -> dict:
    """One plan's programs, broken by hand in three ways (each undone before the next),
    with what the verifiers say of each."""
    from piper_fx.ir import Recv, Run, Send
    from piper_fx.verify import (collective_order_problems, point_to_point_problems,
                                 use_before_definition_problems)

    programs = _all_programs("1f1b", 2, 2, 3)
    original = {rank: list(program.instructions) for rank, program in programs.items()}

    def swap(program, i, j):
        program.instructions[i], program.instructions[j] = program.instructions[j], program.instructions[i]

    found = {}
    # Rank 0 sends two activations to rank 2 in the other order than rank 2 receives them.
    sends = [i for i, ins in enumerate(programs[0].instructions) if isinstance(ins, Send) and ins.peer == 2]
    swap(programs[0], sends[0], sends[1])
    found["crossed"] = point_to_point_problems(programs)
    programs[0].instructions = list(original[0])
    # Rank 1 (the other replica of stage 0) runs its first backward before its first forward:
    # its ZeRO-3 gathers and reduce-scatters now come in another order than rank 0's.
    runs = [i for i, ins in enumerate(programs[1].instructions) if isinstance(ins, Run)]
    swap(programs[1], runs[0], next(i for i in runs if programs[1].instructions[i].task.startswith("B")))
    found["collectives"] = collective_order_problems(programs, lambda rank, name: (rank // 2, name))
    programs[1].instructions = list(original[1])
    # Rank 2 runs its first task without receiving the activation it reads.
    first_recv = next(i for i, ins in enumerate(programs[2].instructions) if isinstance(ins, Recv))
    del programs[2].instructions[first_recv]
    found["undefined"] = use_before_definition_problems(programs[2])
    return found


def test_hand_broken_programs_are_rejected_naming_the_instruction():
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        found = pool.apply(_broken_programs)
    assert found["crossed"] and found["crossed"][0].startswith("message 0 from rank 0 to rank 2: rank 0 instruction"), found
    assert "sends add" in found["crossed"][0] and "receives add" in found["crossed"][0], found
    assert found["collectives"] and "rank 1 instruction" in found["collectives"][0], found
    assert found["collectives"][0].startswith("group "), found
    assert found["undefined"] and "rank 2 instruction" in found["undefined"][0], found
    assert "before any instruction makes it" in found["undefined"][0], found
