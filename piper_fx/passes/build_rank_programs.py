"""Pass: lower the schedule and the stage tasks to each rank's program.

Requires: `dag.schedule` (validated) and `dag.tasks` (F<s>, B<s> and/or I<s>/W<s>,
and P<s>/E<s> where a stage has once-per-step ops, for each model stage s);
`dag.parameter_holders`; the strategy's mesh.
Guarantees: `dag.programs[r]` is the program of every rank r sharing this
rank's data-parallel index (the whole pipeline of its replica): for each step
of the rank's schedule row (an action, or an overlapped F&B pair), a `Recv` of
every input produced on another pipeline rank, then `Run(task, microbatch)`
(for a pair, one `Run` of the fused task named `F<s>&B<t>`, with both halves
as its `parts`: the program holds that task, computing the first half then the
second; `fuse_overlapped_pairs` may interleave them) and a `Send` of every
output read on another pipeline rank. Receives are
posted one step ahead (a pair's both before either runs), so they arrive while
the rank computes. A stage's prologue runs before its first action and its
epilogue after its last.
Gradients and the loss accumulate over microbatches. A parameter held by
several pipeline ranks (tied across stages, or under DualPipe's two copies)
ends the step with the same gradient on all of them: each rank that computed a
part sends it to the others, which add it to theirs. Likewise each rank that
computed part of the loss sends it to every other pipeline rank, so all
return the whole loss. A user's output beside the loss is handed back by the
rank whose stage makes it, one per microbatch (None on the others, as
torch.distributed.pipelining returns a stage's output on its rank alone); a
stage that makes one and runs on two ranks (bidirectional DualPipe) is a
`PiperError`.
Between any two ranks, receives are posted in the order the peer sends (as
NCCL, which ignores tags, needs); each transfer also has its own tag, so
under gloo too a receive never matches the wrong message; and
since every transfer follows a schedule dependency, a schedule that validates
cannot deadlock at run time (sends do not block). Each send that the peer
answers (a message it sends back after its first read of the sent value) is
acknowledged by that answer's receive (`RankProgram.acknowledged_by`): once it
has arrived, the sent tensor is the peer's, and the runtime lets go of it
(gloo reports a send complete only once it is waited for, and waiting for one
the peer has not received would block). Without a pipeline this is
one rank running P0, F0, B0, E0 (those that exist).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ..errors import PiperError
from ..ir import (InputRole, Instruction, OutputRole, RankProgram, Recv, Run, Send, Task, TaskKind,
                  TrainingDAG, message_layout, wire_shape)
from ..options import Strategy
from ..schedules import PAIR_SEPARATOR, Action, Schedule
from .task_graphs import fuse_tasks

ONCE_PER_STEP = (TaskKind.P, TaskKind.E)

# A task to run, for a microbatch, or None for a once-per-step task.
Planned = tuple[Task, int | None]


def build_rank_programs(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    flow = _value_flow(dag)
    transfers = _Transfers(dag, strategy, flow)
    _check_outputs_on_one_rank(dag, flow, transfers)
    summed = _summed_over_ranks(dag, strategy, flow)
    tasks = {(t.stage, t.kind): t for t in dag.tasks}
    fused: dict[str, Task] = {}  # one fused task per pair of tasks, shared by every rank running it
    for pp_rank in range(strategy.pp):
        instructions = _lower_steps(_planned_steps(dag.schedule, tasks, pp_rank), transfers, pp_rank)
        instructions += _sum_over_ranks(summed, flow, transfers, pp_rank)
        rank = transfers.global_rank(pp_rank)
        dag.programs[rank] = RankProgram(
            rank=rank,
            tasks=_program_tasks(dag, instructions, fused),
            instructions=instructions,
            inputs=[i.name for i in dag.inputs],
            per_step=flow.per_step,
            accumulated=flow.accumulated,
            outputs=[o.name for o in dag.outputs],
            num_microbatches=strategy.microbatches,
            reduced={o.name: o.reduced_by for o in dag.outputs if o.reduced_by},
        )
    _receive_in_send_order(dag.programs)
    _acknowledge_sends(dag.programs)
    return dag


@dataclass
class _ValueFlow:
    """Which task makes each value and which read it, and how often a value is made."""

    producer: dict[str, Task]
    consumers: dict[str, list[Task]]
    per_step: set[str]     # one value per step, not per microbatch
    accumulated: set[str]  # summed over microbatches
    loss: str | None       # the loss (in inference, a floating scalar output), which every pipeline rank returns


def _value_flow(dag: TrainingDAG) -> _ValueFlow:
    producer: dict[str, Task] = {out: t for t in dag.tasks for out in t.outputs}
    consumers: dict[str, list[Task]] = {}
    for t in dag.tasks:
        for name in t.inputs:
            consumers.setdefault(name, []).append(t)
    per_microbatch_inputs = {i.name for i in dag.inputs
                             if i.role in (InputRole.INPUT, InputRole.TANGENT, InputRole.RNG)}
    # Summed over microbatches: the loss, gradients, and what an epilogue reduces.
    accumulated = {o.name for o in dag.outputs if o.role in (OutputRole.LOSS, OutputRole.GRAD)}
    accumulated |= {name for name in producer if producer[name].kind not in ONCE_PER_STEP
                    and any(c.kind is TaskKind.E for c in consumers.get(name, []))}
    loss = next((o.name for o in dag.outputs if o.role is OutputRole.LOSS), None)
    accumulated -= {name for name in accumulated if producer[name].kind in ONCE_PER_STEP}
    per_step = ({i.name for i in dag.inputs if i.name not in per_microbatch_inputs} | accumulated
                | {name for name, t in producer.items() if t.kind in ONCE_PER_STEP})
    return _ValueFlow(producer, consumers, per_step, accumulated, loss)


class _Transfers:
    """The point-to-point transfers of one pipeline (the ranks of one data-parallel
    index): which rank sends each value to which, and under which tag."""

    def __init__(self, dag: TrainingDAG, strategy: Strategy, flow: _ValueFlow) -> None:
        self.schedule, self.strategy, self.flow = dag.schedule, strategy, flow
        self.joint_nodes = {n.name: n for n in dag.joint.graph.nodes}
        self.slots = strategy.microbatches + 1  # one tag per microbatch, and one for a per-step value
        self.index_of = {name: i for i, name in enumerate(sorted(flow.producer))}
        self.final_tag = len(self.index_of) * self.slots  # + index among the values summed over ranks at the end

    def ranks_running(self, stage: int) -> list[int]:
        return sorted({self.schedule.stage_rank(stage, m) for m in range(self.strategy.microbatches)})

    def source_rank(self, task: Task, microbatch: int | None, reader: int) -> int:
        """Where a value `task` makes for `microbatch` comes from, for a reader on pipeline rank `reader`."""
        if microbatch is not None:
            return self.schedule.stage_rank(task.stage, microbatch)
        ranks = self.ranks_running(task.stage)  # a per-step value: every rank running the stage has it
        return reader if reader in ranks else ranks[0]

    def tag(self, name: str, microbatch: int | None) -> int:
        return self.index_of[name] * self.slots + (self.strategy.microbatches if microbatch is None else microbatch)

    def global_rank(self, pp_rank: int) -> int:
        return pp_rank * self.strategy.dp + self.strategy.dp_index

    def microbatch_of(self, name: str, microbatch: int | None) -> int | None:
        """The microbatch a value is keyed by when a task runs for `microbatch`: None if per step."""
        return None if name in self.flow.per_step else microbatch

    def send(self, name: str, microbatch: int | None, peer: int, tag: int) -> Send:
        val = self.joint_nodes[name].meta["val"]
        broadcast, order, _ = message_layout(val.shape, val.stride())
        nbytes = math.prod(wire_shape(val.shape, broadcast)) * val.element_size()
        return Send(name, microbatch, self.global_rank(peer), tag, nbytes, order, broadcast)

    def recv(self, name: str, microbatch: int | None, peer: int, tag: int, accumulate: bool = False) -> Recv:
        val = self.joint_nodes[name].meta["val"]
        broadcast, order, stride = message_layout(val.shape, val.stride())
        return Recv(name, microbatch, self.global_rank(peer), tag, tuple(val.shape), val.dtype, accumulate,
                    val.device, order=order, broadcast=broadcast, stride=stride)

    def receives(self, task: Task, microbatch: int | None, pp_rank: int,
                 received: set[tuple[str, int | None]]) -> list[Instruction]:
        """The receives `pp_rank` posts for the inputs of `task` made elsewhere and not yet `received`."""
        out = []
        for name in task.inputs:
            source = self.flow.producer.get(name)
            m = self.microbatch_of(name, microbatch)
            if source is None or (name, m) in received:
                continue
            peer = self.source_rank(source, m, pp_rank)
            if peer != pp_rank:
                out.append(self.recv(name, m, peer, self.tag(name, m)))
                received.add((name, m))
        return out

    def sends(self, task: Task, microbatch: int | None, pp_rank: int) -> list[Instruction]:
        """The sends of what `task` made on `pp_rank` to the other ranks that read it from there."""
        out: list[Instruction] = []
        for name in task.outputs:
            if name in self.flow.accumulated:
                continue  # complete only after the last microbatch; read by this rank's epilogue
            m = self.microbatch_of(name, microbatch)
            peers = set()
            for reader in self.flow.consumers.get(name, []):
                for reader_rank in ([self.schedule.stage_rank(reader.stage, m)] if m is not None
                                    else self.ranks_running(reader.stage)):
                    if reader_rank != pp_rank and self.source_rank(task, m, reader_rank) == pp_rank:
                        peers.add(reader_rank)
            out.extend(self.send(name, m, p, self.tag(name, m)) for p in sorted(peers))
        return out


def _planned_steps(schedule: Schedule, tasks: dict[tuple[int, TaskKind], Task],
                   pp_rank: int) -> list[tuple[list[Planned], list[Planned], list[Planned]]]:
    """Each step of the rank's schedule row (an action or an overlapped pair) as the
    tasks it runs: (prologues, the actions' tasks, epilogues), with a stage's
    prologue before its first action and its epilogue after its last."""
    row: list[Action] = schedule.actions[pp_rank]
    first = {}
    last = {}
    for index, action in enumerate(row):
        first.setdefault(action.stage, index)
        last[action.stage] = index
    planned, index = [], 0
    for step in schedule.steps(pp_rank):
        before, actions, after = [], [], []
        for action in step:
            stage = schedule.model_stage(action.stage)
            if first[action.stage] == index and (stage, TaskKind.P) in tasks:
                before.append((tasks[(stage, TaskKind.P)], None))
            if (stage, TaskKind.of(action.kind)) in tasks:
                actions.append((tasks[(stage, TaskKind.of(action.kind))], action.microbatch))
            if last[action.stage] == index and (stage, TaskKind.E) in tasks:
                after.append((tasks[(stage, TaskKind.E)], None))
            index += 1
        planned.append((before, actions, after))
    return planned


def _run_and_send(planned: list[Planned], transfers: _Transfers, pp_rank: int) -> list[Instruction]:
    """One task's run, or an overlapped pair's fused run, then the sends of what they made."""
    runs = [Run(task.name, m) for task, m in planned]
    run = runs[0] if len(runs) == 1 else Run(PAIR_SEPARATOR.join(r.task for r in runs), None, tuple(runs))
    return [run] + [send for task, m in planned for send in transfers.sends(task, m, pp_rank)]


def _lower_steps(steps: list[tuple[list[Planned], list[Planned], list[Planned]]], transfers: _Transfers,
                 pp_rank: int) -> list[Instruction]:
    """The steps as instructions: each step's receives, posted one step ahead (so they
    arrive while the rank computes), then its runs and sends. A pair's two tasks
    run as one fused task, after both prologues and before both epilogues."""
    received: set[tuple[str, int | None]] = set()
    lowered: list[tuple[list[Instruction], list[Instruction]]] = []
    for before, actions, after in steps:
        recvs = [r for task, m in before + actions + after for r in transfers.receives(task, m, pp_rank, received)]
        runs = [i for item in before for i in _run_and_send([item], transfers, pp_rank)]
        if actions:
            runs += _run_and_send(actions, transfers, pp_rank)
        runs += [i for item in after for i in _run_and_send([item], transfers, pp_rank)]
        lowered.append((recvs, runs))
    instructions: list[Instruction] = list(lowered[0][0]) if lowered else []
    for k, (_, runs) in enumerate(lowered):
        if k + 1 < len(lowered):
            instructions += lowered[k + 1][0]  # post the next step's receives before running this one
        instructions += runs
    return instructions


def _check_outputs_on_one_rank(dag: TrainingDAG, flow: _ValueFlow, transfers: "_Transfers") -> None:
    """A user's output beside the loss is made by one pipeline rank, which returns it."""
    for output in dag.outputs:
        if output.role is OutputRole.OUTPUT and output.name in flow.producer:
            stage = flow.producer[output.name].stage
            ranks = transfers.ranks_running(stage)
            if len(ranks) > 1:
                raise PiperError(
                    f"the model's output {output.index} ({output.made_at or output.name}) is made by stage "
                    f"{stage}, which this schedule runs on pipeline ranks {ranks}, each for some microbatches: "
                    "piper_fx returns an output beside the loss from the one rank that makes it. Return it "
                    "under a schedule that runs each stage on one rank (dualpipev, say), or compile a module "
                    "that returns the loss alone (for a Hugging Face model, one returning model(...).loss)")


