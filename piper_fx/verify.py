"""Checks that every pass leaves well-formed graphs behind.

A pass that breaks a graph (a value read before it is defined, two inputs of a
task with one argument name, a task whose inputs no longer match its graph)
would otherwise fail much later, inside codegen or a task's run on some rank,
far from its cause. `verify_dag` runs after every pass in debug runs (a
`debug_dir`) and in the test suite (env `PIPER_VERIFY=1`), and names the pass.

It checks every graph (joint graph and tasks), and every rank program: each
value is defined before it is read, and between two ranks the messages one
sends are those the other receives, in the same order (NCCL matches them by
order). `collective_order_problems` checks that every rank of a process group
issues the same collectives in the same order; it needs the programs of every
rank of the group, which one rank's plan does not hold (it holds its own
replica's pipeline), so planning tests run it over all ranks.
"""
from __future__ import annotations

import os
from typing import Callable, Hashable

import torch.fx as fx

from .ir import RankProgram, Recv, Run, Send, TrainingDAG, value_label
from .ops import collective_kind
from .options import Strategy

VERIFY_ENV = "PIPER_VERIFY"


class InvalidGraphError(RuntimeError):
    """A pass left a graph that is not a valid program: a bug in piper_fx, not in the model."""


def verification_enabled(strategy: Strategy) -> bool:
    return strategy.debug_dir is not None or os.environ.get(VERIFY_ENV, "") not in ("", "0")


def graph_problems(graph: fx.Graph) -> list[str]:
    """What is wrong with `graph`: [] when its node names and argument names are
    unique, every node reads only nodes of this graph defined before it (FX's lint),
    and its generated Python compiles."""
    problems = []
    seen_names: set[str] = set()
    seen_arguments: set[str] = set()
    for node in graph.nodes:
        if node.name in seen_names:
            problems.append(f"two nodes are named {node.name!r}")
        seen_names.add(node.name)
        if node.op == "placeholder":
            if node.target in seen_arguments:
                problems.append(f"two inputs are the argument {node.target!r}")
            seen_arguments.add(node.target)
    try:
        graph.lint()
    except Exception as e:  # noqa: BLE001 - lint raises plain RuntimeErrors with the node named
        problems.append(f"lint: {e}")
    if not problems:
        source = graph.python_code(root_module="self").src
        try:
            compile(source, "<graph>", "exec")
        except SyntaxError as e:
            problems.append(f"its code does not compile: {e.msg} in `{(e.text or '').strip()}`")
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


def _instruction(program: RankProgram, index: int) -> str:
    return f"rank {program.rank} instruction {index} ({str(program.instructions[index]).strip()})"


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


def _group_name(node: fx.Node) -> str:
    """A functional collective's process group: its last string argument (after a reduce op's name)."""
    return next(a for a in reversed(node.args) if isinstance(a, str))


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
    for rank, program in sorted(programs.items()):
        for index, instruction in enumerate(program.instructions):
            if not isinstance(instruction, Run):
                continue
            for node in program.tasks[instruction.task].graph.graph.nodes:
                kind = collective_kind(node)
                if kind is not None:
                    val = node.args[0].meta.get("val")
                    signature = (kind, tuple(val.shape) if val is not None else None,
                                 val.dtype if val is not None else None)
                    group = group_of(rank, _group_name(node))
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


def verify_dag(dag: TrainingDAG, after_pass: str) -> None:
    """Raise `InvalidGraphError` naming `after_pass` and what is at fault if the joint
    graph, a task, or a rank program's task is not well formed, or a program runs a
    task it does not hold, reads a value before it is made, or sends to a rank in
    another order than that rank receives."""
    problems = [f"joint graph: {p}" for p in graph_problems(dag.joint.graph)]
    for task in dag.tasks:
        problems += [f"task {task.name}: {p}" for p in _task_problems(task)]
    checked = {id(task) for task in dag.tasks}
    for rank, program in sorted(dag.programs.items()):
        for name, task in program.tasks.items():
            if id(task) not in checked:  # a fused pair's task, made for the programs
                checked.add(id(task))
                problems += [f"rank {rank} task {name}: {p}" for p in _task_problems(task)]
        for index, instruction in enumerate(program.instructions):
            task = getattr(instruction, "task", None)
            if task is not None and task not in program.tasks:
                problems.append(f"rank {rank} instruction {index} ({instruction}) runs task {task!r}, "
                                "which its program does not hold")
    if not problems:  # the instructions, once the tasks they run are sound
        for program in dag.programs.values():
            problems += use_before_definition_problems(program)
        problems += point_to_point_problems(dag.programs)
    if problems:
        raise InvalidGraphError(f"piper_fx pass {after_pass!r} left an invalid program:\n  "
                                + "\n  ".join(problems))
