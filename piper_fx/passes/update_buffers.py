"""Pass: update the buffers the forward mutates in place, in the task that computes their new values.

Requires: the stage tasks of `split_stages`; `dag.outputs` lists each buffer the
model mutates in place (BatchNorm's running statistics and batch count) as a
MUTATION output, its new value, made by the joint graph.
Guarantees: the task that makes a buffer's new value, the forward of its stage
(or its prologue), ends by copying it into the buffer (`aten.copy_` of the
task's input), and the step's outputs no longer list it: each microbatch's
forward starts from the value the one before left, as when eager PyTorch runs
the microbatches one after another (gradient accumulation, and
torch.distributed.pipelining's stages), and nothing is copied after the step.
No other task reads the buffer: `checkpoint_activations` recomputes no op that
reads one, so a backward reads its batch's statistics kept from the forward.
Each data-parallel replica updates its own copy from its own rows, as DDP
without `SyncBatchNorm` and with `broadcast_buffers=False`, and FSDP2. Under a
pipeline, `dag.parameter_holders` lists the pipeline rank that updates it,
and the others let go of it as of the parameters their stages do not read (a
stage module of torch.distributed.pipelining holds its own buffers alone).
A `PiperError` names the buffer where this cannot hold: another task reads it
(eager PyTorch refuses such a backward too, its saved value modified in
place), its new value is made by a backward task, or, under a pipeline, its
stage runs on several pipeline ranks (DualPipe's two copies of every stage),
each of which would update it from its own microbatches.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..errors import PiperError
from ..ir import InputRole, Task, TaskKind, TrainingDAG, add_placeholder
from ..options import Strategy

COPY = torch.ops.aten.copy_.default


def update_buffers(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    mutations = dag.mutated_inputs()
    if not mutations:
        return dag
    for mutation, buffer in mutations:
        name = buffer.fqn or buffer.name
        if buffer.role is not InputRole.BUFFER:
            raise PiperError(f"the model's forward changes its {buffer.role.value} {name} in place: piper_fx "
                             "updates buffers in place (BatchNorm's running statistics), not a "
                             f"{buffer.role.value}; compute a new value and return it instead")
        makers = [t for t in dag.tasks if mutation.name in t.outputs]
        if not makers:
            raise PiperError(f"the model sets its buffer {name} in place to a value no op of its step computes (an "
                             "argument of the step, say): piper_fx updates a buffer from a value its forward makes")
        (maker,) = makers
        if maker.kind not in (TaskKind.F, TaskKind.P):
            raise PiperError(f"the model changes its buffer {name} in place in the backward (task {maker.name}): "
                             "piper_fx updates buffers in the forward only")
        readers = [t.name for t in dag.tasks if t is not maker and buffer.name in t.inputs]
        if readers:
            raise PiperError(f"the model changes its buffer {name} in place in its forward (task {maker.name}), and "
                             f"it is read by {', '.join(readers)} too, which would then read the changed value: "
                             "eager PyTorch refuses a backward that reads it too (a value saved for it was "
                             "modified by an inplace operation); clone the buffer where the forward reads it")
        ranks = sorted({dag.schedule.stage_rank(maker.stage, m) for m in range(strategy.microbatches)})
        if len(ranks) > 1:
            raise PiperError(f"the model changes its buffer {name} in place in its forward, and schedule "
                             f"{dag.schedule.name} runs its stage {maker.stage} on pipeline ranks "
                             f"{', '.join(map(str, ranks))}, which would each update it from their own "
                             "microbatches: use a schedule that runs each stage on one rank (dualpipev rather "
                             "than dualpipe)")
        if strategy.pp > 1:  # the other pipeline ranks let go of it, as of the parameters they do not read
            dag.parameter_holders[buffer.name] = tuple(ranks)
        read_later = any(mutation.name in t.inputs for t in dag.tasks)  # a batch norm's backward reads it
        _copy_at_end(maker, dag.placeholders()[buffer.name], mutation.name, read_later)
    dag.drop_outputs({mutation.name for mutation, _ in mutations})
    return dag


def _copy_at_end(task: Task, buffer: fx.Node, value: str, returned_too: bool) -> None:
    """Make `task` copy its output `value` into the step input `buffer` (the joint graph's
    placeholder; read by the task from now on if it did not already) as its last op, and
    return `value` only if `returned_too` (another task reads it: it is no longer the step's)."""
    graph: fx.Graph = task.graph.graph
    output = graph.find_nodes(op="output")[0]
    returned = list(output.args[0])
    index = task.outputs.index(value)
    node = returned[index]
    if not returned_too:
        del returned[index], task.outputs[index]
    placeholders = graph.find_nodes(op="placeholder")
    read = next((p for p in placeholders if p.name == buffer.name), None)
    if read is None:
        with graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(None):
            read = add_placeholder(graph, buffer.name, buffer.meta)
        task.inputs.append(buffer.name)
    with graph.inserting_before(output):
        copied = graph.call_function(COPY, (read, node))
    copied.meta = dict(node.meta)
    output.args = (tuple(returned),)
    graph.lint()
    task.graph.recompile()
