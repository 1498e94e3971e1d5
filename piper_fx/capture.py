"""Capture: Dynamo graph -> joint forward/backward ATen graph with descriptors.

Uses AOTAutograd's `aot_export_joint_with_descriptors`, whose placeholders and
outputs carry descriptors (PlainAOTInput, TangentAOTInput, GradAOTOutput, ...).
Dynamo has already lifted parameters and buffers into graph inputs, so their
meaning comes from the compiled call's example inputs (which are the real
`nn.Parameter` objects) and from Dynamo's input sources (for buffer names).
"""
from __future__ import annotations

import contextlib
import os
import re

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.tensor import DTensor

from .compat import (FakeTensorMode, ShapeEnv, TracingContext, aot_descriptors as aot_desc,
                     aot_export_joint_with_descriptors, lazy_graph_modules, make_graph_module,
                     tracing)
from .collectives.emit import INHERITED_META
from .decompositions import decompositions_for
from .errors import PiperError
from .ir import GraphInput, GraphOutput, InputRole, OutputRole, TrainingDAG
from .ops import LAYER, SOURCE
from .options import MixedPrecision, Strategy
from .sharding.dtensor_params import is_replicated_parameter, placeholder_name, program_tensor, stood_for
from .sharding.experts import EXPERT_ATTR, UNSHARD_EXPERTS
from .sharding.row_shard import INFO_ATTR, UNSHARD, sharded_parameter_info
from .sharding.units import layer_of

aten = torch.ops.aten

_SOURCE_KEY = re.compile(r"\['([^']+)'\]")
_CONTAINERS = {"_modules", "_parameters", "_buffers"}


def keep_input_sources(gm: fx.GraphModule) -> None:
    """Keep the name of each placeholder's source on the node (`ops.SOURCE`), where Dynamo
    still has it (its `grapharg`, which it deletes once it has compiled the frame): whoever
    hands `capture` a Dynamo graph calls this first, inside its backend (the piper backend
    before it returns, since the step plans on its first call)."""
    for node in gm.graph.find_nodes(op="placeholder"):
        name = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
        if callable(name):
            name = name()
        if isinstance(name, str):
            node.meta[SOURCE] = name


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
    output = gm.graph.find_nodes(op="output")[0]
    returned = _returned(gm)
    arguments = {id(node.meta.get("example_value")): index
                 for index, node in enumerate(gm.graph.find_nodes(op="placeholder"))}
    themselves = [(index, arguments[id(node.meta.get("example_value"))]) for index, node in enumerate(returned)
                  if isinstance(node, fx.Node) and isinstance(node.meta.get("example_value"), torch.Tensor)
                  and id(node.meta["example_value"]) in arguments]
    if themselves:
        for index, _ in themselves:
            returned[index] = None
        output.args = (type(output.args[0])(returned) if isinstance(output.args[0], (tuple, list)) else returned[0],)
        gm.recompile()
    return themselves


def _fqn_from_source(node: fx.Node) -> tuple[str | None, bool]:
    """Model-relative name of a lifted parameter/buffer, and whether it is a buffer
    (from the source `keep_input_sources` kept)."""
    name = node.meta.get(SOURCE)
    if name is None:
        return None, False
    parts = _SOURCE_KEY.findall(name)
    attrs = re.findall(r"\.(\w+)\[", name)
    is_buffer = "_buffers" in attrs
    # The first key is the argument the module came in as (L['self'] / L['fn']).
    fqn = ".".join(p for p in parts[1:] if p not in _CONTAINERS)
    return (fqn or None), is_buffer


def reads_state(gm: fx.GraphModule, arguments: list) -> bool:
    """Whether Dynamo's graph `gm`, called with `arguments` (the parameters in place of their
    program placeholders), reads a parameter or a buffer of the model (`keep_input_sources`
    first): one that reads neither has nothing for a strategy to lay out, reduce or pipeline."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return any(isinstance(argument, nn.Parameter) or sharded_parameter_info(argument) is not None
               for argument in arguments) or any(_fqn_from_source(node)[1] for node in placeholders)


def _input_role(example: object, is_buffer: bool) -> InputRole:
    if sharded_parameter_info(example) is not None:
        return InputRole.PARAM_SHARD
    if isinstance(example, nn.Parameter):
        return InputRole.PARAM
    return InputRole.BUFFER if is_buffer else InputRole.INPUT


def symbolic_inputs(gm: fx.GraphModule, example_inputs: list) -> tuple[int, ...]:
    """The indices of `gm`'s inputs whose sizes Dynamo made symbolic: its size inputs (SymInt
    placeholders) and the tensors with a symbolic size. With a pipeline `prepare` marks the
    batch dimension dynamic; without, Dynamo does once a call changed the batch's size."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return tuple(i for i, (node, example) in enumerate(zip(placeholders, example_inputs))
                 if _is_size_input(node, example) or _has_symbolic_size(node.meta.get("example_value")))


