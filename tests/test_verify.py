"""The graph verifier: runs after every pass in the test suite and names the pass that broke a graph."""
import os

import pytest
import torch
import torch.fx as fx

from piper_fx.verify import VERIFY_ENV, graph_problems
from ranks import processes


def test_the_test_suite_verifies_every_pass():
    assert os.environ.get(VERIFY_ENV) == "1"  # set by conftest.py, inherited by every spawned rank


def test_planning_verifies_every_pass_unless_told_not_to(monkeypatch):
    """A program the checks refuse can hang every rank (a stage's backward reading a value of a
    stage that runs after it), and they take no measurable planning time: on by default."""
    import piper_fx
    from piper_fx.verify import verification_enabled

    strategy = piper_fx.parse_options({})
    monkeypatch.delenv(VERIFY_ENV)
    assert verification_enabled(strategy)
    monkeypatch.setenv(VERIFY_ENV, "0")
    assert not verification_enabled(strategy)
    assert verification_enabled(piper_fx.parse_options({"debug_dir": "piper_debug"}))


def test_two_inputs_with_one_argument_name_are_rejected():
    """What fusing two tasks that both read a `tanh` made before it was fixed."""
    graph = fx.Graph()
    first, second = graph.placeholder("tanh"), graph.placeholder("tanh")
    graph.output((graph.call_function(torch.add, (first, second)),))
    problems = graph_problems(graph)
    assert "two inputs are the argument 'tanh'" in problems[0], problems
    with pytest.raises(SyntaxError, match="duplicate argument"):  # what the check stands for
        compile(graph.python_code(root_module="self").src, "<graph>", "exec")


@pytest.mark.parametrize("name", ["class", "layer.0.x", "2x"])
def test_an_input_python_cannot_take_as_an_argument_is_rejected(name):
    graph = fx.Graph()
    x = graph.placeholder(name)
    graph.output((graph.call_function(torch.neg, (x,)),))
    problems = graph_problems(graph)
    assert problems == [f"input {x.name} has the argument name {name!r}, which Python rejects"], problems
    with pytest.raises(SyntaxError):
        compile(graph.python_code(root_module="self").src, "<graph>", "exec")
    fine = fx.Graph()
    fine.output((fine.call_function(torch.neg, (fine.placeholder("x"),)),))
    assert graph_problems(fine) == []


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


def _captured_skip_model():
    """The skip model for pp=2 1F1B captured on a fake process group (which the caller
    destroys): (dag, strategy)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import piper_fx
    from models import MODELS, batch
    from piper_fx.capture import capture, keep_input_sources
    from piper_fx.sharding.mesh import dp_group_name

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    options = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    model = MODELS["skip"]()
    piper_fx.prepare(model, options)
    captured = {}

    def keep_graph(gm, example_inputs):
        keep_input_sources(gm)  # as the backend does: Dynamo deletes them once the frame is compiled
        captured.update(gm=gm, example_inputs=example_inputs)
        return gm.forward

    torch.compile(model, backend=keep_graph)(*batch(0, 4))
    strategy = piper_fx.parse_options(options)
    return capture(captured["gm"], captured["example_inputs"], strategy, dp_group_name(strategy)), strategy


def _plan_with(extra_pass) -> tuple[str, list]:
    """Plan the skip model for pp=2 1F1B on a fake process group, with `extra_pass` run
    right after `split_stages`: the verifier's message, or '' if none was raised, and the
    level the DAG was at after each pass, by name."""
    import torch.distributed as dist

    from piper_fx.passes import PIPELINE, position, run_passes, split_stages
    from piper_fx.verify import InvalidGraphError

    try:
        dag, strategy = _captured_skip_model()
        at = position(split_stages) + 1
        levels = []
        try:
            run_passes(dag, strategy, lambda index, name, dag: levels.append((name, dag.level)),
                       PIPELINE[:at] + (extra_pass,) + PIPELINE[at:])
        except InvalidGraphError as e:
            return str(e), levels
        return "", levels
    finally:
        dist.destroy_process_group()


def _keep(dag, strategy):
    return dag


def _forget_tasks(dag, strategy):
    """A broken pass given the staged level: it drops the tasks, leaving the joint level."""
    dag.tasks = []
    return dag


@pytest.fixture(scope="module")
def messages():
    with processes().Pool(1) as pool:  # the fake process group stays in its process
        results = dict(zip(("broken", "sound", "forgets"),
                           pool.map(_plan_with, (_drop_an_input, _keep, _forget_tasks))))
    return {name: message for name, (message, _) in results.items()} | {"levels": results["sound"][1]}


def test_a_pass_that_breaks_a_task_is_named(messages):
    assert messages["broken"].startswith("piper_fx pass '_drop_an_input' left an invalid program"), messages
    assert "task B" in messages["broken"] and "inputs named but the graph takes" in messages["broken"]


def test_the_passes_themselves_leave_valid_programs(messages):
    assert messages["sound"] == ""


def test_each_pass_leaves_the_level_it_declares(messages):
    """The DAG goes joint -> staged -> programs, at the passes `PIPELINE` says convert."""
    from piper_fx.ir import Level
    from piper_fx.passes import PIPELINE

    declared = [(p.name, p.makes) for p in PIPELINE]
    at = [name for name, _ in declared].index("split_stages") + 1
    declared.insert(at, ("_keep", Level.STAGED))  # a bare function rewrites within the level it is given
    assert messages["levels"] == declared
    assert [level for _, level in declared][-1] is Level.PROGRAMS


def test_a_pass_that_leaves_another_level_than_declared_is_named(messages):
    assert messages["forgets"] == ("piper_fx pass '_forget_tasks' should leave a program at the staged level, "
                                   "but left one at the joint level"), messages


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
    import torch

    from piper_fx.ir import ProgramLevel
    from piper_fx.verify import (collective_order_problems, point_to_point_problems,
                                 use_before_definition_problems)

    torch._dynamo.reset()  # the worker planned other schedules of the same model before
    programs = _all_programs(schedule, pp, dp, zero)
    if sorted(programs) != list(range(pp * dp)):
        return [f"planned ranks {sorted(programs)}"]
    same_dp_group = lambda rank, name: (rank // dp, name)  # noqa: E731 - one plan names every rank's dp group alike
    problems = point_to_point_problems(programs) + collective_order_problems(programs, same_dp_group)
    for program in programs.values():
        problems += use_before_definition_problems(program)
    # Every invariant of the program level, over all ranks (so collectives across dp ranks too).
    return problems + ProgramLevel(programs, dp).problems()


PRESETS = ["gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev", "dualpipe", "reversed_gpipe"]


def test_every_schedules_programs_match_messages_in_order_and_collectives_across_ranks():
    """pp = 2 x dp = 2 with ZeRO-3 (a collective per layer, per microbatch) for every preset and a
    hand-written schedule: every pair of ranks sends and receives the same messages in the same
    order (as NCCL needs), and every process group's ranks issue the same collectives in order."""
    # Two processes side by side, each planning one schedule after another, each plan on a fake
    # process group of its own (made and destroyed by `plan_all_ranks`).
    with processes().Pool(2) as pool:
        results = pool.starmap(_check_programs, [(s, 2, 2, 3) for s in PRESETS], chunksize=1)
    assert dict(zip(PRESETS, results)) == {s: [] for s in PRESETS}