def _summed_over_ranks(dag: TrainingDAG, strategy: Strategy, flow: _ValueFlow) -> dict[str, list[int]]:
    """Values summed over pipeline ranks at the end of the step, with the ranks that
    end with the sum: the loss, and the gradients of parameters held by several ranks."""
    grad_param = {o.name: i.name for o in dag.outputs if o.role is OutputRole.GRAD
                  for i in dag.inputs if i.arg_index == o.index}
    summed = {flow.loss: list(range(strategy.pp))} if strategy.pp > 1 and flow.loss is not None else {}
    for grad, param in grad_param.items():
        holders = dag.parameter_holders.get(param, ())
        if len(holders) > 1 and grad in flow.producer:
            summed[grad] = list(holders)
    return summed


def _sum_over_ranks(summed: dict[str, list[int]], flow: _ValueFlow, transfers: _Transfers,
                    pp_rank: int) -> list[Instruction]:
    """The rank's sends of its parts of the summed values, then its receives of the
    others' parts, added to its own."""
    order = sorted(summed)
    instructions: list[Instruction] = []
    for i, name in enumerate(order):
        if pp_rank in transfers.ranks_running(flow.producer[name].stage):
            instructions += [transfers.send(name, None, p, transfers.final_tag + i)
                             for p in summed[name] if p != pp_rank]
    for i, name in enumerate(order):
        if pp_rank in summed[name]:
            instructions += [transfers.recv(name, None, p, transfers.final_tag + i, accumulate=True)
                             for p in transfers.ranks_running(flow.producer[name].stage) if p != pp_rank]
    return instructions