def _has_symbolic_size(value: object) -> bool:
    """Whether `value` (Dynamo's fake value of an input) is a tensor with a symbolic size: the
    examples Dynamo hands its backend are the call's tensors, their sizes its hints."""
    return isinstance(value, torch.Tensor) and any(isinstance(size, torch.SymInt) for size in value.shape)


def _is_size_input(node: fx.Node, example: object) -> bool:
    """Whether `node` is one of Dynamo's size inputs: its example a SymInt, or the size of the
    call a step is compiled for."""
    return isinstance(example, torch.SymInt) or isinstance(node.meta.get("example_value"), torch.SymInt)


def _specialize_to_microbatch(gm: fx.GraphModule, example_inputs: list, microbatches: int):
    """Make `gm` static at microbatch size; return (gm, example inputs, their original indices).

    With a pipeline, `prepare` marks dim 0 of the model's tensor arguments
    dynamic, so Dynamo hands over the batch sizes as SymInt inputs (given here
    as SymInts, or as the sizes of the call the step is compiled for). Each is
    replaced by its microbatch size (the full size / microbatches) and each
    batch argument by its first microbatch, so AOTAutograd traces one
    microbatch's static graph, which serves every microbatch.
    """
    # A copy: Dynamo calls the compiled function by the placeholders of its own graph.
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    gm = make_graph_module(gm, graph)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch_sizes = _batch_size_symbols(placeholders, example_inputs)
    kept, args = [], []
    for index, (node, example) in enumerate(zip(placeholders, example_inputs)):
        if _is_size_input(node, example):
            size = example.node.hint if isinstance(example, torch.SymInt) else int(example)
            if _symbol(node.meta.get("example_value", example)) in batch_sizes:
                if size % microbatches:
                    raise PiperError(f"a batch of {size} does not split into {microbatches} microbatches "
                                     "(options['pipeline']['microbatches'])")
                size //= microbatches
            # Another size (a sequence's length, say) is the call's, whole in every microbatch.
            for user in list(node.users):
                user.args = fx.node.map_arg(user.args, lambda n: size if n is node else n)
                user.kwargs = fx.node.map_arg(user.kwargs, lambda n: size if n is node else n)
            gm.graph.erase_node(node)
            continue
        if not isinstance(example, torch.Tensor):
            raise PiperError(f"compiled argument {index} is {type(example).__name__}: piper_fx compiles "
                             "tensor arguments only")
        batch = _is_batch_argument(node, example)
        parameter = stood_for(example)  # the parameter, where Dynamo saw its program placeholder
        if isinstance(parameter, DTensor):
            # Dynamo's example value: a DTensor only where the model read the parameter itself.
            read_directly = isinstance(node.meta.get("example_value"), DTensor)
            example = _read_as_program_tensor(node, parameter, index, read_directly)
        else:  # a plain parameter Dynamo traced in mixed precision's param_dtype, read cast to it
            example = parameter
        if microbatches > 1 and batch:
            if example.dim() == 0 or example.shape[0] % microbatches:
                raise PiperError(f"compiled argument {index} has shape {tuple(example.shape)}: its dim 0 must "
                                 f"split into {microbatches} microbatches (options['pipeline']['microbatches']; "
                                 "a graph of part of the model, after a graph break, takes values of the "
                                 "model's, not its batch: compile with fullgraph=True to find a break)")
            example = example.chunk(microbatches)[0]
        kept.append(index)
        args.append(example)
    gm.recompile()
    return gm, args, kept


def _batch_size_symbols(placeholders: list[fx.Node], example_inputs: list) -> set:
    """The symbols of the batch's size: dim 0 of the batch arguments (the inputs that are
    neither parameters nor the model's buffers) where Dynamo made it symbolic."""
    symbols = set()
    for node, example in zip(placeholders, example_inputs):
        value = node.meta.get("example_value")
        if _has_symbolic_size(value) and value.dim() > 0 and _is_batch_argument(node, example):
            symbols.add(_symbol(value.shape[0]))
    symbols.discard(None)
    return symbols


