"""Pass: split each stage's backward into input-gradient (I) and weight-gradient (W) tasks.

Requires: `dag.tasks` from `split_stages`; `dag.schedule`. Only stages with I
and W actions in the schedule (zero-bubble ones) have their backwards split;
a stage with both B and I/W actions (DualPipe) keeps B<s> as well.
Guarantees: every split B<s> is replaced by I<s> (the ops the gradients sent to
earlier stages need) and W<s> (the rest: parameter gradients and what reduces
them), which together compute exactly B<s>; a part of a multi-output op (its
`getitem`) goes with the op. I<s> also outputs the values W<s>
reads from it, so W can run later on the same rank: deferring W is what fills
the bubble, at the cost of holding those values longer. A stage whose backward
sends nothing (the first) has no I<s>: its W<s> is the whole backward.
"""
from __future__ import annotations

import operator

import torch.fx as fx

from ..ir import OutputRole, Task, TaskKind, TrainingDAG
from ..options import Strategy
from ..schedules import ActionKind
from .task_graphs import extract_graph

_SPLIT_KINDS = {ActionKind.I, ActionKind.W}  # a backward run as two actions


def _split(task: Task, weight_outputs: set[str]) -> list[Task]:
    graph = task.graph.graph
    nodes = [n for n in graph.nodes if n.op in ("call_function", "get_attr")]
    output_nodes = list(graph.find_nodes(op="output")[0].args[0])
    input_grads = [n for n, name in zip(output_nodes, task.outputs) if name not in weight_outputs]
    needed: set[fx.Node] = set()
    stack = list(input_grads)
    while stack:
        node = stack.pop()
        if node in needed or node.op == "placeholder":
            continue
        needed.add(node)
        stack.extend(node.all_input_nodes)
    # A part of a multi-output op lives with it: W reads the part, a tensor, not the op's tuple
    # (which Inductor cannot return from I; a max pool's offsets, which only W reads), and a
    # weight's gradient that is a part of an op I runs (a group norm's backward) comes from I.
    needed |= {n for n in nodes if n.target is operator.getitem and n.args[0] in needed}
    i_nodes = [n for n in nodes if n in needed]
    w_nodes = [n for n in nodes if n not in needed]
    if not i_nodes:
        return [Task(f"W{task.stage}", TaskKind.W, task.stage, task.graph, task.inputs, task.outputs)]
    w_members = set(w_nodes)
    w_inputs = list(dict.fromkeys(i for n in w_nodes for i in n.all_input_nodes if i not in w_members))
    handed_to_w = [n for n in w_inputs if n.op != "placeholder"]
    made_by_i = [n for n, name in zip(output_nodes, task.outputs) if name in weight_outputs and n in needed]
    i_outputs = list(dict.fromkeys(input_grads + made_by_i + handed_to_w))
    w_outputs = [n for n in output_nodes if n not in needed]
    i_inputs = [n for n in graph.nodes if n.op == "placeholder" and any(u in needed for u in n.users)]
    return [
        Task(f"I{task.stage}", TaskKind.I, task.stage, extract_graph(task.graph, i_inputs, i_nodes, i_outputs),
             inputs=[n.name for n in i_inputs], outputs=[n.name for n in i_outputs]),
        Task(f"W{task.stage}", TaskKind.W, task.stage, extract_graph(task.graph, w_inputs, w_nodes, w_outputs),
             inputs=[n.name for n in w_inputs], outputs=[n.name for n in w_outputs]),
    ]


def split_backward(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    schedule = dag.schedule
    kinds_of_stage: dict[int, set[ActionKind]] = {}
    for row in schedule.actions:
        for action in row:
            kinds_of_stage.setdefault(schedule.model_stage(action.stage), set()).add(action.kind)
    if not dag.training or not any(kinds & _SPLIT_KINDS for kinds in kinds_of_stage.values()):
        return dag
    read_by = {}
    for task in dag.tasks:
        for name in task.inputs:
            read_by.setdefault(name, []).append(task)
    parameter_grads = {o.name for o in dag.outputs if o.role is OutputRole.GRAD}
    tasks = []
    for task in dag.tasks:
        kinds = kinds_of_stage.get(task.stage, set())
        if task.kind is not TaskKind.B or not kinds & _SPLIT_KINDS:
            tasks.append(task)
            continue
        if ActionKind.B in kinds:  # schedules such as DualPipe split only some microbatches' backwards
            tasks.append(task)
        # Parameter gradients and what only the epilogue reads (their reductions' inputs) are W's.
        weight_outputs = {name for name in task.outputs if name in parameter_grads or (
            read_by.get(name) and all(t.kind is TaskKind.E for t in read_by[name]))}
        tasks.extend(_split(task, weight_outputs))
    dag.tasks = tasks
    return dag