def _program_tasks(dag: TrainingDAG, instructions: list[Instruction], fused: dict[str, Task]) -> dict[str, Task]:
    """The tasks the instructions run, with a fused task (its halves one after the
    other) for each overlapped pair, made once and shared through `fused`."""
    run_tasks = {run.task for i in instructions if isinstance(i, Run) for run in i.runs}
    held = {t.name: t for t in dag.tasks if t.name in run_tasks}
    for pair in (i for i in instructions if isinstance(i, Run) and i.parts):
        if pair.task not in fused:
            fused[pair.task] = fuse_tasks(pair.task, [held[run.task] for run in pair.parts])
        held[pair.task] = fused[pair.task]
    return held


def _receive_in_send_order(programs: dict[int, RankProgram]) -> None:
    """Reorder each rank's receives so that it posts those from each peer in the order the
    peer sends them.

    NCCL matches point-to-point messages between two ranks by their order on each side
    (tags are ignored), so the order must agree, not just the set; the schedule orders a
    rank's receives by its own actions and the peer's sends by the peer's. A receive only
    moves earlier: to the latest position that keeps the peer's order, no later than where
    it was, so it is still posted before its first reader (a buffer allocated sooner is
    the only cost).
    """
    for rank, program in programs.items():
        instructions = program.instructions
        posted_at: dict[int, dict[tuple[str, int | None], int]] = {}
        for index, instruction in enumerate(instructions):
            if isinstance(instruction, Recv):
                posted_at.setdefault(instruction.peer, {})[(instruction.value, instruction.microbatch)] = index
        position: dict[int, tuple[int, int, int]] = {}
        for peer, at in posted_at.items():
            sent = [(i.value, i.microbatch) for i in programs[peer].instructions
                    if isinstance(i, Send) and i.peer == rank]
            if sorted(sent, key=repr) != sorted(at, key=repr):
                continue  # not the same messages: left as built, for the verifier to name
            order = [at[key] for key in sent]
            latest = len(instructions)
            for k in reversed(range(len(order))):  # each no later than any receive after it
                latest = min(latest, order[k])
                position[order[k]] = (latest, peer, k)
        keyed = [((position[i][0], 0, position[i][1], position[i][2]) if i in position else (i, 1, 0, 0), ins)
                 for i, ins in enumerate(instructions)]
        program.instructions = [ins for _, ins in sorted(keyed, key=lambda item: item[0])]