def batch_shapes(gm: fx.GraphModule, example_inputs: list) -> dict[int, tuple[int, ...]]:
    """The shape of each batch argument (`_is_batch_argument`) that is a tensor, by its index
    among `example_inputs`, Dynamo's graph `gm`'s inputs."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    return {index: tuple(example.shape) for index, (node, example) in enumerate(zip(placeholders, example_inputs))
            if isinstance(example, torch.Tensor) and _is_batch_argument(node, example)}


def _is_batch_argument(node: fx.Node, example: object) -> bool:
    """Whether the input `node` (example `example`) is a batch argument, split into
    microbatches along dim 0: neither a parameter (nor its program placeholder) nor one of the
    model's buffers."""
    return not isinstance(stood_for(example), nn.Parameter) and not _fqn_from_source(node)[1]


def returned_numbers(gm: fx.GraphModule, example_inputs: list) -> list[tuple[int, object]]:
    """The outputs of Dynamo's graph `gm` that are numbers, not tensors, each (output index,
    value) as one call with `example_inputs` (the call's sizes) returns it: a size Dynamo made
    symbolic, kept on an object the forward returns (a Hugging Face cache layer's length).
    The joint graph, traced at static microbatch sizes, returns them as constants of a
    microbatch's, which the step does not hand back (`_describe_outputs`); it returns these."""
    sizes = {_symbol(node.meta.get("example_value", example)): example.node.hint
             if isinstance(example, torch.SymInt) else example
             for node, example in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
             if _is_size_input(node, example)}
    numbers = []
    for index, node in enumerate(_returned(gm)):
        value = node.meta.get("example_value") if isinstance(node, fx.Node) else node
        if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
            number = value.node.expr.xreplace(sizes)
            if getattr(number, "free_symbols", None):
                raise PiperError(f"the model's output {index} ({_made_where(node)}) is a number of sizes piper_fx "
                                 f"does not know ({value.node.expr}): return it as a tensor")
            value = {torch.SymInt: int, torch.SymFloat: float, torch.SymBool: bool}[type(value)](number)
        if isinstance(value, (int, float, bool)):
            numbers.append((index, value))
    return numbers


def _symbol(size: object):
    """The expression of a symbolic size (a SymInt), or None for a plain int."""
    return size.node.expr if isinstance(size, torch.SymInt) else None


def _read_as_program_tensor(node: fx.Node, parameter: torch.Tensor, index: int, read_directly: bool) -> nn.Parameter:
    """Make the graph read the DTensor parameter `parameter` (placeholder `node`) as the plain
    tensor the program computes with (`dtensor_params.program_tensor`). Where the model read
    it through its program placeholder, Dynamo traced that plain tensor already; where it
    read the parameter itself (`read_directly`: one registered anew in a module after
    `prepare`), its `to_local()` reads become the placeholder. Returns the example to trace
    it with, a plain `nn.Parameter` carrying what piper_fx knows of the parameter."""
    if sharded_parameter_info(parameter) is None and not is_replicated_parameter(parameter):
        raise PiperError(f"compiled argument {index} is a DTensor that piper_fx.prepare did not make; piper_fx "
                         "places the model's parameters itself: pass plain tensors and parameters")
    for user in list(node.users) if read_directly else ():
        if not (user.op == "call_method" and user.target == "to_local"):
            raise PiperError(f"the model reads its parameter {_fqn_from_source(node)[0] or node.name} other than "
                             f"through its module's attribute ({user.format_node()}); read it as "
                             "module.<name>, which gives the full tensor")
        user.replace_all_uses_with(node)
        node.graph.erase_node(user)
    example = nn.Parameter(program_tensor(parameter).detach(), requires_grad=parameter.requires_grad)
    for attr in (INFO_ATTR, EXPERT_ATTR):
        if hasattr(parameter, attr):
            setattr(example, attr, getattr(parameter, attr))
    return example


def _is_marked_read(node: fx.Node) -> bool:
    """Whether `node` is the read of a sharded parameter (`piper::unshard[_experts]`) in a Dynamo graph."""
    return node.op == "call_function" and getattr(node.target, "_opoverload", node.target) in (
        UNSHARD, UNSHARD_EXPERTS)