def _broken_programs() -> dict:
    """One plan's programs, broken by hand in three ways (each undone before the next),
    with what the verifiers say of each."""
    from piper_fx.ir import ProgramLevel, Recv, Run, Send
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
    # The same, through the program level's `verify()`.
    found["collectives_level"] = _rejection(ProgramLevel(programs, dp=2))
    programs[1].instructions = list(original[1])
    # Rank 2 runs its first task without receiving the activation it reads.
    first_recv = next(i for i, ins in enumerate(programs[2].instructions) if isinstance(ins, Recv))
    del programs[2].instructions[first_recv]
    found["undefined"] = use_before_definition_problems(programs[2])
    found["undefined_level"] = _rejection(ProgramLevel(programs, dp=2))
    programs[2].instructions = list(original[2])
    # Rank 0 sends rank 2 one more message, which rank 2 never receives.
    last_send = [ins for ins in programs[0].instructions if isinstance(ins, Send) and ins.peer == 2][-1]
    programs[0].instructions.append(last_send)
    found["unmatched"] = _rejection(ProgramLevel(programs, dp=2))
    found["unmatched_at"] = len(programs[0].instructions) - 1
    programs[0].instructions = list(original[0])
    found["sound"] = ProgramLevel(programs, dp=2).problems()
    return found


def _rejection(level) -> str:
    """What `level.verify()` raises, or '' if it accepts the program."""
    from piper_fx.verify import InvalidGraphError

    try:
        level.verify()
    except InvalidGraphError as e:
        return str(e)
    return ""


def _program_freeing_a_sum() -> dict:
    """DDP (ZeRO-0) with 2 microbatches sums each gradient over them and all-reduces the sum
    once, in the epilogue E0. Rank 0 runs E0 before its last backward by hand: E0 reads the
    partial sum, the last reader, so the sum is freed and B0.1 adds to a freed value."""
    from piper_fx.ir import ProgramLevel, Run
    from piper_fx.verify import freed_value_problems

    programs = _all_programs("1f1b", 2, 2, 0)
    program = programs[0]
    runs = {ins.label: i for i, ins in enumerate(program.instructions) if isinstance(ins, Run)}
    sound = freed_value_problems(program)
    epilogue = program.instructions.pop(runs["E0"])
    program.instructions.insert(runs["B0.1"], epilogue)
    return {"sound": sound, "problems": freed_value_problems(program),
            "message": _rejection(ProgramLevel(programs, dp=2)), "at": runs["B0.1"] + 1}


@pytest.fixture(scope="module")
def broken_programs():
    with processes().Pool(2, maxtasksperchild=1) as pool:
        found, freeing = pool.apply_async(_broken_programs), pool.apply_async(_program_freeing_a_sum)
        return found.get(), freeing.get()