def _acknowledge_sends(programs: dict[int, RankProgram]) -> None:
    """Set each program's `acknowledged_by`: for a send to a peer, the first message the peer
    sends back at or after its first instruction reading the sent value (where its runtime
    waits for the receive; not a receive, which waits for nothing), if any. Such a message
    leaves the peer only once the send's bytes have arrived there."""
    # rank -> (sender, tag) of a receive there -> tag of its answer (tags are a pair's own)
    answers: dict[int, dict[tuple[int, int], int]] = {}
    for rank, program in programs.items():
        instructions = program.instructions
        readers: dict[tuple, list[int]] = {}  # value -> the instructions reading it, in order
        sends: dict[int, list[int]] = {}  # peer -> the positions of the sends to it
        for index, instruction in enumerate(instructions):
            if isinstance(instruction, Send):
                sends.setdefault(instruction.peer, []).append(index)
            if not isinstance(instruction, Recv):
                for key in program.reads(instruction):
                    readers.setdefault(key, []).append(index)
        answers[rank] = {}
        for index, instruction in enumerate(instructions):
            if not isinstance(instruction, Recv):
                continue
            read = readers.get(program.key(instruction.value, instruction.microbatch), [])
            first_read = read[bisect.bisect_right(read, index)] if read and read[-1] > index else None
            back = sends.get(instruction.peer, [])
            if first_read is not None and back and back[-1] >= first_read:
                answers[rank][(instruction.peer, instruction.tag)] = \
                    instructions[back[bisect.bisect_left(back, first_read)]].tag
    for rank, program in programs.items():
        for send in (i for i in program.instructions if isinstance(i, Send)):
            answer = answers.get(send.peer, {}).get((rank, send.tag))
            if answer is not None:
                program.acknowledged_by[(send.peer, send.tag)] = answer