def _cast_uses(graph: fx.Graph, value: fx.Node, dtype: torch.dtype) -> None:
    """Make every user of `value` read it cast to `dtype`; the cast is where `value` is
    (its annotations: a read inside `piper_fx.annotate` regions stays inside them)."""
    with graph.inserting_after(value):
        cast = graph.call_method("to", (value, dtype))
    for key in INHERITED_META:
        if key in value.meta:
            cast.meta[key] = value.meta[key]
    value.replace_all_uses_with(cast, delete_user_cb=lambda user: user is not cast)


def _trace_mixed_precision(gm: fx.GraphModule, examples: list, policy: MixedPrecision) -> None:
    """Write FSDP2's `MixedPrecisionPolicy` into the Dynamo graph, so AOTAutograd traces
    compute in `param_dtype` and the casts' backward (each gradient back to its
    parameter's dtype). Dynamo traced the parameters in `param_dtype` already (their
    program placeholders, `read_through.trace_in_dtype`), so the dtypes the model
    chose by reading them are those; the graph now reads the parameters themselves:
      - each floating parameter is read cast to `param_dtype`: a sharded one where
        its module reads it whole (after its marker, which `unshard_parameters`
        turns into a gather in `param_dtype`), a replicated one where it enters;
      - floating batch inputs are cast to `param_dtype` (`cast_forward_inputs`);
        buffers keep their dtype, as under FSDP2;
      - floating outputs are cast to `output_dtype`.
    Gradients are reduced in `reduce_dtype` by `reduce_gradients`.
    """
    if policy.param_dtype is None and policy.output_dtype is None:
        return
    graph = gm.graph
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    param_dtype = policy.param_dtype
    for node, example in zip(placeholders, examples):
        if param_dtype is None or not example.is_floating_point() or example.dtype == param_dtype:
            continue
        if isinstance(example, nn.Parameter):
            for read in [u for u in node.users if _is_marked_read(u)] or [node]:
                _cast_uses(graph, read, param_dtype)
        elif policy.cast_forward_inputs and not _fqn_from_source(node)[1]:
            _cast_uses(graph, node, param_dtype)
    if policy.output_dtype is not None:
        output = next(n for n in reversed(graph.nodes) if n.op == "output")
        for value in dict.fromkeys(output.all_input_nodes):
            example = value.meta.get("example_value")
            if isinstance(example, torch.Tensor) and example.is_floating_point() and \
                    example.dtype != policy.output_dtype:
                with graph.inserting_before(output):
                    cast = graph.call_method("to", (value, policy.output_dtype))
                output.replace_input_with(value, cast)
    gm.recompile()


def _describe_inputs(joint: fx.GraphModule, traced_inputs: list, arg_indices: list[int],
                     dynamo_placeholders: list[fx.Node], names: list[str | None]) -> list[GraphInput]:
    """The role of every joint-graph placeholder (parameter, shard, buffer, batch input, tangent)."""
    inputs: list[GraphInput] = []
    for node in joint.graph.nodes:
        if node.op != "placeholder":
            continue
        desc = node.meta.get("desc")
        if isinstance(desc, aot_desc.TangentAOTInput):
            inputs.append(GraphInput(node.name, InputRole.TANGENT, None))
        elif isinstance(desc, aot_desc.PlainAOTInput):
            example = traced_inputs[desc.idx]
            fqn, is_buffer = _fqn_from_source(dynamo_placeholders[desc.idx])
            # A placeholder's source is no name of the model's: the parameter's name is its own.
            fqn = names[desc.idx] or fqn
            role = _input_role(example, is_buffer)
            sharded = sharded_parameter_info(example)
            if sharded is not None:
                fqn = sharded.fqns[0]
            inputs.append(GraphInput(node.name, role, arg_indices[desc.idx], fqn, sharded))
        else:
            raise PiperError(f"unsupported joint-graph input {node.name}: {desc}")
    return inputs


def _describe_outputs(output_node: fx.Node, arg_indices: list[int], loss: int | None,
                      attached: dict[int, str]) -> tuple[list[GraphOutput], list[fx.Node]]:
    """The role of every value the joint graph returns (loss, output, gradient, mutation), and the
    values. Output `loss` is the loss (`loss_index`: in inference too, an evaluation's loss,
    averaged over microbatches as in training); `attached`: the outputs beside it the model made
    with a gradient, by index, with where (`_detach_outputs_beside_the_loss`)."""
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


