"""Task graphs cut from, or glued from, other graphs: what the passes that make
tasks share (`split_stages`, `split_backward`, `build_rank_programs`,
`fuse_overlapped_pairs`). Not a pass: the graph mechanics, no policy.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from ..compat import make_graph_module
from ..ir import Task, add_placeholder

# The order in which a fused task runs its halves' nodes: (half, node) pairs.
FusedOrder = list[tuple[int, fx.Node]]


def extract_graph(root: fx.GraphModule, inputs: list[fx.Node], nodes: list[fx.Node],
                  outputs: list[fx.Node]) -> fx.GraphModule:
    """A new graph over `nodes` (in order) taking `inputs` as placeholders and returning `outputs`."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for node in inputs:
        env[node] = add_placeholder(graph, node.name, node.meta)
    for node in nodes:
        env[node] = graph.node_copy(node, env.__getitem__)
    graph.output(tuple(env[o] for o in outputs))
    graph.lint()
    return make_graph_module(root, graph)


def _one_after_another(halves: list[list[fx.Node]]) -> FusedOrder:
    return [(half, node) for half, nodes in enumerate(halves) for node in nodes]


def _attribute(module: torch.nn.Module, target: str):
    for atom in target.split("."):
        module = getattr(module, atom)
    return module


def fuse_tasks(name: str, parts: list[Task],
               order: Callable[[list[list[fx.Node]]], FusedOrder] = _one_after_another) -> Task:
    """One task computing every task of `parts` (whose values may share names).

    `order(halves)` says in which order the parts' compute nodes run (each
    part's own order kept); by default each part runs whole, one after another.
    """
    graph = fx.Graph()
    envs: list[dict[fx.Node, fx.Node]] = [{} for _ in parts]
    for env, task in zip(envs, parts):
        for node in task.graph.graph.nodes:
            if node.op == "placeholder":
                env[node] = add_placeholder(graph, node.name, node.meta)  # both halves may read a `tanh`
    halves = [[n for n in task.graph.graph.nodes if n.op not in ("placeholder", "output")] for task in parts]
    for half, node in order(halves):
        envs[half][node] = graph.node_copy(node, envs[half].__getitem__)
    outputs = []
    for env, task in zip(envs, parts):
        outputs += [env[n] for n in task.graph.graph.find_nodes(op="output")[0].args[0]]
    graph.output(tuple(outputs))
    graph.lint()
    # Constants the halves read (all from the one joint graph, so a name means one value).
    attributes = {node.target: _attribute(task.graph, node.target) for task in parts
                  for node in task.graph.graph.find_nodes(op="get_attr")}
    first = parts[0]
    return Task(name, first.kind, first.stage, make_graph_module(attributes, graph),
                inputs=[n for task in parts for n in task.inputs], outputs=[n for task in parts for n in task.outputs])
