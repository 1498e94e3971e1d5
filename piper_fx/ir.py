"""The global training DAG and the per-rank programs compiled from it.

`TrainingDAG` holds one joint forward/backward ATen graph (all compute and,
after the strategy passes, all communication as functional collectives),
the meaning of each of its inputs and outputs, and the tasks the graph is cut
into. A `Task` is a compute chunk (F or B of a stage and microbatch) with its
own FX graph; a `RankProgram` is the ordered list of tasks one rank runs. The
runtime runs a `RankProgram` and knows nothing of the strategy that made it.

A DAG is at one of three levels (`Level`, ARCHITECTURE.md): the joint graph
with placements (`JointLevel`), the staged tasks with their schedule
(`StagedLevel`), the rank programs (`ProgramLevel`). Each level's class states
its invariants and checks them (`verify()`); a pass rewrites within a level or
lowers a DAG to the next (`passes.PIPELINE` says which).
"""
from __future__ import annotations

import enum
import math
import operator
from dataclasses import dataclass, field, replace
from typing import Any, Callable, ClassVar, Hashable, Sequence, Union

import torch

import torch.fx as fx

from .compat import make_graph_module
from .ops import COMM_NOTE, collective_kind, collective_sends, wait_of
from .options import Strategy
from .schedules.schedule import PAIR_SEPARATOR, ActionKind
from .sharding.row_shard import ShardedParameter


class InputRole(enum.Enum):
    PARAM = "param"              # full parameter, replicated over dp
    PARAM_SHARD = "param_shard"  # row shard of a parameter (ZeRO >= 1)
    BUFFER = "buffer"
    INPUT = "input"              # user argument: this replica's batch
    TANGENT = "tangent"          # seed gradient of the loss
    RNG = "rng"                  # per-microbatch key and counter of the random ops (passes.functionalize_random)
    HELD_GRAD = "held_grad"      # a no_sync window's held gradient of a parameter (passes.reduce_gradients)


# The inputs a step holds throughout, not per microbatch: parameters (whole or a shard) and buffers.
HELD_ROLES = (InputRole.PARAM, InputRole.PARAM_SHARD, InputRole.BUFFER)


class OutputRole(enum.Enum):
    LOSS = "loss"          # the user output that is the replica's loss (`outputs.loss_index`)
    OUTPUT = "output"      # any other user output, per microbatch (no gradient flows back through it)
    GRAD = "grad"          # gradient of a graph input
    MUTATION = "mutation"  # new value of an input mutated in place (e.g. BatchNorm stats)


@dataclass
class GraphInput:
    name: str                    # placeholder name in the joint graph
    role: InputRole
    arg_index: int | None        # position among the compiled call's arguments
    fqn: str | None = None       # parameter / buffer name in the model
    sharded: ShardedParameter | None = None
    held_for: int | None = None  # HELD_GRAD: the argument index of the parameter it was held for


@dataclass
class GraphOutput:
    name: str                    # node name in the joint graph
    role: OutputRole
    index: int                   # user output index (LOSS, OUTPUT) or argument index (GRAD, MUTATION)
    # An OUTPUT the model made with a gradient: where it made it (`capture`). The step returns
    # it for reading, and refuses a gradient flowing back into it.
    made_at: str | None = None
    # An OUTPUT without the microbatch's rows that a reduction over them made (a metric's mean, a
    # count's sum): the reduction (`REDUCTIONS`) that makes the batch's from its microbatches';
    # "first" for one that reads no batch argument (every microbatch's alike). None for an
    # output of rows, whose microbatches' are concatenated along dim 0.
    reduced_by: str | None = None


# How the step makes an output a reduction over the batch's rows made (`GraphOutput.reduced_by`)
# from its microbatches' values, stacked along a new dim 0: by the same reduction, along it (the
# microbatches' means, of equal numbers of rows, average to the batch's); and one that reads no
# batch argument, the first microbatch's.
REDUCTIONS = {"sum": lambda stacked: stacked.sum(0), "mean": lambda stacked: stacked.mean(0),
              "amax": lambda stacked: stacked.amax(0), "amin": lambda stacked: stacked.amin(0),
              "all": lambda stacked: stacked.all(0), "any": lambda stacked: stacked.any(0),
              "first": lambda stacked: stacked[0]}


