"""The invariants of each level of a program, checked after every pass.

A pass that breaks a program (a value read before it is defined, two inputs of
a task with one argument name, a send no peer receives) would otherwise fail
much later, inside codegen or a task's run on some rank, far from its cause.
A program is at one of three levels (`ir.Level`; ARCHITECTURE.md), each a
class in `ir.py` whose docstring lists its invariants and whose `verify()`
raises `InvalidGraphError` with what this module finds wrong:

  - `joint_problems`: the joint graph with placements (`ir.JointLevel`);
  - `staged_problems`: the stage tasks and their schedule (`ir.StagedLevel`);
  - `program_problems`: the rank programs (`ir.ProgramLevel`), built from
    `use_before_definition_problems`, `freed_value_problems`,
    `point_to_point_problems` and `collective_order_problems`.

`passes.run_passes` checks, after every pass, that it left the level it
declares and runs `verify_dag`: that level's checks, naming the pass. They
cost little beside planning (a pp 2 x dp 2 plan of 8 layers took 2.8-3.0 s
with them and without), and a program they would refuse can hang every rank
(a value a stage's backward reads from a stage that runs after it), so they
run unless the environment sets `PIPER_VERIFY=0`; a `debug_dir` runs them
whatever it says.
Every problem names the node, task or instruction at fault (values as
`ir.value_label` prints them).

Collectives in the same order on every rank of a group can only be checked
with the programs of every rank of the group, which one rank's plan does not
hold (it holds its own replica's pipeline), so planning tests check the
programs of all ranks together (`ir.ProgramLevel` over them).
"""
from __future__ import annotations

import keyword
import os
from typing import Callable, Hashable, Iterable, Sequence

import torch.fx as fx

from .ir import BACKWARD_KINDS, Level, RankProgram, Recv, Run, Send, TaskKind, TrainingDAG, value_label
from .ops import collective_group, collective_kind, collective_sends
from .options import Strategy
from .schedules import ScheduleError, validate
from .sharding.specs import SPEC_KEY

VERIFY_ENV = "PIPER_VERIFY"

Key = tuple[str, "int | None"]  # a value of a rank program: (name, microbatch), as `RankProgram.key` makes it


class InvalidGraphError(RuntimeError):
    """A pass left a graph that is not a valid program: a bug in piper_fx, not in the model.
    `problems` lists what is wrong, one line each."""

    def __init__(self, message: str, problems: Sequence[str] = ()):
        super().__init__(message)
        self.problems = list(problems)


def raise_if_invalid(problems: list[str], level: Level, after_pass: str | None = None) -> None:
    """Raise `InvalidGraphError` listing `problems`, if any, of a program at `level`,
    naming `after_pass`, the pass that left it."""
    if not problems:
        return
    where = f"piper_fx pass {after_pass!r} left an invalid program" if after_pass else "invalid program"
    raise InvalidGraphError(f"{where} at the {level}:\n  " + "\n  ".join(problems), problems)


def verification_enabled(strategy: Strategy) -> bool:
    """Whether planning verifies every pass's output: unless `PIPER_VERIFY=0`, or with a `debug_dir`."""
    return strategy.debug_dir is not None or os.environ.get(VERIFY_ENV, "1") != "0"


def graph_problems(graph: fx.Graph) -> list[str]:
    """What is wrong with `graph`: [] when its node names are unique, its inputs are
    distinct Python argument names, and every node reads only nodes of this graph defined
    before it (FX's lint). Then its generated Python compiles: FX names every value itself
    but takes each input's argument name as it is (two fused tasks both reading a `tanh`
    once made a function with two arguments `tanh`). Generating the code to compile it
    cost most of verifying a program."""
    problems = []
    seen_names: set[str] = set()
    seen_arguments: set[str] = set()
    for node in graph.nodes:
        if node.name in seen_names:
            problems.append(f"two nodes are named {node.name!r}")
        seen_names.add(node.name)
        if node.op == "placeholder":
            argument = str(node.target).lstrip("*")  # `*args` and `**kwargs` take their stars
            if argument in seen_arguments:
                problems.append(f"two inputs are the argument {argument!r}")
            elif not argument.isidentifier() or keyword.iskeyword(argument):
                problems.append(f"input {node.name} has the argument name {node.target!r}, which Python rejects")
            seen_arguments.add(argument)
    try:
        graph.lint()
    except Exception as e:  # noqa: BLE001 - lint raises plain RuntimeErrors with the node named
        problems.append(f"lint: {e}")
    return problems


