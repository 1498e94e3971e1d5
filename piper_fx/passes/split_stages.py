"""Pass: cut the joint graph into pipeline stages, each with a forward and a backward task.

Requires: the joint graph after the collective passes; `dag.schedule`, whose
stages (pp * stages_per_rank, or per copy of the stages for bidirectional
DualPipe) and placement this pass follows.
Guarantees: `dag.tasks` holds F<s> for every stage s (and B<s> when training),
plus P<s> / E<s> for the stage's once-per-step ops (marked by the collective
passes: ZeRO-1/2 gathers before the first microbatch, DDP / ZeRO-1 gradient
reductions after the last), each with its own FX graph; together they compute
exactly the joint graph.
Values keep their joint-graph node names across tasks. Stage assignment:
  - forward: `piper_fx.annotate("PP")` regions, grouped in order into the
    stages (their count must divide by the number of stages); with no region,
    contiguous runs of the forward ops balanced by estimated cost (FLOPs of
    matmuls and attention, output size otherwise, plus parameter size), each
    stage with an op reading a parameter, and no cut inside the ops one
    autograd op decomposes to (a group norm's, under Inductor's decompositions).
    Unannotated ops follow their inputs; parameter-only ops (gathers, views of
    weights) go with their first user; a stage never reads a later stage. A
    part of a multi-output op (its `getitem`) goes with the op, forward and
    backward.
  - backward: a recomputation copy (`checkpoint_activations`') goes to the
    stage of the value it copies; any other op to the stage of the forward op
    it differentiates (AOTAutograd's `seq_nr`), but never later than the
    stages of the backward values other than copies it reads, so gradients
    only flow to earlier stages; an op with neither (one whose `seq_nr` no
    forward op has) to the latest stage of its users.
Recomputation stays within a stage: where a stage boundary cuts a region of
`checkpoint_activations`, a backward op (a recomputation copy or a gradient op)
reading the copy of a value of another stage than its own reads that value
instead (kept from the forward, as the next stage's forward reads it), and
copies left unread are removed from the joint graph. So a copy pulls no
reader into its stage: a later stage's op reading a value an earlier stage's
ops recompute (Funnel's decoder builds its attention's class mask from the
encoder's output) stays with that later stage's parameters.
`dag.parameter_holders` lists, per parameter, the pipeline ranks running a
stage that reads it: several for embeddings tied across the first and last
stage, and for every parameter under DualPipe's two copies. Those ranks
exchange and sum their gradient contributions (see `build_rank_programs`).
A pipeline rank lets go of the parameters no stage of its reads, so a later
compile of the model (another batch shape, a recompile) must read each on the
ranks the first compile put it on (`dag.kept_holders`), where a cut balanced
anew would move: the cost of ops grows with the batch, that of parameters does
not. So the cut by cost moves each op as little as keeps the kept parameters
there, the stages in order and each reading a parameter (`_cut_in_order`).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..errors import PiperConfigError, PiperError
from ..ir import InputRole, Task, TaskKind, TrainingDAG, forward_nodes
from ..ops import MATMULS, PHASE, RECOMPUTES, STEP_END, STEP_START, is_attention
from ..options import Strategy
from .task_graphs import extract_graph


def _tensors(val) -> list[torch.Tensor]:
    vals = val if isinstance(val, (tuple, list)) else [val]
    return [v for v in vals if isinstance(v, torch.Tensor)]


def estimated_cost(node: fx.Node) -> float:
    """A rough cost: FLOPs for matmuls and attention, elements written otherwise."""
    outs = _tensors(node.meta.get("val"))
    if node.target in MATMULS and outs:
        return 2.0 * outs[0].numel() * node.args[-2].meta["val"].shape[-1]  # (.., K) @ (K, ..)
    if is_attention(node) and outs:
        q = node.args[0].meta["val"]
        return 4.0 * q.numel() * q.shape[-2]
    return float(sum(o.numel() for o in outs))


def _region(node: fx.Node):
    return (node.meta.get("custom") or {}).get("PP")


def _batch_dependent(dag: TrainingDAG, nodes: list[fx.Node]) -> set[fx.Node]:
    roles = dag.input_by_name()
    dependent = {n for n in dag.joint.graph.nodes
                 if n.op == "placeholder" and roles[n.name].role is InputRole.INPUT}
    for node in nodes:
        if any(i in dependent for i in node.all_input_nodes):
            dependent.add(node)
    return dependent


def _forward_stages(dag: TrainingDAG, compute: list[fx.Node], num_stages: int) -> dict[fx.Node, int]:
    activations = _batch_dependent(dag, compute)
    stage: dict[fx.Node, int] = {}
    regions = list(dict.fromkeys(r for r in map(_region, compute) if r is not None))
    if regions:
        if len(regions) % num_stages:
            raise PiperConfigError(
                "pipeline", f"{len(regions)} PP regions",
                f"the number of piper_fx.annotate('PP') regions must be a multiple of the number of stages "
                f"(pp * stages_per_rank = {num_stages}), so they group in order into stages")
        per_stage = len(regions) // num_stages
        stage_of_region = {region: i // per_stage for i, region in enumerate(regions)}
        stage.update({n: stage_of_region[_region(n)] for n in compute if _region(n) is not None})
    else:
        weighted = [n for n in compute if n in activations]
        param_bytes = {n: sum(i.meta["val"].numel() for i in n.all_input_nodes
                              if i.op == "placeholder" and i not in activations) for n in weighted}
        costs = [estimated_cost(n) + param_bytes[n] for n in weighted]
        total, running = sum(costs) or 1.0, 0.0
        for node, cost in zip(weighted, costs):
            stage[node] = min(num_stages - 1, int(num_stages * (running + cost / 2) / total))
            running += cost
        stage.update(_cut_in_order(dag, compute, weighted, stage, num_stages))
    for node in compute:  # unannotated activations follow their inputs; never read a later stage
        if node.target is operator.getitem and node.args[0] in stage:  # a part of a multi-output op lives with it
            stage[node] = stage[node.args[0]]
            continue
        inputs = [stage[i] for i in node.all_input_nodes if i in stage and i in activations]
        if inputs:
            stage[node] = max(stage.get(node, 0), *inputs)
    # What reads no computed activation (parameter-only values, or values of the
    # step's inputs alone, like reshaped targets) goes with its earliest user:
    # every rank has the parameters and the batch, so nothing is sent for it.
    for node in reversed(compute):
        if node not in stage:
            users = [stage[u] for u in node.users if u in stage]
            stage[node] = min(users) if users else num_stages - 1
    return stage


def _cut_in_order(dag: TrainingDAG, compute: list[fx.Node], weighted: list[fx.Node], balanced: dict[fx.Node, int],
                  num_stages: int) -> dict[fx.Node, int]:
    """The stages of the `weighted` ops (in order), each as near its `balanced` one (by cost) as
    keeps the stages in order, each stage with an op reading a parameter (so that it has a
    backward, and under zero bubble an I and a W, where a cut by cost leaves a stage empty if
    one op outweighs a stage's share, or with ops of no gradient), and each parameter on the
    pipeline ranks an earlier compile of the model put it on (`dag.kept_holders`): an op
    reading one (`_parameters_read`) goes to a stage that ranks holding it run. Raises a
    `PiperError` if the kept ranks leave no such cut (the model traced to other ops than at
    its first compile); with none kept, a model with fewer such ops than stages keeps `balanced`."""
    schedule = dag.schedule
    ranks_of = [{schedule.stage_rank(s, m) for m in range(schedule.num_microbatches)} for s in range(num_stages)]
    reads = _parameters_read(dag, compute, weighted)
    allowed = []
    for node in weighted:
        holders = [set(dag.kept_holders[p]) for p in reads[node] if p in dag.kept_holders]
        allowed.append([all(ranks_of[s] <= held for held in holders) for s in range(num_stages)])
    # An op may not start a stage in the middle of one autograd op's decomposition (its ops share
    # a `seq_nr`): the op's backward is one, which goes to one stage (`_backward_stages`), and the
    # stage of its first ops would have none (a group norm as Inductor decomposes it). Without a
    # backward (under no_grad), autograd numbers no op: every one has the `seq_nr` of the last it did.
    splits_op = [dag.training and i > 0 and node.meta.get("seq_nr") is not None
                 and node.meta.get("seq_nr") == weighted[i - 1].meta.get("seq_nr") for i, node in enumerate(weighted)]
    # finishes[i][s][c]: op i may take stage s, where a parameter was read already (c) or not, and
    # the ops after it the rest of s and the stages after, each stage reading a parameter.
    last = num_stages - 1
    finishes = [[[False, False] for _ in range(num_stages + 1)] for _ in weighted]
    for i in reversed(range(len(weighted))):
        for s in range(num_stages):
            for read_before in (False, True):
                read = read_before or bool(reads[weighted[i]])
                if i == len(weighted) - 1:
                    rest = s == last and read
                else:
                    rest = finishes[i + 1][s][read] or (read and not splits_op[i + 1] and finishes[i + 1][s + 1][False])
                finishes[i][s][read_before] = allowed[i][s] and rest
    if not weighted or not finishes[0][0][False]:
        if dag.kept_holders:
            raise PiperError(
                "this compile of the model cannot cut its pipeline stages so that each parameter stays on the "
                "pipeline ranks its first compile put it on (the model traced to other ops than then); mark the "
                "stages with piper_fx.annotate('PP'), so that every compile cuts them alike")
        return {node: balanced[node] for node in weighted}
    stage, previous, read = {}, 0, False
    for i, node in enumerate(weighted):  # the stage nearest the balanced one from which the rest finishes
        choices = [(0, False)] if i == 0 else [(previous, read)] + ([(previous + 1, False)] if read and not splits_op[i]
                                                                     else [])
        previous, read = min(((s, r) for s, r in choices if finishes[i][s][r]),
                             key=lambda choice: (abs(choice[0] - balanced[node]), choice[0]))
        stage[node], read = previous, read or bool(reads[node])
    return stage


def _parameters_read(dag: TrainingDAG, compute: list[fx.Node], weighted: list[fx.Node]) -> dict[fx.Node, set[str]]:
    """The parameters (placeholder names) whose stages each of the `weighted` ops (in order)
    decides: those it reads itself, and those read by an op of parameters alone (a gather
    of its shards, a cast, a lookup of position biases) whose first reader it is, as such
    an op goes with its first reader (`_forward_stages`). `compute`: the forward's ops."""
    index = {node: i for i, node in enumerate(weighted)}
    forward = set(compute)
    first: dict[fx.Node, fx.Node | None] = {}

    def first_reader(node: fx.Node) -> fx.Node | None:  # of an op of parameters alone, in `weighted`
        if node not in first:
            readers = [user if user in index else first_reader(user) for user in node.users if user in forward]
            first[node] = min((r for r in readers if r is not None), key=index.__getitem__, default=None)
        return first[node]

    found: dict[fx.Node, set[str]] = {node: set() for node in weighted}
    placeholders = dag.placeholders()
    for graph_input in dag.inputs:
        if graph_input.role not in (InputRole.PARAM, InputRole.PARAM_SHARD) or graph_input.name not in placeholders:
            continue
        for user in placeholders[graph_input.name].users:
            reader = user if user in index else first_reader(user) if user in forward else None
            if reader is not None:
                found[reader].add(graph_input.name)
    return found


def _backward_stages(compute: list[fx.Node], forward_stage: dict[fx.Node, int],
                     num_stages: int) -> dict[fx.Node, int]:
    """The stage of each backward op: a recomputation copy (`ops.RECOMPUTES`), that of the
    forward value it copies; any other op, that of the forward op it differentiates (its
    `seq_nr`), but never later than the stages of the backward values it reads other than
    copies (gradients flow only to earlier stages: a copy read by another stage's op is
    replaced by the forward value itself, `_recompute_within_stages`); an op with neither,
    the latest stage of its users."""
    by_seq = _stages_by_seq(forward_stage)
    stage: dict[fx.Node, int] = {}
    for node in compute:
        if node.target is operator.getitem and node.args[0] in stage:  # a part of a multi-output op lives with it
            stage[node] = stage[node.args[0]]
            continue
        copied = node.meta.get(RECOMPUTES)
        if copied is not None and copied in forward_stage:
            stage[node] = forward_stage[copied]
            continue
        own = by_seq.get(node.meta.get("seq_nr"))
        reads = [stage[i] for i in node.all_input_nodes if i in stage and RECOMPUTES not in i.meta]
        if reads:
            own = min(reads) if own is None else min(own, min(reads))
        if own is not None:
            stage[node] = own
    for node in reversed(compute):
        if node not in stage:
            users = [stage[u] for u in node.users if u in stage]
            stage[node] = max(users) if users else num_stages - 1
    return stage


def _stages_by_seq(forward_stage: dict[fx.Node, int]) -> dict[int, int]:
    """The stage of the forward ops of each `seq_nr` (the latest, if several)."""
    by_seq: dict[int, int] = {}
    for node, s in forward_stage.items():
        seq = node.meta.get("seq_nr")
        if seq is not None:
            by_seq[seq] = max(by_seq.get(seq, 0), s)
    return by_seq


def _recompute_within_stages(graph: fx.Graph, stage: dict[fx.Node, int]) -> None:
    """Make every op (`stage`: of every forward op, and `_backward_stages`'s of the backward
    ones) read, in place of a recomputation copy (`ops.RECOMPUTES`) of a value of another
    stage than its own, that value itself, kept from the forward; remove the copies no
    longer read (from the graph and from `stage`)."""
    for node in graph.nodes:
        if node not in stage:
            continue
        for value in node.all_input_nodes:
            copied = value.meta.get(RECOMPUTES)
            if copied is not None and copied in stage and stage.get(value) != stage[node]:
                node.replace_input_with(value, copied)
    for node in reversed(graph.nodes):  # users before what they read: a chain of unread copies goes at once
        if RECOMPUTES in node.meta and not node.users:
            graph.erase_node(node)
            stage.pop(node, None)


def _parameter_holders(dag: TrainingDAG, stage: dict[fx.Node, int]) -> dict[str, tuple[int, ...]]:
    """The pipeline ranks that run a stage reading each parameter (in any copy of the stages)."""
    roles = dag.input_by_name()
    schedule = dag.schedule
    holders = {}
    for node in dag.joint.graph.nodes:
        if node.op != "placeholder" or roles[node.name].role not in (InputRole.PARAM, InputRole.PARAM_SHARD):
            continue
        ranks = {schedule.stage_rank(stage[u], m) for u in node.users if u in stage
                 for m in range(schedule.num_microbatches)}
        if ranks:
            holders[node.name] = tuple(sorted(ranks))
    return holders


def split_stages(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    graph = dag.joint.graph
    num_stages = dag.schedule.stages_per_copy
    forward = forward_nodes(dag)
    compute = [n for n in graph.nodes if n.op in ("call_function", "get_attr")]
    fwd_compute = [n for n in compute if n in forward]
    bwd_compute = [n for n in compute if n not in forward]

    stage = _forward_stages(dag, fwd_compute, num_stages)
    stage.update(_backward_stages(bwd_compute, stage, num_stages))
    _recompute_within_stages(graph, stage)
    compute = [n for n in graph.nodes if n.op in ("call_function", "get_attr")]
    # Parts of a multi-output op live with it.
    for node in compute:
        if node.target is operator.getitem:
            stage[node] = stage[node.args[0]]
    dag.parameter_holders = _parameter_holders(dag, stage)

    kind = _task_kinds(compute, forward)
    final_outputs = set(dag.output_node().args[0])
    tasks = []
    for s in range(num_stages):
        for task_kind in TaskKind:
            nodes = [n for n in compute if stage[n] == s and kind[n] is task_kind]
            if not nodes:
                continue
            members = set(nodes)
            inputs = list(dict.fromkeys(i for n in nodes for i in n.all_input_nodes if i not in members))
            outputs = [n for n in nodes if n in final_outputs
                       or any(u not in members and u.op != "output" for u in n.users)]
            tasks.append(Task(f"{task_kind.value}{s}", task_kind, s, extract_graph(dag.joint, inputs, nodes, outputs),
                              inputs=[n.name for n in inputs], outputs=[n.name for n in outputs]))
    dag.tasks = tasks
    return dag


def _task_kinds(compute: list[fx.Node], forward: set[fx.Node]) -> dict[fx.Node, TaskKind]:
    """Prologue (once-per-step ops marked STEP_START), epilogue (ops marked
    STEP_END and everything computed from them), else forward or backward."""
    kind: dict[fx.Node, TaskKind] = {}
    for node in compute:
        phase = node.meta.get(PHASE)
        if phase == STEP_START:
            kind[node] = TaskKind.P
        elif phase == STEP_END or any(kind.get(i) is TaskKind.E for i in node.all_input_nodes):
            kind[node] = TaskKind.E
        else:
            kind[node] = TaskKind.F if node in forward else TaskKind.B
    return kind
