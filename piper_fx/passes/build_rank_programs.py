"""Pass: lower the schedule and the stage tasks to each rank's program.

Requires: `dag.schedule` (validated) and `dag.tasks` (F<s>, B<s> or I<s>/W<s>,
and P<s>/E<s> where a stage has once-per-step ops); the strategy's mesh.
Guarantees: `dag.programs[r]` is the program of every rank r sharing this
rank's data-parallel index (the whole pipeline of its replica): for each action
of the rank's schedule row, a `Recv` of every input produced on another
pipeline rank (just before its first reader), `Run(task, microbatch)`, and a
`Send` of every output read on another pipeline rank. A stage's prologue runs
before its first action and its epilogue after its last. Gradients and the
loss accumulate over microbatches; at the end the last stage sends the loss to
every other pipeline rank, so all return it.
Each transfer has its own tag, so receives never match the wrong message; and
since every transfer follows a schedule dependency, a schedule that validates
cannot deadlock at run time (sends do not block). Without a pipeline this is
one rank running P0, F0, B0, E0 (those that exist).
"""
from __future__ import annotations

from ..ir import InputRole, OutputRole, RankProgram, Recv, Run, Send, Task, TaskKind, TrainingDAG
from ..options import Strategy


def build_rank_programs(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    schedule = dag.schedule
    tasks = {(t.stage, t.kind): t for t in dag.tasks}
    joint_nodes = {n.name: n for n in dag.joint.graph.nodes}
    producer: dict[str, Task] = {out: t for t in dag.tasks for out in t.outputs}
    consumers: dict[str, list[Task]] = {}
    for t in dag.tasks:
        for name in t.inputs:
            consumers.setdefault(name, []).append(t)
    once_per_step = (TaskKind.P, TaskKind.E)

    per_microbatch_inputs = {i.name for i in dag.inputs if i.role in (InputRole.INPUT, InputRole.TANGENT)}
    # Summed over microbatches: the loss, gradients, and what an epilogue reduces.
    accumulated = {o.name for o in dag.outputs if o.role in (OutputRole.LOSS, OutputRole.GRAD)}
    accumulated |= {name for name in producer if producer[name].kind not in once_per_step
                    and any(c.kind is TaskKind.E for c in consumers.get(name, []))}
    loss = next((o.name for o in dag.outputs if o.role is OutputRole.LOSS), None)
    if loss is None:  # inference: the first user output plays the loss's part for the broadcast
        loss = next(o.name for o in dag.outputs if o.role is OutputRole.OUTPUT)
        accumulated.add(loss)
    accumulated -= {name for name in accumulated if producer[name].kind in once_per_step}
    per_step = ({i.name for i in dag.inputs if i.name not in per_microbatch_inputs} | accumulated
                | {name for name, t in producer.items() if t.kind in once_per_step})

    def pp_rank_of(task: Task) -> int:
        return schedule.stage_to_rank[task.stage]

    transferred = sorted(name for name, t in producer.items()
                         if any(pp_rank_of(c) != pp_rank_of(t) for c in consumers.get(name, [])))
    slots = strategy.microbatches + 1  # one tag per microbatch, and one for a per-step value

    def tag(name: str, microbatch: int | None) -> int:
        return transferred.index(name) * slots + (strategy.microbatches if microbatch is None else microbatch)

    broadcast_tag = len(transferred) * slots

    def global_rank(pp_rank: int) -> int:
        return pp_rank * strategy.dp + strategy.dp_index

    loss_pp_rank = pp_rank_of(producer[loss])
    for pp_rank in range(strategy.pp):
        instructions = []
        received: set[tuple[str, int | None]] = set()

        def run(task: Task, microbatch: int | None) -> None:
            for name in task.inputs:
                source = producer.get(name)
                m = None if name in per_step else microbatch
                if source is None or pp_rank_of(source) == pp_rank or (name, m) in received:
                    continue
                val = joint_nodes[name].meta["val"]
                instructions.append(Recv(name, m, global_rank(pp_rank_of(source)), tag(name, m),
                                         tuple(val.shape), val.dtype))
                received.add((name, m))
            instructions.append(Run(task.name, microbatch))
            for name in task.outputs:
                if name in accumulated:
                    continue  # complete only after the last microbatch; read by this rank's epilogue
                m = None if name in per_step else microbatch
                peers = sorted({pp_rank_of(c) for c in consumers.get(name, [])} - {pp_rank})
                instructions.extend(Send(name, m, global_rank(p), tag(name, m)) for p in peers)

        row = schedule.actions[pp_rank]
        for index, action in enumerate(row):
            stage_actions = [a for a in row if a.stage == action.stage]
            if action is stage_actions[0] and (action.stage, TaskKind.P) in tasks:
                run(tasks[(action.stage, TaskKind.P)], None)
            task = tasks.get((action.stage, TaskKind(action.kind)))
            if task is not None:
                run(task, action.microbatch)
            if action is stage_actions[-1] and (action.stage, TaskKind.E) in tasks:
                run(tasks[(action.stage, TaskKind.E)], None)
        if strategy.pp > 1:
            if pp_rank == loss_pp_rank:
                instructions.extend(Send(loss, None, global_rank(p), broadcast_tag)
                                    for p in range(strategy.pp) if p != pp_rank)
            else:
                loss_val = joint_nodes[loss].meta["val"]
                instructions.append(Recv(loss, None, global_rank(loss_pp_rank), broadcast_tag,
                                         tuple(loss_val.shape), loss_val.dtype))
        rank = global_rank(pp_rank)
        run_tasks = {i.task for i in instructions if isinstance(i, Run)}
        dag.programs[rank] = RankProgram(
            rank=rank,
            tasks={t.name: t for t in dag.tasks if t.name in run_tasks},
            instructions=instructions,
            inputs=[i.name for i in dag.inputs],
            per_step=per_step,
            accumulated=accumulated,
            outputs=[o.name for o in dag.outputs],
            num_microbatches=strategy.microbatches,
        )
    return dag