class TaskKind(enum.Enum):
    """What a task computes. F, B, I and W run the schedule's actions of that kind (`TaskKind.of`)."""

    P = "P"  # prologue of a stage: once per step, before its first forward (e.g. ZeRO-1/2 gathers)
    F = ActionKind.F.value  # forward of a stage, per microbatch
    B = ActionKind.B.value  # backward of a stage (input and weight gradients), per microbatch
    I = ActionKind.I.value  # noqa: E741 - backward split for zero-bubble schedules: input gradient
    W = ActionKind.W.value  # ... and weight gradient, which nothing downstream waits for
    E = "E"  # epilogue of a stage: once per step, after its last backward (e.g. DDP all-reduce)

    @classmethod
    def of(cls, action: ActionKind) -> "TaskKind":
        """The kind of the task that runs a schedule action of kind `action` (not a pair's)."""
        return cls(action.value)


# The kinds of a stage's backward tasks: its whole backward, or the two parts a split one makes.
BACKWARD_KINDS = (TaskKind.B, TaskKind.I, TaskKind.W)


@dataclass
class Task:
    """A compute chunk: runs `graph` on the values named `inputs`, producing `outputs`.

    One task serves every microbatch: the program runs it once per microbatch
    (`Run(task, m)`), so identical work compiles once. In the program the runtime
    runs, `graph` is None: once compiled, a task is its code (`RankProgram.without_graphs`).
    """

    name: str
    kind: TaskKind
    stage: int
    graph: fx.GraphModule | None
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
            return PAIR_SEPARATOR.join(part.label for part in self.parts)
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
    nbytes: int = 0  # what travels
    order: tuple[int, ...] | None = None  # the value's `memory_order`: it travels in that order
    broadcast: tuple[int, ...] = ()  # its `broadcast_dims`: it travels with one element along each

    def __str__(self) -> str:
        return (f"send  {self.value}{_mb(self.microbatch)} -> rank {self.peer} (tag {self.tag})"
                f"{_order(self.order)}{_broadcast(self.broadcast)}")


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
    # The value's `memory_order`: it arrives in that order and is read through the inverse
    # permutation, with the strides its readers were compiled for.
    order: tuple[int, ...] | None = None
    # Its `broadcast_dims`: it arrives with one element along each, and is read expanded along
    # them (stride 0), as its readers were compiled for it.
    broadcast: tuple[int, ...] = ()
    # For a value laid out with gaps (a slice of a larger tensor), its strides (its wire
    # shape's, `wire_shape`), which its readers were compiled for: it arrives contiguous and is
    # copied into them. None for a dense value.
    stride: tuple[int, ...] | None = None

    def __str__(self) -> str:
        verb = "recv+" if self.accumulate else "recv "
        return (f"{verb} {self.value}{_mb(self.microbatch)} <- rank {self.peer} (tag {self.tag})"
                f"{_order(self.order)}{_broadcast(self.broadcast)}")


Instruction = Union[Run, Send, Recv]


def is_row_major(shape: Sequence[int], stride: Sequence[int], dims: Sequence[int] | None = None) -> bool:
    """Whether a tensor of `shape` and `stride` is dense with its `dims` (all, in order, by
    default) from outermost to innermost: contiguous, for all dims in order."""
    expected = 1
    for dim in reversed(range(len(shape)) if dims is None else dims):
        if shape[dim] != 1 and stride[dim] != expected:
            return False
        expected *= shape[dim]
    return True


def memory_order(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...] | None:
    """The dims of a dense tensor laid out other than row-major (such as attention's
    output, the transpose of a contiguous tensor), from outermost to innermost in
    memory: `tensor.permute(order)` is contiguous. None for a contiguous tensor, and
    for one that is not dense (`is_dense`)."""
    if is_row_major(shape, stride):
        return None
    order = tuple(sorted(range(len(shape)), key=lambda dim: -stride[dim]))
    return order if is_row_major(shape, stride, order) else None


def broadcast_dims(shape: Sequence[int], stride: Sequence[int]) -> tuple[int, ...]:
    """The dims a value is broadcast along, an `expand`'s (stride 0, more than one element):
    it is the same along each, so it travels with one element along each (its `wire_shape`)
    and is expanded back, with the strides its readers were compiled for."""
    return tuple(dim for dim, (size, step) in enumerate(zip(shape, stride)) if step == 0 and size > 1)