def _task_problems(task) -> list[str]:
    problems = graph_problems(task.graph.graph)
    placeholders = task.graph.graph.find_nodes(op="placeholder")
    if len(placeholders) != len(task.inputs):
        problems.append(f"{len(task.inputs)} inputs named but the graph takes {len(placeholders)}")
    returned = task.graph.graph.find_nodes(op="output")[0].args[0]
    if len(returned) != len(task.outputs):
        problems.append(f"{len(task.outputs)} outputs named but the graph returns {len(returned)}")
    return problems


def _at(program: RankProgram, index: int) -> str:
    return f"instruction {index} ({str(program.instructions[index]).strip()})"


def _instruction(program: RankProgram, index: int) -> str:
    return f"rank {program.rank} {_at(program, index)}"


def use_before_definition_problems(program: RankProgram) -> list[str]:
    """Each read of a value (by a run, a send, or a receive adding into it) that no input
    or earlier instruction of `program` defines."""
    defined: set[tuple[str, int | None]] = set()
    for name in program.inputs:
        if name in program.per_step:
            defined.add((name, None))
        else:
            defined.update((name, m) for m in range(program.num_microbatches))
    problems = []
    for index, instruction in enumerate(program.instructions):
        if isinstance(instruction, Run):
            reads = [(name, run.microbatch) for run in instruction.runs for name in program.tasks[run.task].inputs]
        elif isinstance(instruction, Send):
            reads = [(instruction.value, instruction.microbatch)]
        else:
            reads = []
        for name, microbatch in reads:
            if program.key(name, microbatch) not in defined:
                problems.append(f"{_instruction(program, index)} reads {value_label(name, microbatch)} before any "
                                "instruction makes it")
        if isinstance(instruction, Run):
            for run in instruction.runs:
                defined.update(program.key(name, run.microbatch) for name in program.tasks[run.task].outputs)
        elif isinstance(instruction, Recv):
            defined.add(program.key(instruction.value, instruction.microbatch))
    return problems


def point_to_point_problems(programs: dict[int, RankProgram]) -> list[str]:
    """Between every two ranks both in `programs`: the messages one sends the other and those
    the other receives from it, compared in issue order. NCCL matches point-to-point
    messages by their order on each side (tags are ignored), so they must be the same
    values in the same order, not merely the same set."""
    sent: dict[tuple[int, int], list[tuple[int, Send]]] = {}
    received: dict[tuple[int, int], list[tuple[int, Recv]]] = {}
    for rank, program in programs.items():
        for index, instruction in enumerate(program.instructions):
            if isinstance(instruction, Send):
                sent.setdefault((rank, instruction.peer), []).append((index, instruction))
            elif isinstance(instruction, Recv):
                received.setdefault((instruction.peer, rank), []).append((index, instruction))
    problems = []
    for src, dst in sorted(set(sent) | set(received)):
        if src not in programs or dst not in programs:
            continue
        sends, recvs = sent.get((src, dst), []), received.get((src, dst), [])
        for k in range(max(len(sends), len(recvs))):
            if k >= len(sends):
                problems.append(f"{_instruction(programs[dst], recvs[k][0])} is receive {k} from rank {src}, "
                                f"which sends rank {dst} only {len(sends)} messages")
            elif k >= len(recvs):
                problems.append(f"{_instruction(programs[src], sends[k][0])} is send {k} to rank {dst}, "
                                f"which receives only {len(recvs)} messages from rank {src}")
            else:
                (i, send), (j, recv) = sends[k], recvs[k]
                if (send.value, send.microbatch) != (recv.value, recv.microbatch):
                    problems.append(f"message {k} from rank {src} to rank {dst}: {_instruction(programs[src], i)} "
                                    f"sends {value_label(send.value, send.microbatch)}, but "
                                    f"{_instruction(programs[dst], j)} receives "
                                    f"{value_label(recv.value, recv.microbatch)}")
                    break  # every later message of the pair is off by the same shift
                continue
            break
    return problems


def _signature(node: fx.Node, kind: str) -> tuple:
    return (kind, *(collective_sends(node) or (None, None)))


