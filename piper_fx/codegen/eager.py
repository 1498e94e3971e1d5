"""Eager code generation: the task's FX graph run as Python, boxed."""
from __future__ import annotations

import copy

import torch
from torch.fx.graph import _BoxedCodeGen

from ..compat import code_now, make_graph_module
from ..ir import Task
from ..ops import WAIT, collective_op_kind
from ..runtime.timing import timed_collective, timed_wait


# Views the code makes as reshapes. A graph reads its values' layouts off the fake values the
# ops were traced with, and a kernel may lay its result out otherwise when it runs (Qwen3-Next:
# `softplus_backward` of two inputs of different layouts, then `cat` of its result kept that
# layout, where the fake `cat` was contiguous), and a view of it then fails. A reshape is the
# same view wherever one exists, and a copy where none does (as Inductor's views are: it lays
# out its values itself); the graph is functional, so nothing reads the difference.
_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def compile_task(task: Task, time_waits: bool = False):
    # A module of its own over a copy of the graph, lazy: its code is generated once, below
    # (`copy.copy` of the task's module generated the task graph's code first).
    gm = make_graph_module(task.graph, copy.deepcopy(task.graph.graph))
    # Boxed: the generated code clears the argument list, and FX code drops each
    # local after its last use, so values die inside the task, not at its end.
    gm.graph.set_codegen(_BoxedCodeGen())
    for node in gm.graph.nodes:
        node.meta = {}  # the code runs without it; its fake values would live as long as the step
        if node.op == "call_function" and node.target in _VIEWS:
            node.target = torch.ops.aten.reshape.default
    if time_waits:
        for node in gm.graph.nodes:
            if node.op != "call_function":
                continue
            if node.target is WAIT:
                node.target = timed_wait  # the same wait, timed as exposed communication
            elif collective_op_kind(node.target) is not None:
                node.target = timed_collective(node.target)  # the same collective, its issue time noted
    code_now(gm)
    return gm.forward, gm.code