def wire_shape(shape: Sequence[int], broadcast: Sequence[int]) -> tuple[int, ...]:
    """The shape a value of `shape` travels in: one element along each of its `broadcast` dims."""
    return tuple(1 if dim in broadcast else size for dim, size in enumerate(shape))


def is_dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Whether a tensor of `shape` and `stride` is dense (no element twice, no gaps), in any
    order in memory."""
    return not broadcast_dims(shape, stride) and (is_row_major(shape, stride)
                                                  or memory_order(shape, stride) is not None)


def message_layout(shape: Sequence[int], stride: Sequence[int]
                   ) -> tuple[tuple[int, ...], tuple[int, ...] | None, tuple[int, ...] | None]:
    """How a value of `shape` and `stride` travels between ranks: the dims it is broadcast
    along (`broadcast_dims`), the order its `wire_shape` travels in (`memory_order`), and,
    for a value whose wire shape has gaps in memory (a slice of a larger tensor), its strides
    (`Recv.stride`), else None."""
    broadcast = broadcast_dims(shape, stride)
    wire = wire_shape(shape, broadcast)
    return broadcast, memory_order(wire, stride), None if is_dense(wire, stride) else tuple(stride)


def _order(order: tuple[int, ...] | None) -> str:
    return "" if order is None else f" in dim order {order}"


def _broadcast(broadcast: tuple[int, ...]) -> str:
    return f" broadcast along {broadcast}" if broadcast else ""


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
    # The per-microbatch outputs a reduction over the rows made, with it (`GraphOutput.reduced_by`).
    reduced: dict[str, str] = field(default_factory=dict)
    # (peer, send tag) -> the tag of the receive from that peer whose arrival shows it has the
    # sent tensor (the first message the peer sends back after it waited for this one);
    # sends without one are known complete only when their backend says so, or at the end.
    # A tag is a transfer's between two ranks: a value sent to several peers has one tag.
    acknowledged_by: dict[tuple[int, int], int] = field(default_factory=dict)

    def key(self, name: str, microbatch: int | None) -> tuple[str, int | None]:
        return (name, None) if name in self.per_step else (name, microbatch)

    def reads(self, instruction: Instruction) -> list[tuple[str, int | None]]:
        """The values `instruction` reads, by key: a run's task inputs, a send's value,
        and the value a receive with `accumulate` adds into."""
        if isinstance(instruction, Run):
            return [self.key(name, run.microbatch) for run in instruction.runs for name in self.tasks[run.task].inputs]
        if isinstance(instruction, Send) or (isinstance(instruction, Recv) and instruction.accumulate):
            return [self.key(instruction.value, instruction.microbatch)]
        return []

    def writes(self, instruction: Instruction) -> list[tuple[str, int | None]]:
        """The values `instruction` makes, by key: a run's task outputs (an `accumulated`
        one is added to the value held), a receive's value."""
        if isinstance(instruction, Run):
            return [self.key(name, run.microbatch) for run in instruction.runs for name in self.tasks[run.task].outputs]
        if isinstance(instruction, Recv):
            return [self.key(instruction.value, instruction.microbatch)]
        return []

    def without_graphs(self) -> "RankProgram":
        """This program with tasks that keep no graph: what the runtime holds once every
        task is compiled and what it reads of their graphs is read (see `ProgramExecutor`).
        A graph's nodes carry the fake value of every intermediate of a stage, which
        would otherwise live as long as the compiled step."""
        tasks = {name: replace(task, graph=None) for name, task in self.tasks.items()}
        return replace(self, tasks=tasks)

    def output_keys(self, name: str) -> list[tuple[str, int | None]]:
        """The keys the output `name` is handed back from: one a step, or one a microbatch
        (a user's output beside the loss, which the runtime concatenates along dim 0, or
        reduces as `reduced` says)."""
        return [self.key(name, m) for m in ((None,) if name in self.per_step else range(self.num_microbatches))]

    def frees_after(self) -> list[list[tuple[str, int | None]]]:
        """Per instruction, the values freed once it has run: each value after the last
        instruction that reads it, except the program's outputs (what the runtime's
        `ProgramExecutor` drops)."""
        kept = {key for name in self.outputs for key in self.output_keys(name)}
        last_read: dict[tuple[str, int | None], int] = {}
        for index, instruction in enumerate(self.instructions):
            for key in self.reads(instruction):
                last_read[key] = index
        freed: list[list[tuple[str, int | None]]] = [[] for _ in self.instructions]
        for key, index in last_read.items():
            if key not in kept:
                freed[index].append(key)
        return freed

    def communication_bytes(self) -> dict[str, int]:
        """Bytes this rank contributes per step, per collective kind and to point-to-point sends."""
        per_task: dict[str, dict[str, int]] = {}
        for task in self.tasks.values():
            counts = per_task.setdefault(task.name, {})
            for node in task.graph.graph.nodes:
                kind = collective_kind(node)
                if kind is not None:
                    shape, dtype = collective_sends(node)
                    counts[kind] = counts.get(kind, 0) + math.prod(shape) * dtype.itemsize
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