def collective_order_problems(programs: dict[int, RankProgram],
                              group_of: Callable[[int, str], Hashable] = lambda rank, name: name) -> list[str]:
    """For every process group, the collectives each rank of `programs` issues on it, in
    program order: every rank using a group must issue the same collectives (kind, shape,
    dtype) in the same order, or some rank waits in one its peers never join.

    `group_of(rank, group_name)` identifies the group a rank's collective runs on: by
    default its name. Programs planned for every rank in one process (on a fake process
    group) all carry the names of the planning rank's groups, so there the caller says
    which ranks share one (e.g. the pipeline index, for data-parallel groups)."""
    issued: dict[Hashable, dict[int, list[tuple[tuple, int]]]] = {}
    signatures: dict[int, list[tuple[str, tuple]]] = {}  # per task (by id): its collectives' groups and signatures
    for rank, program in sorted(programs.items()):
        for index, instruction in enumerate(program.instructions):
            if not isinstance(instruction, Run):
                continue
            task = program.tasks[instruction.task]
            if id(task) not in signatures:
                signatures[id(task)] = [(collective_group(node), _signature(node, kind))
                                        for node in task.graph.graph.nodes
                                        if (kind := collective_kind(node)) is not None]
            for group_name, signature in signatures[id(task)]:
                group = group_of(rank, group_name)
                issued.setdefault(group, {}).setdefault(rank, []).append((signature, index))
    problems = []
    for group, by_rank in issued.items():
        (first, reference), *others = sorted(by_rank.items())
        for rank, sequence in others:
            for k in range(max(len(reference), len(sequence))):
                mine = sequence[k] if k < len(sequence) else None
                theirs = reference[k] if k < len(reference) else None
                if mine is None or theirs is None or mine[0] != theirs[0]:
                    where = (f"{_instruction(programs[rank], mine[1])} issues {mine[0]}" if mine
                             else f"rank {rank} issues none")
                    expected = (f"{_instruction(programs[first], theirs[1])} issues {theirs[0]}" if theirs
                                else f"rank {first} issues none")
                    problems.append(f"group {group}, collective {k}: {where}, but {expected}")
                    break
    return problems



def freed_value_problems(program: RankProgram, frees_after: Sequence[Iterable[Key]] | None = None) -> list[str]:
    """Each read of a value after it was freed, and each run that adds to a value (an
    `accumulated` output) after it was freed, which would restart the sum from this
    run's part. `frees_after[i]` lists the values freed once instruction i has run:
    by default what the runtime frees (`RankProgram.frees_after`, each value after its
    last read), where only the adds can go wrong; pass a runtime's own list to check it."""
    if frees_after is None:
        frees_after = program.frees_after()
    freed: dict[Key, int] = {}  # value -> the instruction after which it was freed
    problems = []

    def gone(index: int, key: Key, what: str) -> None:
        problems.append(f"{_instruction(program, index)} {what} {value_label(*key)}, freed after "
                        f"{_at(program, freed[key])}")

    for index, instruction in enumerate(program.instructions):
        for key in program.reads(instruction):
            if key in freed:
                gone(index, key, "reads")
        for key in program.writes(instruction):
            if isinstance(instruction, Run) and key[0] in program.accumulated and key in freed:
                gone(index, key, "adds to")
            freed.pop(key, None)  # made again: live from here
        for key in frees_after[index]:
            freed[key] = index
    return problems


def _tasks_problems(tasks: Iterable, prefix: str = "task ") -> list[str]:
    problems = []
    for task in tasks:
        problems += [f"{prefix}{task.name}: {p}" for p in _task_problems(task)]
    return problems


def joint_problems(dag: TrainingDAG) -> list[str]:
    """What breaks the invariants of the joint level (`ir.JointLevel`)."""
    graph = dag.joint.graph
    problems = [f"joint graph: {p}" for p in graph_problems(graph)]
    if problems:
        return problems
    placeholders = {n.name: n for n in graph.find_nodes(op="placeholder")}
    described: dict[str, int] = {}
    for graph_input in dag.inputs:
        described[graph_input.name] = described.get(graph_input.name, 0) + 1
        if graph_input.name not in placeholders:
            problems.append(f"joint graph: input {graph_input.name} ({graph_input.role.value}) is no placeholder")
    problems += [f"joint graph: input {name} is described {count} times" for name, count in described.items()
                 if count > 1]
    problems += [f"joint graph: placeholder {name} is described by no input" for name in placeholders
                 if name not in described]
    returned = dag.output_node().args[0]
    if len(returned) != len(dag.outputs):
        problems.append(f"joint graph: returns {len(returned)} values, but {len(dag.outputs)} outputs are described")
    for spec, node in zip(dag.outputs, returned):
        if not isinstance(node, fx.Node) or spec.name != node.name:
            problems.append(f"joint graph: output {spec.name} ({spec.role.value} {spec.index}) is described, "
                            f"but the graph returns {node} there")
    computed = [n for n in graph.nodes if n.op in ("placeholder", "call_function")]
    problems += [f"joint graph: node {n.name} ({n.op} {n.target}) has no `val`" for n in computed
                 if "val" not in n.meta and (n.users or n.op == "placeholder")]  # not e.g. an `_assert_async`
    if any(SPEC_KEY in n.meta for n in computed):  # placements propagated: on every node
        problems += [f"joint graph: node {n.name} ({n.op} {n.target}) has no placement, while others have"
                     for n in computed if SPEC_KEY not in n.meta]
    return problems


_FORWARD = (TaskKind.P, TaskKind.F)
_BACKWARD = (TaskKind.B, TaskKind.I)


