"""Checks that every pass leaves well-formed graphs behind.

A pass that breaks a graph (a value read before it is defined, two inputs of a
task with one argument name, a task whose inputs no longer match its graph)
would otherwise fail much later, inside codegen or a task's run on some rank,
far from its cause. `verify_dag` runs after every pass in debug runs (a
`debug_dir`) and in the test suite (env `PIPER_VERIFY=1`), and names the pass.
"""
from __future__ import annotations

import os

import torch.fx as fx

from .ir import TrainingDAG
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


def verify_dag(dag: TrainingDAG, after_pass: str) -> None:
    """Raise `InvalidGraphError` naming `after_pass` and the graph at fault if the joint
    graph, a task, or a rank program's task is not well formed, or a program runs a
    task it does not hold."""
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
    if problems:
        raise InvalidGraphError(f"piper_fx pass {after_pass!r} left an invalid program:\n  "
                                + "\n  ".join(problems))