class Level(enum.IntEnum):
    """The level a program is at, in the order the passes lower it (ARCHITECTURE.md)."""

    JOINT = 1     # the joint forward/backward graph with placements: `JointLevel`
    STAGED = 2    # stage tasks and the schedule that orders them: `StagedLevel`
    PROGRAMS = 3  # one instruction list per rank: `ProgramLevel`

    def __str__(self) -> str:
        return {Level.JOINT: "joint", Level.STAGED: "staged", Level.PROGRAMS: "program"}[self] + " level"


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
    # name); they end the step with the same summed gradient. Also the one rank
    # whose stage updates each buffer the forward mutates (`update_buffers`).
    parameter_holders: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # The holders an earlier compile of the model gave each parameter (by placeholder name),
    # which `split_stages` keeps: the other pipeline ranks let go of its storage then.
    kept_holders: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def copy(self) -> "TrainingDAG":
        """A DAG with its own copy of the joint graph, before any tasks: passes
        transform the copy in place, so one capture can be planned for many ranks."""
        graph = fx.Graph()
        graph.output(graph.graph_copy(self.joint.graph, {}))
        return TrainingDAG(make_graph_module(self.joint, graph), [replace(i) for i in self.inputs],
                           [replace(o) for o in self.outputs], self.strategy, self.dp_group, self.training,
                           kept_holders=dict(self.kept_holders))

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

    def inputs_by_argument(self) -> dict[int, GraphInput]:
        """The inputs that are the compiled call's arguments, by the argument's index."""
        return {i.arg_index: i for i in self.inputs if i.arg_index is not None}

    def mutated_inputs(self) -> list[tuple[GraphOutput, GraphInput]]:
        """Each input the forward mutates in place (a MUTATION output: its new value), with it."""
        by_argument = self.inputs_by_argument()
        return [(o, by_argument[o.index]) for o in self.outputs if o.role is OutputRole.MUTATION]

    def drop_outputs(self, names: set[str]) -> None:
        """No longer return the outputs named `names` (from the joint graph and `self.outputs`)."""
        out = self.output_node()
        kept = [(spec, node) for spec, node in zip(self.outputs, out.args[0]) if spec.name not in names]
        out.args = (tuple(node for _, node in kept),)
        self.outputs = [spec for spec, _ in kept]
        self.joint.recompile()

    def set_outputs(self, nodes: list[fx.Node]) -> None:
        """Replace the joint graph's outputs, keeping `self.outputs` in step."""
        out = self.output_node()
        out.args = (tuple(nodes),)
        for spec, node in zip(self.outputs, nodes):
            spec.name = node.name

    @property
    def level(self) -> Level:
        """The level the DAG is at, by what it holds: rank programs, else stage tasks, else the joint graph."""
        if self.programs:
            return Level.PROGRAMS
        return Level.STAGED if self.tasks else Level.JOINT

    def view(self) -> "JointLevel | StagedLevel | ProgramLevel":
        """The DAG as the level it is at; `dag.view().verify()` checks that level's invariants."""
        if self.level is Level.PROGRAMS:
            return ProgramLevel(self.programs, self.strategy.dp)
        return StagedLevel(self) if self.level is Level.STAGED else JointLevel(self)


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