def _runs_before(producer, reader) -> bool:
    """Whether, for one microbatch, every schedule runs `producer` before `reader` (tasks)."""
    made, reads = producer.kind, reader.kind
    if made is TaskKind.E:
        # A later stage's epilogue may feed an earlier one's (a tied weight's gradient): the
        # earlier stage's last backward waits for the later one's. Where both run on one rank
        # the order is the program's, which the program level checks.
        return reads is TaskKind.E and producer.stage > reader.stage
    if reads is TaskKind.E:
        return True
    if reads in _FORWARD:
        return made in _FORWARD and producer.stage <= reader.stage and not (
            reads is TaskKind.P and made is TaskKind.F)
    if made in _FORWARD:
        return True
    if made is TaskKind.W:
        return False
    return producer.stage > reader.stage if reads in _BACKWARD else producer.stage >= reader.stage


def staged_problems(dag: TrainingDAG) -> list[str]:
    """What breaks the invariants of the staged level (`ir.StagedLevel`)."""
    problems = _tasks_problems(dag.tasks)
    names: set[str] = set()
    for task in dag.tasks:
        if task.name in names:
            problems.append(f"two tasks are named {task.name}")
        names.add(task.name)
    if problems:
        return problems
    schedule = dag.schedule
    if schedule is None:
        problems.append("the tasks have no schedule")
    else:
        try:
            validate(schedule, training=dag.training)
        except ScheduleError as e:
            problems.append(f"schedule {schedule.name}: {e}")
        held = {(task.stage, task.kind) for task in dag.tasks}
        missing: dict[tuple[int, TaskKind], str] = {}
        for rank, row in enumerate(schedule.actions):
            for action in row:
                stage, kind = schedule.model_stage(action.stage), TaskKind.of(action.kind)
                # A split backward's part may be empty (a first stage has no input gradient),
                # and a stage's B stands for its I and W until `split_backward`.
                split = kind in BACKWARD_KINDS[1:] and any((stage, k) in held for k in BACKWARD_KINDS)
                if (stage, kind) not in held and not split:
                    missing.setdefault((stage, kind),
                                       f"schedule {schedule.name}: action {action} of pipeline rank {rank}")
        problems += [f"{where} has no task {kind.value}{stage}" for (stage, kind), where in missing.items()]
    inputs = {i.name for i in dag.inputs}
    made_by: dict[str, list] = {}
    for task in dag.tasks:
        for name in task.outputs:
            made_by.setdefault(name, []).append(task)
    for name, tasks in made_by.items():
        if len(tasks) > 1 and not (len({t.stage for t in tasks}) == 1
                                   and all(t.kind in BACKWARD_KINDS for t in tasks)):
            problems.append(f"{name} is made by tasks {', '.join(t.name for t in tasks)}")
    for task in dag.tasks:
        for name in task.inputs:
            producers = made_by.get(name)
            if producers is None and name not in inputs:
                problems.append(f"task {task.name} reads {name}, which no task makes and no step input is")
            for producer in producers or ():
                if not _runs_before(producer, task):
                    problems.append(f"task {task.name} reads {name}, made by task {producer.name}, "
                                    "which does not run before it")
    for output in dag.outputs:
        if output.name not in made_by and output.name not in inputs:
            problems.append(f"output {output.name} ({output.role.value} {output.index}) is made by no task")
    return problems


def program_problems(programs: dict[int, RankProgram],
                     group_of: Callable[[int, str], Hashable] = lambda rank, name: name) -> list[str]:
    """What breaks the invariants of the program level (`ir.ProgramLevel`) in `programs`;
    `group_of` as for `collective_order_problems`."""
    problems = []
    checked: set[int] = set()
    for rank, program in sorted(programs.items()):
        fresh = [task for task in program.tasks.values() if id(task) not in checked]
        checked.update(id(task) for task in fresh)
        problems += _tasks_problems(fresh, f"rank {rank} task ")
        for index, instruction in enumerate(program.instructions):
            if not isinstance(instruction, Run):
                continue
            for task in dict.fromkeys([instruction.task, *(run.task for run in instruction.parts)]):
                if task not in program.tasks:
                    problems.append(f"{_instruction(program, index)} runs task {task!r}, "
                                    "which its program does not hold")
    if problems:  # the instructions, once the tasks they run are sound
        return problems
    for program in programs.values():
        problems += use_before_definition_problems(program)
        problems += freed_value_problems(program)
    problems += point_to_point_problems(programs)
    problems += collective_order_problems(programs, group_of)
    return problems


def verify_dag(dag: TrainingDAG, after_pass: str) -> None:
    """Raise `InvalidGraphError` naming `after_pass` and what is at fault if `dag` breaks
    an invariant of the level it is at (`dag.view().verify`)."""
    dag.view().verify(after_pass)
