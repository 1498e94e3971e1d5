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
return the whole loss.
Between any two ranks, receives are posted in the order the peer sends (as
NCCL, which ignores tags, needs); each transfer also has its own tag, so
under gloo too a receive never matches the wrong message; and
since every transfer follows a schedule dependency, a schedule that validates
cannot deadlock at run time (sends do not block). Without a pipeline this is
one rank running P0, F0, B0, E0 (those that exist).
"""
from __future__ import annotations

from ..ir import (InputRole, Instruction, OutputRole, RankProgram, Recv, Run, Send, Task, TaskKind,
                  TrainingDAG)
from ..options import Strategy
from .fuse_overlapped_pairs import fuse_tasks

ONCE_PER_STEP = (TaskKind.P, TaskKind.E)


def build_rank_programs(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    schedule = dag.schedule
    M = strategy.microbatches
    tasks = {(t.stage, t.kind): t for t in dag.tasks}
    fused: dict[str, Task] = {}  # one fused task per pair of tasks, shared by every rank running it
    joint_nodes = {n.name: n for n in dag.joint.graph.nodes}
    producer: dict[str, Task] = {out: t for t in dag.tasks for out in t.outputs}
    consumers: dict[str, list[Task]] = {}
    for t in dag.tasks:
        for name in t.inputs:
            consumers.setdefault(name, []).append(t)

    per_microbatch_inputs = {i.name for i in dag.inputs if i.role in (InputRole.INPUT, InputRole.TANGENT)}
    # Summed over microbatches: the loss, gradients, and what an epilogue reduces.
    accumulated = {o.name for o in dag.outputs if o.role in (OutputRole.LOSS, OutputRole.GRAD)}
    accumulated |= {name for name in producer if producer[name].kind not in ONCE_PER_STEP
                    and any(c.kind is TaskKind.E for c in consumers.get(name, []))}
    loss = next((o.name for o in dag.outputs if o.role is OutputRole.LOSS), None)
    if loss is None:  # inference: the first user output plays the loss's part for the broadcast
        loss = next(o.name for o in dag.outputs if o.role is OutputRole.OUTPUT)
        accumulated.add(loss)
    accumulated -= {name for name in accumulated if producer[name].kind in ONCE_PER_STEP}
    per_step = ({i.name for i in dag.inputs if i.name not in per_microbatch_inputs} | accumulated
                | {name for name, t in producer.items() if t.kind in ONCE_PER_STEP})

    def ranks_running(stage: int) -> list[int]:
        return sorted({schedule.stage_rank(stage, m) for m in range(M)})

    def source_rank(task: Task, microbatch: int | None, reader: int) -> int:
        """Where a value `task` makes for `microbatch` comes from, for a reader on pipeline rank `reader`."""
        if microbatch is not None:
            return schedule.stage_rank(task.stage, microbatch)
        ranks = ranks_running(task.stage)  # a per-step value: every rank running the stage has it
        return reader if reader in ranks else ranks[0]

    names = sorted(producer)
    slots = M + 1  # one tag per microbatch, and one for a per-step value
    index_of = {name: i for i, name in enumerate(names)}

    def tag(name: str, microbatch: int | None) -> int:
        return index_of[name] * slots + (M if microbatch is None else microbatch)

    final_tag = len(names) * slots  # + index among the values summed over ranks at the end

    def global_rank(pp_rank: int) -> int:
        return pp_rank * strategy.dp + strategy.dp_index

    def nbytes(name: str) -> int:
        val = joint_nodes[name].meta["val"]
        return val.numel() * val.element_size()

    def recv(name: str, microbatch: int | None, peer: int, tag_: int, accumulate: bool = False) -> Recv:
        val = joint_nodes[name].meta["val"]
        return Recv(name, microbatch, global_rank(peer), tag_, tuple(val.shape), val.dtype, accumulate, val.device)

    # Values summed over pipeline ranks at the end of the step: the loss, and
    # the gradients of parameters held by several ranks.
    grad_param = {o.name: i.name for o in dag.outputs if o.role is OutputRole.GRAD
                  for i in dag.inputs if i.arg_index == o.index}
    shared = {loss: list(range(strategy.pp))} if strategy.pp > 1 else {}
    for grad, param in grad_param.items():
        holders = dag.parameter_holders.get(param, ())
        if len(holders) > 1 and grad in producer:
            shared[grad] = list(holders)
    shared_order = sorted(shared)

    for pp_rank in range(strategy.pp):
        received: set[tuple[str, int | None]] = set()

        def receives(task: Task, microbatch: int | None) -> list[Instruction]:
            out = []
            for name in task.inputs:
                source = producer.get(name)
                m = None if name in per_step else microbatch
                if source is None or (name, m) in received:
                    continue
                peer = source_rank(source, m, pp_rank)
                if peer != pp_rank:
                    out.append(recv(name, m, peer, tag(name, m)))
                    received.add((name, m))
            return out

        def sends(task: Task, microbatch: int | None) -> list[Instruction]:
            out: list[Instruction] = []
            for name in task.outputs:
                if name in accumulated:
                    continue  # complete only after the last microbatch; read by this rank's epilogue
                m = None if name in per_step else microbatch
                peers = set()
                for reader in consumers.get(name, []):
                    for reader_rank in ([schedule.stage_rank(reader.stage, m)] if m is not None
                                        else ranks_running(reader.stage)):
                        if reader_rank != pp_rank and source_rank(task, m, reader_rank) == pp_rank:
                            peers.add(reader_rank)
                out.extend(Send(name, m, global_rank(p), tag(name, m), nbytes(name)) for p in sorted(peers))
            return out

        def run_and_send(planned: list[tuple[Task, int | None]]) -> list[Instruction]:
            """One task's run, or an overlapped pair's fused run, then the sends of what they made."""
            runs = [Run(task.name, m) for task, m in planned]
            run = runs[0] if len(runs) == 1 else Run("&".join(r.task for r in runs), None, tuple(runs))
            return [run] + [send for task, m in planned for send in sends(task, m)]

        # Each schedule step (an action or an overlapped pair, with the stage's
        # prologue before its first action and its epilogue after its last) as
        # (receives, runs and sends). A pair's two tasks run as one fused task,
        # after both prologues and before both epilogues.
        steps: list[tuple[list[Instruction], list[Instruction]]] = []
        row = schedule.actions[pp_rank]
        first = {}
        last = {}
        for index, action in enumerate(row):
            first.setdefault(action.stage, index)
            last[action.stage] = index
        index = 0
        for group in schedule.steps(pp_rank):
            before, actions, after = [], [], []
            for action in group:
                stage = schedule.model_stage(action.stage)
                if first[action.stage] == index and (stage, TaskKind.P) in tasks:
                    before.append((tasks[(stage, TaskKind.P)], None))
                if (stage, TaskKind(action.kind)) in tasks:
                    actions.append((tasks[(stage, TaskKind(action.kind))], action.microbatch))
                if last[action.stage] == index and (stage, TaskKind.E) in tasks:
                    after.append((tasks[(stage, TaskKind.E)], None))
                index += 1
            recvs = [r for task, m in before + actions + after for r in receives(task, m)]
            runs = [i for item in before for i in run_and_send([item])]
            if actions:
                runs += run_and_send(actions)
            runs += [i for item in after for i in run_and_send([item])]
            steps.append((recvs, runs))
        instructions: list[Instruction] = list(steps[0][0]) if steps else []
        for k, (_, runs) in enumerate(steps):
            if k + 1 < len(steps):
                instructions += steps[k + 1][0]  # post the next step's receives before running this one
            instructions += runs

        for i, name in enumerate(shared_order):
            producers = ranks_running(producer[name].stage)
            if pp_rank in producers:
                instructions += [Send(name, None, global_rank(p), final_tag + i, nbytes(name))
                                 for p in shared[name] if p != pp_rank]
        for i, name in enumerate(shared_order):
            if pp_rank in shared[name]:
                instructions += [recv(name, None, p, final_tag + i, accumulate=True)
                                 for p in ranks_running(producer[name].stage) if p != pp_rank]

        rank = global_rank(pp_rank)
        run_tasks = {run.task for i in instructions if isinstance(i, Run) for run in i.runs}
        held = {t.name: t for t in dag.tasks if t.name in run_tasks}
        for pair in (i for i in instructions if isinstance(i, Run) and i.parts):
            if pair.task not in fused:
                fused[pair.task] = fuse_tasks(pair.task, [held[run.task] for run in pair.parts], interleave=False)
            held[pair.task] = fused[pair.task]
        dag.programs[rank] = RankProgram(
            rank=rank,
            tasks=held,
            instructions=instructions,
            inputs=[i.name for i in dag.inputs],
            per_step=per_step,
            accumulated=accumulated,
            outputs=[o.name for o in dag.outputs],
            num_microbatches=strategy.microbatches,
        )
    _receive_in_send_order(dag.programs)
    return dag


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
