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
from dataclasses import dataclass, field, replace
from typing import Any, Union

import torch

import torch.fx as fx

from .ops import COMM_NOTE, collective_kind, wait_of
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
    P = "P"  # prologue of a stage: once per step, before its first forward (e.g. ZeRO-1/2 gathers)
    F = "F"  # forward of a stage, per microbatch
    B = "B"  # backward of a stage (input and weight gradients), per microbatch
    I = "I"  # noqa: E741 - backward split for zero-bubble schedules: input gradient, per microbatch
    W = "W"  # ... and weight gradient, which nothing downstream waits for, per microbatch
    E = "E"  # epilogue of a stage: once per step, after its last backward (e.g. DDP all-reduce)




@dataclass
class Task:
    """A compute chunk: runs `graph` on the values named `inputs`, producing `outputs`.

    One task serves every microbatch: the program runs it once per microbatch
    (`Run(task, m)`), so identical work compiles once.
    """

    name: str
    kind: TaskKind
    stage: int
    graph: fx.GraphModule
    inputs: list[str]
    outputs: list[str]
    lane: str = "compute"


@dataclass(frozen=True)
class Run:
    """Run a task for a microbatch. An overlapped pair (DualPipe's F&B) is one
    `Run` of the fused task of both, whose `parts` say which task and
    microbatch each half computes (its values are keyed by them)."""

    task: str
    microbatch: int | None  # None: a once-per-step task (prologue, epilogue)
    parts: tuple["Run", ...] = ()

    @property
    def runs(self) -> tuple["Run", ...]:
        """The (task, microbatch) runs this computes: itself, or the parts of a fused pair."""
        return self.parts or (self,)

    @property
    def label(self) -> str:
        """`F0.3` (the task and microbatch, as the schedule names the action), or `F0.3&B3.1` for a pair."""
        if self.parts:
            return "&".join(part.label for part in self.parts)
        return self.task + ("" if self.microbatch is None else f".{self.microbatch}")

    def __str__(self) -> str:
        return f"run   {self.label}"


@dataclass(frozen=True)
class Send:
    """Send a value to another rank (non-blocking; the runtime waits before the program ends)."""

    value: str
    microbatch: int | None
    peer: int
    tag: int
    nbytes: int = 0

    def __str__(self) -> str:
        return f"send  {self.value}{_mb(self.microbatch)} -> rank {self.peer} (tag {self.tag})"


@dataclass(frozen=True)
class Recv:
    """Receive a value from another rank into a new buffer: posted here, waited
    for by its first reader, so the transfer overlaps what runs in between.
    With `accumulate`, the received tensor is added to the value already held
    (a partial sum from another rank, e.g. a gradient of a shared parameter)."""

    value: str
    microbatch: int | None
    peer: int
    tag: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    accumulate: bool = False
    device: torch.device | None = None  # where the value lives on this rank (the model's device)

    def __str__(self) -> str:
        verb = "recv+" if self.accumulate else "recv "
        return f"{verb} {self.value}{_mb(self.microbatch)} <- rank {self.peer} (tag {self.tag})"


Instruction = Union[Run, Send, Recv]

def _nbytes(val) -> int:
    return val.numel() * val.element_size() if isinstance(val, torch.Tensor) else 0


def _mb(microbatch: int | None) -> str:
    return "" if microbatch is None else f"[mb {microbatch}]"


def value_label(name: str, microbatch: int | None) -> str:
    """A value as programs print it: `add_7[mb 0]`, or `add_25` for a per-step value."""
    return name + _mb(microbatch)


@dataclass
class RankProgram:
    """What one rank runs for one step.

    Values are named by joint-graph node names. A value is per step (`per_step`:
    parameters, and `accumulated` values such as gradients, summed over
    microbatches) or per microbatch (everything else, keyed by microbatch).
    `inputs` are supplied by the step, `outputs` handed back; every other value
    is freed after the last instruction that reads it.
    """

    rank: int
    tasks: dict[str, Task]
    instructions: list[Instruction]
    inputs: list[str]
    per_step: set[str]
    accumulated: set[str]
    outputs: list[str]
    num_microbatches: int

    def key(self, name: str, microbatch: int | None) -> tuple[str, int | None]:
        return (name, None) if name in self.per_step else (name, microbatch)

    def communication_bytes(self) -> dict[str, int]:
        """Bytes this rank contributes per step, per collective kind and to point-to-point sends."""
        per_task: dict[str, dict[str, int]] = {}
        for task in self.tasks.values():
            counts = per_task.setdefault(task.name, {})
            for node in task.graph.graph.nodes:
                kind = collective_kind(node)
                if kind is not None:
                    counts[kind] = counts.get(kind, 0) + _nbytes(node.args[0].meta["val"])
        total: dict[str, int] = {}
        for instruction in self.instructions:
            if isinstance(instruction, Run):  # a fused pair's task holds both halves' collectives
                for kind, nbytes in per_task[instruction.task].items():
                    total[kind] = total.get(kind, 0) + nbytes
            elif isinstance(instruction, Send):
                total["send"] = total.get("send", 0) + instruction.nbytes
        return total

    def render(self) -> str:
        lines = [f"# rank {self.rank}: {len(self.instructions)} instructions, "
                 f"{self.num_microbatches} microbatches",
                 f"inputs: {', '.join(self.inputs)}",
                 "tasks:"]
        for task in self.tasks.values():
            lines.append(f"  {task.name:<6} stage={task.stage} lane={task.lane}  "
                         f"in=[{', '.join(task.inputs)}] out=[{', '.join(task.outputs)}]")
            ops = [n for n in task.graph.graph.nodes if n.op == "call_function"]
            position = {n: i for i, n in enumerate(ops)}
            for node in ops:
                if collective_kind(node) is not None:
                    # On the comm lane from its issue to its wait: the ops between run under it.
                    wait = wait_of(node)
                    span = (f"comm lane: ops {position[node]}..{position[wait]} of {len(ops)}"
                            if wait is not None else "comm lane")
                    lines.append(f"        collective {node.name}: {node.target}  {node.meta.get(COMM_NOTE, '')}"
                                 f"  [{span}]")
        lines.append("instructions:")
        lines.extend(f"  {i:4d}  {instruction}" for i, instruction in enumerate(self.instructions))
        lines.append(f"accumulated: {', '.join(sorted(self.accumulated))}")
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
    schedule: Any = None  # the validated `schedules.Schedule` the programs follow
    # Pipeline ranks running a stage that reads each parameter (by placeholder
    # name); they end the step with the same summed gradient.
    parameter_holders: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def copy(self) -> "TrainingDAG":
        """A DAG with its own copy of the joint graph, before any tasks: passes
        transform the copy in place, so one capture can be planned for many ranks."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.joint.graph, {}))
        return TrainingDAG(fx.GraphModule(self.joint, graph), [replace(i) for i in self.inputs],
                           [replace(o) for o in self.outputs], self.strategy, self.dp_group, self.training)

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


def add_placeholder(graph: fx.Graph, name: str, meta: dict | None = None) -> fx.Node:
    """A placeholder named after `name`, made unique in `graph` (FX appends `_1`, ...).

    FX names a placeholder's argument in the generated code by its *target*, not
    its node name: a graph combining two graphs' inputs (a fused F&B pair whose
    halves both read `tanh`, of different microbatches) needs both unique, or
    its code has a duplicate argument.
    """
    node = graph.placeholder(name)
    node.target = node.name
    node.meta = dict(meta or {})
    return node


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
