"""Pass: cut the joint graph into a forward task and a backward task.

Requires: the joint graph after the collective passes.
Guarantees: `dag.tasks` is [F] (inference) or [F, B] (training), each with its
own FX graph. F reads the step's primal inputs and produces the user outputs,
the mutated-input values, and every forward value B reads ("saved"); B reads
the saved values and the loss seed and produces the gradients. Values keep
their joint-graph node names across tasks. Nothing is recomputed here: what
must not be saved (ZeRO-3's full parameters) was re-gathered in backward by
`unshard_parameters` already.
"""
from __future__ import annotations

import torch.fx as fx

from ..ir import InputRole, OutputRole, Task, TaskKind, TrainingDAG, forward_nodes
from ..options import Strategy


def extract_graph(root: fx.GraphModule, inputs: list[fx.Node], nodes: list[fx.Node],
                  outputs: list[fx.Node]) -> fx.GraphModule:
    """A new graph over `nodes` (in order) taking `inputs` as placeholders and returning `outputs`."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = graph.placeholder(node.name)
        env[node].meta = dict(node.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    graph.lint()
    return fx.GraphModule(root, graph)


def split_forward_backward(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    graph = dag.joint.graph
    by_name = {n.name: n for n in graph.nodes}
    forward = forward_nodes(dag)
    primals = [n for n in graph.nodes if n.op == "placeholder"
               and dag.input_by_name()[n.name].role is not InputRole.TANGENT]
    tangents = [n for n in graph.nodes if n.op == "placeholder" and n not in primals]
    computed = [n for n in graph.nodes if n.op in ("call_function", "get_attr")]
    fwd_compute = [n for n in computed if n in forward]
    bwd_compute = [n for n in computed if n not in forward]

    user_outputs = [by_name[o.name] for o in dag.outputs if o.role is not OutputRole.GRAD]
    grad_outputs = [by_name[o.name] for o in dag.outputs if o.role is OutputRole.GRAD]
    bwd_set = set(bwd_compute)
    saved: list[fx.Node] = []

    def read_by_backward(node: fx.Node) -> None:
        if node not in bwd_set and node not in tangents and node not in saved:
            saved.append(node)

    for node in bwd_compute:
        for inp in node.all_input_nodes:
            read_by_backward(inp)
    for node in grad_outputs:
        read_by_backward(node)
    saved_computed = [n for n in saved if n.op != "placeholder"]

    f_outputs = user_outputs + [n for n in saved_computed if n not in user_outputs]
    forward_task = Task("F", TaskKind.F, stage=0, microbatch=0,
                        graph=extract_graph(dag.joint, primals, fwd_compute, f_outputs),
                        inputs=[n.name for n in primals], outputs=[n.name for n in f_outputs])
    dag.tasks = [forward_task]
    if dag.training:
        b_inputs = saved + tangents
        backward_task = Task("B", TaskKind.B, stage=0, microbatch=0,
                             graph=extract_graph(dag.joint, b_inputs, bwd_compute, grad_outputs),
                             inputs=[n.name for n in b_inputs], outputs=[n.name for n in grad_outputs])
        dag.tasks.append(backward_task)
    return dag