def test_hand_broken_programs_are_rejected_naming_the_instruction(broken_programs):
    found, _ = broken_programs
    assert found["crossed"] and found["crossed"][0].startswith("message 0 from rank 0 to rank 2: rank 0 instruction"), found
    assert "sends add" in found["crossed"][0] and "receives add" in found["crossed"][0], found
    assert found["collectives"] and "rank 1 instruction" in found["collectives"][0], found
    assert found["collectives"][0].startswith("group "), found
    assert found["undefined"] and "rank 2 instruction" in found["undefined"][0], found
    assert "before any instruction makes it" in found["undefined"][0], found


def test_the_program_levels_verify_rejects_them_naming_the_instruction(broken_programs):
    """An unmatched send, a collective out of order on one rank, a use before definition:
    `ProgramLevel.verify()` raises for each, naming the level and the instruction."""
    found, _ = broken_programs
    assert found["sound"] == [], found["sound"]
    for case in ("unmatched", "collectives_level", "undefined_level"):
        assert found[case].startswith("invalid program at the program level:"), (case, found[case])
    assert f"rank 0 instruction {found['unmatched_at']} (send " in found["unmatched"], found["unmatched"]
    assert "is send" in found["unmatched"] and "which receives only" in found["unmatched"], found["unmatched"]
    assert "rank 1 instruction" in found["collectives_level"] and "group " in found["collectives_level"]
    assert "rank 2 instruction" in found["undefined_level"], found["undefined_level"]
    assert "before any instruction makes it" in found["undefined_level"], found["undefined_level"]


def test_adding_to_a_freed_sum_is_rejected_naming_the_instruction(broken_programs):
    _, freeing = broken_programs
    assert freeing["sound"] == []
    assert freeing["problems"], freeing
    problem = freeing["problems"][0]
    assert problem.startswith(f"rank 0 instruction {freeing['at']} (run   B0.1) adds to "), problem
    assert f"freed after instruction {freeing['at'] - 1} (run   E0)" in problem, problem
    assert problem in freeing["message"] and "at the program level" in freeing["message"], freeing


def _broken_levels() -> dict:
    """The skip model's joint graph and staged tasks, each broken by hand (and undone),
    with what each level's `verify()` raises: a dict of messages ('' for a sound one)."""
    import torch.distributed as dist

    from piper_fx.ir import JointLevel, StagedLevel
    from piper_fx.passes import PIPELINE, position, run_passes, split_stages

    found = {}
    try:
        captured, strategy = _captured_skip_model()
        dag = captured.copy()
        found["joint_sound"] = _rejection(JointLevel(dag))
        # A use before definition: an op moved before the op whose value it reads.
        ops = [n for n in dag.joint.graph.nodes if n.op == "call_function"]
        reader = next(n for n in ops if any(i.op == "call_function" for i in n.all_input_nodes))
        read = next(i for i in reader.all_input_nodes if i.op == "call_function")
        read.prepend(reader)
        found["joint_undefined"] = _rejection(JointLevel(dag))
        found["joint_nodes"] = (reader.name, read.name)
        read.append(reader)
        # The DAG describes an output the graph does not return.
        dag.outputs[0].name = "nothing"
        found["joint_output"] = _rejection(JointLevel(dag))
        dag.refresh_output_names()

        dag = run_passes(captured.copy(), strategy, lambda *_: None, PIPELINE[:position(split_stages) + 1])
        found["staged_sound"] = _rejection(StagedLevel(dag))
        tasks = {t.name: t for t in dag.tasks}
        # The second stage's forward reads a value of its own backward.
        f1, b1 = tasks["F1"], tasks["B1"]
        original = list(f1.inputs)
        f1.inputs[0] = b1.outputs[0]
        found["staged_backward_read"] = _rejection(StagedLevel(dag))
        found["staged_value"] = b1.outputs[0]
        f1.inputs = original
        # The first stage's forward is lost: the second reads values nothing makes.
        dag.tasks.remove(tasks["F0"])
        found["staged_undefined"] = _rejection(StagedLevel(dag))
        return found
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def broken_levels():
    with processes().Pool(1) as pool:
        return pool.apply(_broken_levels)


def test_the_joint_levels_verify_rejects_a_use_before_definition_naming_the_node(broken_levels):
    assert broken_levels["joint_sound"] == ""
    message = broken_levels["joint_undefined"]
    reader, read = broken_levels["joint_nodes"]
    assert message.startswith("invalid program at the joint level:\n  joint graph: lint"), message
    assert reader in message and read in message, message
    assert "output nothing (loss 0) is described, but the graph returns" in broken_levels["joint_output"]


def test_the_staged_levels_verify_rejects_reads_against_the_schedule_naming_the_task(broken_levels):
    assert broken_levels["staged_sound"] == ""
    message = broken_levels["staged_backward_read"]
    assert message.startswith("invalid program at the staged level:"), message
    assert (f"task F1 reads {broken_levels['staged_value']}, made by task B1, which does not run before it"
            in message), message
    message = broken_levels["staged_undefined"]
    assert "task F1 reads" in message and "which no task makes and no step input is" in message, message
    assert "action F0.0 of pipeline rank 0 has no task F0" in message, message