def _verifier():
    from . import verify  # imported when used: verify.py builds on this module
    return verify


class _Checked:
    """A level: `problems()` lists each broken invariant, naming the node, task or
    instruction at fault; `verify()` raises them."""

    level: ClassVar[Level]

    def problems(self) -> list[str]:
        raise NotImplementedError

    def verify(self, after_pass: str | None = None) -> None:
        """Raise `verify.InvalidGraphError` listing every broken invariant, naming
        `after_pass`, the pass that made this level, if given."""
        _verifier().raise_if_invalid(self.problems(), self.level, after_pass)


@dataclass
class JointLevel(_Checked):
    """Level 1: the joint forward/backward ATen graph of one step, with placements.

    Made by `capture.capture`; the joint passes rewrite it (experts, ZeRO
    gathers, gradient reductions as functional collectives; placements).
    Invariants:
      - the graph is well formed: node names unique, its inputs distinct Python
        argument names (so its generated code compiles), every node reads only
        nodes defined before it;
      - `dag.inputs` describe its placeholders, one each, and `dag.outputs`
        what it returns, in order;
      - every placeholder, and every op whose value is read, carries its `val`
        (shape, dtype, device), by which later levels cut tasks and size messages;
      - once placements are propagated, every placeholder and op has one
        (`node.meta["piper_spec"]`).
    """

    dag: TrainingDAG
    level: ClassVar[Level] = Level.JOINT

    def problems(self) -> list[str]:
        return _verifier().joint_problems(self.dag)


@dataclass
class StagedLevel(_Checked):
    """Level 2: the stage tasks (`dag.tasks`) and the schedule that orders them.

    Made by `split_stages` from the joint graph; rewritten task by task
    (backward split, bucketing, overlap).
    Invariants:
      - every task graph is well formed and takes and returns the values its
        `inputs` and `outputs` name; task names are unique;
      - `dag.schedule` is set and valid, and every action it lists has its task
        (kind and model stage; an I or W action, a backward task of its stage:
        B until `split_backward`, and a split part may be empty);
      - every value a task reads is a step input or made by a task; a value is
        made by one task, or by a stage's whole backward B and its split I / W;
        and values flow as the schedule runs: a forward task (P, F) reads only
        forward values of its own or earlier stages, a backward (B, I) no
        backward value of its own or an earlier stage, a W none of an earlier
        stage, and no task reads an epilogue's (E) value;
      - every output of the step is made by a task or is a step input.
    """

    dag: TrainingDAG
    level: ClassVar[Level] = Level.STAGED

    def problems(self) -> list[str]:
        return _verifier().staged_problems(self.dag)


@dataclass
class ProgramLevel(_Checked):
    """Level 3: rank programs, instruction lists of `Run`, `Send` and `Recv`; the
    collectives are in the tasks the runs call.

    Made by `build_rank_programs`; `fuse_overlapped_pairs` rewrites them. One
    rank's plan holds the programs of its pipeline (the ranks of its
    data-parallel index); `programs` may hold every rank's.
    Invariants:
      - every task a program runs is one it holds, and well formed;
      - every value is defined before it is read: a step input, or made by an
        earlier run or receive;
      - no instruction reads a value after it is freed (`RankProgram.frees_after`):
        nor adds to it, which would silently restart a sum;
      - between two ranks, every send is matched by one receive on the peer, of
        the same value, in the same order (NCCL matches by order);
      - the ranks of a process group issue the same collectives (kind, shape,
        dtype) in the same order. A group is named by its name and the rank's
        pipeline index, `rank // dp` (every group lies within one: data
        parallel, expert, expert replica), since programs planned in one
        process carry the planning rank's group names; `group_of(rank, name)`
        says otherwise. One rank's plan holds one rank per pipeline index, so
        this needs every rank's programs (`tests/test_verify.py`).
    """

    programs: dict[int, RankProgram]
    dp: int = 1
    group_of: Callable[[int, str], Hashable] | None = None
    level: ClassVar[Level] = Level.PROGRAMS

    def problems(self) -> list[str]:
        dp = self.dp
        return _verifier().program_problems(self.programs, self.group_of or (lambda rank, name: (rank // dp, name)))
