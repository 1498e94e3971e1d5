"""What Dynamo's graph returns, and what the step returns for it.

Dynamo's graph returns the model's outputs flat: the loss, which need not be first
(`loss_index`), values beside it, tensors of objects the forward made (a key and value cache),
arguments an out= op wrote (`return_arguments_themselves`) and numbers (`returned_numbers`).
`capture` differentiates the loss alone (`detach_outputs_beside_the_loss`), describes the joint
graph's outputs (`describe_outputs`), checks that a training graph ends in one scalar loss, and
with microbatches, how the batch's value of each output is made from its microbatches'
(`check_outputs_split_by_rows`).
"""
from __future__ import annotations

import os
import re

import torch
import torch.fx as fx

from .compat import aot_descriptors as aot_desc
from .compat import graph_break_of
from .errors import PiperError
from .ir import GraphInput, GraphOutput, InputRole, OutputRole

aten = torch.ops.aten


def loss_index(gm: fx.GraphModule) -> int | None:
    """Which output of Dynamo's graph `gm` is the loss: the first floating-point scalar it
    returns that requires grad, or where none does (under no_grad), its first floating-point
    scalar; None without one.

    Not always output 0: Dynamo returns the tensors of an object the forward made and returns
    (a Hugging Face model's key and value cache, on unless `use_cache=False`) before the
    model's outputs, and a model may return its logits before its loss. The step returns its
    outputs in Dynamo's order, and differentiates the loss alone."""
    scalars = [(index, value) for index, value in enumerate(returned_values(gm))
               if isinstance(value, torch.Tensor) and value.numel() == 1 and value.is_floating_point()]
    return next((index for index, value in scalars if value.requires_grad), scalars[0][0] if scalars else None)


def return_arguments_themselves(gm: fx.GraphModule) -> list[tuple[int, int]]:
    """The outputs of Dynamo's graph `gm` that are one of its arguments itself, each (output
    index, argument index), from now on returned as None by `gm`.

    A forward that writes a buffer with an out= op and sets it on its module again, as spectral
    norm's power iteration does (`self._u = F.normalize(..., out=self._u)`), makes Dynamo's
    graph return the buffer for its code to set. The joint graph would return the buffer's new
    value as a tensor of its own, which would become the module's buffer in place of the one it
    has (and, named as the buffer's update is, be dropped with it). The step returns the argument
    itself in its place instead (`CompiledStep`), updated in place as the forward updates every
    buffer it mutates (`passes.update_buffers`): as in eager, where the out= op returns the buffer.
    Whoever hands `capture` a Dynamo graph calls this first, once (the piper backend)."""
    arguments = {id(node.meta.get("example_value")): index
                 for index, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    themselves = [(index, arguments[id(value)]) for index, value in enumerate(returned_values(gm))
                  if isinstance(value, torch.Tensor) and id(value) in arguments]
    if themselves:
        returned = flat_returns(gm)
        for index, _ in themselves:
            returned[index] = None
        _return(gm, returned)
    return themselves


def returned_numbers(gm: fx.GraphModule, sizes: dict) -> list[tuple[int, object]]:
    """The outputs of Dynamo's graph `gm` that are numbers, not tensors, each (output index,
    value) as one call returns it, at `sizes` (`capture.call_sizes`): a size Dynamo made
    symbolic, kept on an object the forward returns (a Hugging Face cache layer's length).
    The joint graph, traced at static microbatch sizes, returns them as constants of a
    microbatch's, which the step does not hand back (`describe_outputs`); it returns these."""
    numbers = []
    for index, (node, value) in enumerate(zip(flat_returns(gm), returned_values(gm))):
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            number = value.node.expr.xreplace(sizes)
            if getattr(number, "free_symbols", None):
                raise PiperError(f"the model's output {index} ({made_where(node)}) is a number of sizes piper_fx "
                                 f"does not know ({value.node.expr}): return it as a tensor")
            value = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)](number)
        if isinstance(value, (int, float, bool)):
            numbers.append((index, value))
    return numbers


def flat_returns(gm: fx.GraphModule) -> list:
    """What Dynamo's graph returns, flat: the model's outputs (a `ModelOutput`'s fields, say), and
    any tensor its forward left on a module (a recurrent state), which Dynamo's code stores there."""
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def returned_values(gm: fx.GraphModule) -> list:
    """The value of each output of Dynamo's graph `gm` (`flat_returns`): Dynamo's fake value of a
    node (`example_value`), or the output itself where it is no node (None, a number)."""
    return [node.meta.get("example_value") if isinstance(node, fx.Node) else node for node in flat_returns(gm)]


def _return(gm: fx.GraphModule, returned: list) -> None:
    """Have Dynamo's graph `gm` return `returned` (`flat_returns`, changed) in its own container."""
    output = gm.graph.find_nodes(op="output")[0]
    output.args = (type(output.args[0])(returned) if isinstance(output.args[0], (tuple, list)) else returned[0],)
    gm.recompile()


