"""The global training DAG and the per-rank programs compiled from it.

`TrainingDAG` holds one joint forward/backward ATen graph (all compute and,
after the strategy passes, all communication as functional collectives),
the meaning of each of its inputs and outputs, and the tasks the graph is cut
into. A `Task` is a compute chunk (F or B of a stage and microbatch) with its
own FX graph; a `RankProgram` is the ordered list of tasks one rank runs. The
runtime runs a `RankProgram` and knows nothing of the strategy that made it.
"""
from __future__ import annotations

import enum
import operator
from dataclasses import dataclass, field

import torch.fx as fx

from .options import Strategy
from .sharding.row_shard import ShardedParameter


class InputRole(enum.Enum):
    PARAM = "param"              # full parameter, replicated over dp
    PARAM_SHARD = "param_shard"  # row shard of a parameter (ZeRO >= 1)
    BUFFER = "buffer"
    INPUT = "input"              # user argument: this replica's batch
    TANGENT = "tangent"          # seed gradient of the loss


class OutputRole(enum.Enum):
    LOSS = "loss"          # user output 0 of a training graph: the replica's scalar loss
    OUTPUT = "output"      # any other user output (no gradient flows back through it)
    GRAD = "grad"          # gradient of a graph input
    MUTATION = "mutation"  # new value of an input mutated in place (e.g. BatchNorm stats)


@dataclass
class GraphInput:
    name: str                    # placeholder name in the joint graph
    role: InputRole
    arg_index: int | None        # position among the compiled call's arguments
    fqn: str | None = None       # parameter / buffer name in the model
    sharded: ShardedParameter | None = None


@dataclass
class GraphOutput:
    name: str                    # node name in the joint graph
    role: OutputRole
    index: int                   # user output index (LOSS, OUTPUT) or argument index (GRAD, MUTATION)


class TaskKind(enum.Enum):
    F = "F"  # forward
    B = "B"  # backward (input and weight gradients)


@dataclass
class Task:
    """A compute chunk: runs `graph` on the values named `inputs`, producing `outputs`."""

    name: str
    kind: TaskKind
    stage: int
    microbatch: int
    graph: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    lane: str = "compute"


@dataclass
class RankProgram:
    """What one rank runs for one step: tasks in order.

    `inputs` are the values the step supplies (joint-graph placeholders);
    `outputs` those the step hands back (joint-graph outputs). A value is freed
    by the runtime after the last task that reads it.
    """

    rank: int
    tasks: list[Task]
    inputs: list[str]
    outputs: list[str]

    def render(self) -> str:
        lines = [f"# rank {self.rank}: {len(self.tasks)} tasks",
                 f"inputs: {', '.join(self.inputs)}"]
        for i, task in enumerate(self.tasks):
            lines.append(f"{i:4d}  {task.name:<12} lane={task.lane:<8} "
                         f"in=[{', '.join(task.inputs)}] out=[{', '.join(task.outputs)}]")
            collectives = [n for n in task.graph.graph.nodes
                           if n.op == "call_function" and getattr(n.target, "namespace", "") == "_c10d_functional"
                           and n.target.__name__.split(".")[0] != "wait_tensor"]
            for node in collectives:
                lines.append(f"        collective {node.name}: {node.target}  {node.meta.get('piper_comm', '')}")
        lines.append(f"outputs: {', '.join(self.outputs)}")
        return "\n".join(lines) + "\n"


@dataclass
class TrainingDAG:
    joint: fx.GraphModule
    inputs: list[GraphInput]
    outputs: list[GraphOutput]
    strategy: Strategy
    dp_group: str | None
    training: bool
    tasks: list[Task] = field(default_factory=list)
    programs: dict[int, RankProgram] = field(default_factory=dict)

    def input_by_name(self) -> dict[str, GraphInput]:
        return {i.name: i for i in self.inputs}

    def placeholders(self) -> dict[str, fx.Node]:
        return {n.name: n for n in self.joint.graph.nodes if n.op == "placeholder"}

    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.joint.graph.nodes) if n.op == "output")

    def refresh_output_names(self) -> None:
        """Re-read output names after passes replaced output nodes."""
        for spec, node in zip(self.outputs, self.output_node().args[0]):
            spec.name = node.name

    def set_outputs(self, nodes: list[fx.Node]) -> None:
        """Replace the joint graph's outputs, keeping `self.outputs` in step."""
        out = self.output_node()
        out.args = (tuple(nodes),)
        for spec, node in zip(self.outputs, nodes):
            spec.name = node.name


def forward_nodes(dag: TrainingDAG) -> set[fx.Node]:
    """Nodes the user-visible outputs depend on: the forward region of the joint graph.

    Everything else (reached only from the loss seed or feeding only gradients)
    is backward. Defined by data flow, so it stays right after passes add nodes.
    """
    by_name = {n.name: n for n in dag.joint.graph.nodes}
    stack = [by_name[o.name] for o in dag.outputs if o.role is not OutputRole.GRAD]
    seen: set[fx.Node] = set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    # Parts of a forward multi-output op (e.g. layer norm's saved mean) belong
    # to the forward even when only the backward reads them: a task passes
    # tensors, never tuples.
    for node in dag.joint.graph.nodes:
        if node.target is operator.getitem and node.args[0] in seen:
            seen.add(node)
    return seen