# Why a pipeline's graph did not trace at microbatch size, when Dynamo saw a fixed batch size.
_FIXED_BATCH = (
    "piper_fx traces a pipeline's model at the size of one microbatch, and tracing it failed: its "
    "batch arguments reached the compiler with a fixed size, which the model may read (a view of "
    "the batch's shape, say). piper_fx.prepare marks their batch dimension dynamic on every call of "
    "the module it prepared; compile that module (torch.compile(model, ...)), or mark it on the "
    "arguments of the function you compile before each call (torch._dynamo.mark_dynamic(x, 0))")


def _not_one_scalar_loss(differentiable: int, shape: tuple | None, microbatches: int) -> PiperError:
    return PiperError(
        f"the compiled graph returns {differentiable} differentiable outputs, the first of shape "
        f"{shape}, and none is a scalar; piper_fx runs whole training steps and needs the model to "
        "return its scalar loss. A graph break also splits the model "
        "into graphs that do not end in the loss: compile with fullgraph=True to find it"
        + (". Under a pipeline, piper_fx.prepare marks the batch size dynamic in a hook of the "
           "module it prepared, which breaks a function compiled around its call there: compile "
           "that module (a Hugging Face model itself, called with its labels)" if microbatches > 1 else ""))


def _check_a_scalar_loss(gm: fx.GraphModule, loss: int | None, microbatches: int) -> None:
    """Before anything is traced: a training graph from Dynamo that returns differentiable
    values, none a scalar (its `loss_index` is `loss`), is not a whole training step (a graph
    break ended it early, say), whatever its arguments are (a graph after a break takes values
    of the model's, not its batch)."""
    values = [node.meta.get("example_value") if isinstance(node, fx.Node) else None for node in _returned(gm)]
    differentiable = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
    if differentiable and (loss is None or not values[loss].requires_grad):
        raise _not_one_scalar_loss(len(differentiable), tuple(differentiable[0].shape), microbatches)


def loss_index(gm: fx.GraphModule) -> int | None:
    """Which output of Dynamo's graph `gm` is the loss: the first floating-point scalar it
    returns that requires grad, or where none does (under no_grad), its first floating-point
    scalar; None without one.

    Not always output 0: Dynamo returns the tensors of an object the forward made and returns
    (a Hugging Face model's key and value cache, on unless `use_cache=False`) before the
    model's outputs, and a model may return its logits before its loss. The step returns its
    outputs in Dynamo's order, and differentiates the loss alone."""
    scalars = [(index, node.meta["example_value"]) for index, node in enumerate(_returned(gm))
               if isinstance(node, fx.Node) and isinstance(node.meta.get("example_value"), torch.Tensor)
               and node.meta["example_value"].numel() == 1 and node.meta["example_value"].is_floating_point()]
    return next((index for index, value in scalars if value.requires_grad), scalars[0][0] if scalars else None)


def _returned(gm: fx.GraphModule) -> list:
    """What Dynamo's graph returns, flat: the model's outputs (a `ModelOutput`'s fields, say), and
    any tensor its forward left on a module (a recurrent state), which Dynamo's code stores there."""
    outputs = next(n for n in reversed(gm.graph.nodes) if n.op == "output").args[0]
    return list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]


def _detach_outputs_beside_the_loss(gm: fx.GraphModule, loss: int | None) -> list[int]:
    """Return every output but the loss (output `loss`) of Dynamo's graph `gm` detached, so that
    the step differentiates the loss alone; the indices of those that required grad, which the
    step returns attached (`runtime.step`)."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    returned, detached = _returned(gm), []
    for index, node in enumerate(returned):
        example = node.meta.get("example_value") if isinstance(node, fx.Node) else None
        if index != loss and isinstance(example, torch.Tensor) and example.requires_grad:
            detached.append(index)
            with gm.graph.inserting_before(output):
                returned[index] = gm.graph.call_method("detach", (node,))
            returned[index].meta["example_value"] = example
    if detached:
        output.args = (type(output.args[0])(returned) if isinstance(output.args[0], (tuple, list)) else returned[0],)
        gm.recompile()
    return detached


def _check_outputs_split_by_rows(joint: fx.GraphModule, inputs: list[GraphInput], outputs: list[GraphOutput],
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


def _made_where(node: fx.Node) -> str:
    """`node`, with the line of the model that made it (the last frame of its stack trace)."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in ([^\n]+)(?:\n[ \t]+([^\n]*))?',
                        node.meta.get("stack_trace") or "")
    if not frames:
        return node.name
    path, line, function, code = frames[-1]
    made = f"{node.name}, made at {os.path.basename(path)}:{line} in {function}"
    return f"{made} ({code.strip()})" if code else made