def made_where(node: fx.Node) -> str:
    """`node`, with the line of the model that made it (the last frame of its stack trace)."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in ([^\n]+)(?:\n[ \t]+([^\n]*))?',
                        node.meta.get("stack_trace") or "")
    if not frames:
        return node.name
    path, line, function, code = frames[-1]
    made = f"{node.name}, made at {os.path.basename(path)}:{line} in {function}"
    return f"{made} ({code.strip()})" if code else made


def graph_break(gm: fx.GraphModule) -> str | None:
    """Where and why Dynamo broke the model's graph (`compat.graph_break_of`: the break that
    ended `gm`, else its latest), as a clause for an error: the innermost frame of the model's
    code and the reason's first line, explanation and first hint; None where it broke none."""
    reason, own = graph_break_of(gm)
    if reason is None:
        return None
    lines = [line.strip() for line in str(reason.reason).strip().splitlines() if line.strip()]
    first = [next((line for line in lines[1:] if line.startswith(label)), None) for label in ("Explanation:", "Hint:")]
    said = "; ".join(part.rstrip(".:") for part in [*lines[:1], *filter(None, first)])
    stack = list(getattr(reason, "user_stack", None) or ())
    where = f" at {stack[-1].filename}:{stack[-1].lineno} ({stack[-1].name})" if stack else ""
    if own:
        return f"Dynamo ended the compiled graph at a graph break{where}: {said}"
    return (f"Dynamo broke the model's graph{where} (its latest break since torch._dynamo.reset()): {said}; "
            "and compiled a part of the model called from there on its own")


def _not_one_scalar_loss(differentiable: int, shape: tuple | None, microbatches: int,
                         broken: str | None = None) -> PiperError:
    returns = (f"the compiled graph returns {differentiable} differentiable outputs, the first of shape "
               f"{shape}, and none is a scalar")
    if broken is not None:  # the usual cause, said in Dynamo's own words
        said = (f"{broken}. So {returns}: piper_fx runs whole training steps and needs one graph that "
                "returns the model's scalar loss. Remove the break (compile with fullgraph=True to find "
                "every one)")
    else:
        said = (f"{returns}; piper_fx runs whole training steps and needs the model to return its scalar "
                "loss. A graph break also splits the model into graphs that do not end in the loss: compile "
                "with fullgraph=True to find it")
    return PiperError(
        said
        + (". Under a pipeline, piper_fx.prepare marks the batch size dynamic in a hook of the "
           "module it prepared, which breaks a function compiled around its call there: compile "
           "that module (a Hugging Face model itself, called with its labels)" if microbatches > 1 else ""))


def check_a_scalar_loss(gm: fx.GraphModule, loss: int | None, microbatches: int) -> None:
    """Before anything is traced: a training graph from Dynamo that returns differentiable
    values, none a scalar (its `loss_index` is `loss`), is not a whole training step (a graph
    break ended it early, say), whatever its arguments are (a graph after a break takes values
    of the model's, not its batch)."""
    values = returned_values(gm)
    differentiable = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
    if differentiable and (loss is None or not values[loss].requires_grad):
        raise _not_one_scalar_loss(len(differentiable), tuple(differentiable[0].shape), microbatches,
                                   graph_break(gm))


def detach_outputs_beside_the_loss(gm: fx.GraphModule, loss: int | None) -> list[int]:
    """Return every output but the loss (output `loss`) of Dynamo's graph `gm` detached, so that
    the step differentiates the loss alone; the indices of those that required grad, which the
    step returns attached (`runtime.step`)."""
    output = gm.graph.find_nodes(op="output")[0]
    returned, detached = flat_returns(gm), []
    for index, (node, example) in enumerate(zip(list(returned), returned_values(gm))):
        if index != loss and isinstance(example, torch.Tensor) and example.requires_grad:
            detached.append(index)
            with gm.graph.inserting_before(output):
                returned[index] = gm.graph.call_method("detach", (node,))
            returned[index].meta["example_value"] = example
    if detached:
        _return(gm, returned)
    return detached


def describe_outputs(output_node: fx.Node, arg_indices: list[int], loss: int | None,
                     attached: dict[int, str]) -> tuple[list[GraphOutput], list[fx.Node]]:
    """The role of every value the joint graph returns (loss, output, gradient, mutation), and the
    values. Output `loss` is the loss (`loss_index`: in inference too, an evaluation's loss,
    averaged over microbatches as in training); `attached`: the outputs beside it the model made
    with a gradient, by index, with where (`detach_outputs_beside_the_loss`)."""
    outputs: list[GraphOutput] = []
    kept: list[fx.Node] = []
    for value, desc in zip(output_node.args[0], output_node.meta["desc"]):
        if not isinstance(value, fx.Node):  # None, or a number the step returns (`returned_numbers`)
            continue
        if isinstance(desc, aot_desc.PlainAOTOutput):
            role = OutputRole.LOSS if desc.idx == loss else OutputRole.OUTPUT
            outputs.append(GraphOutput(value.name, role, desc.idx, attached.get(desc.idx)))
        elif isinstance(desc, aot_desc.GradAOTOutput) and isinstance(desc.grad_of, aot_desc.PlainAOTInput):
            outputs.append(GraphOutput(value.name, OutputRole.GRAD, arg_indices[desc.grad_of.idx]))
        elif isinstance(desc, aot_desc.InputMutationAOTOutput) and isinstance(
                desc.mutated_input, aot_desc.PlainAOTInput):
            outputs.append(GraphOutput(value.name, OutputRole.MUTATION, arg_indices[desc.mutated_input.idx]))
        else:
            raise PiperError(f"unsupported joint-graph output {getattr(value, 'name', value)}: {desc}")
        kept.append(value)
    return outputs, kept