def _check_one_scalar_loss(joint: fx.GraphModule, inputs: list[GraphInput], outputs: list[GraphOutput],
                           microbatches: int) -> None:
    """A training graph has one differentiable output, first: the scalar loss."""
    tangents = [i for i in inputs if i.role is InputRole.TANGENT]
    loss = next((o for o in outputs if o.role is OutputRole.LOSS), None)
    loss_val = next((n.meta["val"] for n in joint.graph.nodes if loss and n.name == loss.name), None)
    if loss_val is None or len(tangents) != 1 or loss_val.numel() != 1:
        raise _not_one_scalar_loss(len(tangents), tuple(loss_val.shape) if loss_val is not None else None,
                                   microbatches)


def capture(gm: fx.GraphModule, example_inputs: list, strategy: Strategy, dp_group: str | None) -> TrainingDAG:
    """Trace `gm` into a joint graph and describe its inputs and outputs.

    Requires: `gm` is a whole Dynamo graph (no graph break) that returns the scalar
    loss when training (`loss_index`), with its inputs' sources kept (`keep_input_sources`).
    Guarantees: a `TrainingDAG` whose joint graph
    takes its placeholders in order and returns exactly `dag.outputs` as a flat tuple,
    each node a unit's forward runs or differentiates marked with that unit (`ops.LAYER`);
    it differentiates the loss alone: an output beside it that the model made with a
    gradient is returned detached, its `GraphOutput.made_at` saying where the model made it.
    With microbatches, every output beside the loss has the microbatch's rows at dim 0.
    """
    dynamo_placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    sized = any(_is_size_input(node, example) for node, example in zip(dynamo_placeholders, example_inputs))
    loss = loss_index(gm)
    if torch.is_grad_enabled():
        _check_a_scalar_loss(gm, loss, strategy.microbatches)
    gm, traced_inputs, arg_indices = _specialize_to_microbatch(gm, example_inputs, strategy.microbatches)
    made = {index: _made_where(node) for index, node in enumerate(_returned(gm)) if isinstance(node, fx.Node)}
    attached = {index: made[index] for index in _detach_outputs_beside_the_loss(gm, loss)} \
        if torch.is_grad_enabled() else {}
    dynamo_placeholders = [dynamo_placeholders[i] for i in arg_indices]
    _trace_mixed_precision(gm, traced_inputs, strategy.mixed_precision)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in traced_inputs)
    # Our own static fake mode, not Dynamo's: the microbatch graph must add no
    # symbols (and so no guards) to the frame Dynamo is compiling. It has a shape
    # environment, which Inductor's FX graph cache needs to cache a task, kept
    # empty: inputs are made fake with static shapes (`ignore_shape_env`).
    fake_mode = FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True)
    # The joint graph module is lazy, as ours are (`compat.make_graph_module`).
    with contextlib.ExitStack() as stack, tracing(TracingContext(fake_mode)), lazy_graph_modules(True):
        try:
            exported = aot_export_joint_with_descriptors(
                stack, gm, tuple(traced_inputs), decompositions=decompositions_for(strategy), ignore_shape_env=True)
        except Exception as error:
            if strategy.microbatches > 1 and not sized:
                raise PiperError(_FIXED_BATCH) from error
            raise
        joint = exported.graph_module

    for node in joint.graph.nodes:
        layer = layer_of(node, strategy.units)
        if layer is not None:
            node.meta[LAYER] = layer
    names = [placeholder_name(example_inputs[i]) for i in arg_indices]
    inputs = _describe_inputs(joint, traced_inputs, arg_indices, dynamo_placeholders, names)
    output_node = next(n for n in reversed(joint.graph.nodes) if n.op == "output")
    outputs, kept = _describe_outputs(output_node, arg_indices, loss, attached)
    if training:
        _check_one_scalar_loss(joint, inputs, outputs, strategy.microbatches)
    if strategy.microbatches > 1:
        _check_outputs_split_by_rows(joint, inputs, outputs, made, strategy.microbatches)

    # A flat calling convention (placeholders in, flat tuple out) for the passes.
    joint.graph._codegen = fx.graph.CodeGen()
    output_node.args = (tuple(kept),)
    output_node.meta.pop("desc", None)
    joint.recompile()
    return TrainingDAG(joint, inputs, outputs, strategy, dp_group, training)