def check_one_scalar_loss(joint: fx.GraphModule, inputs: list[GraphInput], outputs: list[GraphOutput],
                          microbatches: int, gm: fx.GraphModule) -> None:
    """A training graph has one differentiable output: the scalar loss (`loss_index`); else
    the error says where Dynamo broke the model's graph (`gm`, Dynamo's), if it did."""
    tangents = [i for i in inputs if i.role is InputRole.TANGENT]
    loss = next((o for o in outputs if o.role is OutputRole.LOSS), None)
    loss_val = next((n.meta["val"] for n in joint.graph.nodes if loss and n.name == loss.name), None)
    if loss_val is None or len(tangents) != 1 or loss_val.numel() != 1:
        raise _not_one_scalar_loss(len(tangents), tuple(loss_val.shape) if loss_val is not None else None,
                                   microbatches, graph_break(gm))


def check_outputs_split_by_rows(joint: fx.GraphModule, inputs: list[GraphInput], outputs: list[GraphOutput],
                                made: dict[int, str], microbatches: int) -> None:
    """With microbatches, each output beside the loss has the microbatch's rows at dim 0, so that the
    microbatches' concatenated are the batch's, as one call on the whole batch returns it; or a
    reduction over those rows made it (`_reduction_over_rows`: an accuracy's mean, a count's sum),
    which makes the batch's from the microbatches' (`GraphOutput.reduced_by`, set here); or it
    reads no batch argument (a parameter's value), and is every microbatch's, the first's."""
    nodes = {n.name: n for n in joint.graph.nodes}
    batch = [nodes[i.name] for i in inputs if i.role is InputRole.INPUT]
    rows = {node.meta["val"].shape[0] for node in batch if node.meta["val"].dim()}
    for output in outputs:
        val = nodes[output.name].meta.get("val")
        if output.role is not OutputRole.OUTPUT or not isinstance(val, torch.Tensor):
            continue
        if not _reads_any(nodes[output.name], set(batch)):
            output.reduced_by = "first"
        elif val.dim() == 0 or val.shape[0] not in rows:
            output.reduced_by = _reduction_over_rows(nodes[output.name], rows)
            if output.reduced_by is None:
                raise PiperError(
                    f"the model's output {output.index} ({made.get(output.index, output.name)}) has shape "
                    f"{tuple(val.shape)} in a microbatch of {sorted(rows)} rows: with options['pipeline']"
                    f"['microbatches'] = {microbatches}, the step splits the batch along dim 0 and returns an "
                    "output beside the loss as its microbatches' concatenated along dim 0, which needs the "
                    "microbatch's rows there, or as their sum, mean, max, min, all or any where that reduction "
                    "over the rows made it, as the model's last op on it. Return a value per row (a metric per "
                    "sequence, say) or such a reduction of it, or return it in the loss")


# Reductions that make an output of one microbatch's rows whose batch value the step makes from
# the microbatches' by the same reduction (`ir.REDUCTIONS`), and the ops an output passes through
# unchanged on its way out (the detach of an output beside the loss).
_REDUCTIONS = {aten.sum.default: "sum", aten.sum.dim_IntList: "sum", aten.mean.default: "mean",
               aten.mean.dim: "mean", aten.amax.default: "amax", aten.max.default: "amax",
               aten.amin.default: "amin", aten.min.default: "amin", aten.all.default: "all", aten.all.dim: "all",
               aten.all.dims: "all", aten.any.default: "any", aten.any.dim: "any", aten.any.dims: "any"}
_UNCHANGED = {aten.detach.default, aten.alias.default}


def _reads_any(node: fx.Node, sources: set[fx.Node]) -> bool:
    """Whether `node` is one of `sources`, or reads one of them through the ops that made it."""
    seen, todo = {node}, [node]
    while todo:
        node = todo.pop()
        if node in sources:
            return True
        todo += [read for read in node.all_input_nodes if read not in seen]
        seen.update(node.all_input_nodes)
    return False


def _reduction_over_rows(node: fx.Node, rows: set[int]) -> str | None:
    """The reduction (`ir.REDUCTIONS`) that made `node` over the rows of a value with a
    microbatch's `rows` at dim 0 (among the dims it reduces: all of them, or a list with 0),
    or None."""
    while node.target in _UNCHANGED:
        node = node.args[0]
    how = _REDUCTIONS.get(node.target)
    source = node.args[0] if how else None
    val = source.meta.get("val") if isinstance(source, fx.Node) else None
    if not (isinstance(val, torch.Tensor) and val.dim() and val.shape[0] in rows):
        return None
    dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or range(val.dim()))
    return how if 0 in [d % val.dim() for d in dims] else None
