"""Capture: Dynamo graph -> joint forward/backward ATen graph with descriptors.

Uses AOTAutograd's `aot_export_joint_with_descriptors`, whose placeholders and
outputs carry descriptors (PlainAOTInput, TangentAOTInput, GradAOTOutput, ...).
Dynamo has already lifted parameters and buffers into graph inputs, so their
meaning comes from the compiled call's example inputs (which are the real
`nn.Parameter` objects) and from Dynamo's input sources (for buffer names).
"""
from __future__ import annotations

import contextlib
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
from .ir import GraphInput, InputRole, TrainingDAG
from .ops import LAYER, SOURCE
from .options import MixedPrecision, Strategy
from .outputs import (check_a_scalar_loss, check_one_scalar_loss, check_outputs_split_by_rows, describe_outputs,
                      detach_outputs_beside_the_loss, flat_returns, loss_index, made_where)
from .sharding.dtensor_params import is_replicated_parameter, placeholder_name, program_tensor, stood_for
from .sharding.experts import EXPERT_ATTR, UNSHARD_EXPERTS
from .sharding.row_shard import INFO_ATTR, UNSHARD, sharded_parameter_info
from .sharding.units import layer_of

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


def _symbol(size: object):
    """The expression of a symbolic size (a SymInt), or None for a plain int."""
    return size.node.expr if isinstance(size, torch.SymInt) else None


def call_sizes(gm: fx.GraphModule, example_inputs: list) -> dict:
    """The call's value of each size Dynamo made symbolic in `gm` (by its expression), from its
    size inputs among `example_inputs`: what `outputs.returned_numbers` evaluates a number at."""
    return {_symbol(node.meta.get("example_value", example)): example.node.hint
            if isinstance(example, torch.SymInt) else example
            for node, example in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)
            if _is_size_input(node, example)}


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


# Why a pipeline's graph did not trace at microbatch size, when Dynamo saw a fixed batch size.
_FIXED_BATCH = (
    "piper_fx traces a pipeline's model at the size of one microbatch, and tracing it failed: its "
    "batch arguments reached the compiler with a fixed size, which the model may read (a view of "
    "the batch's shape, say). piper_fx.prepare marks their batch dimension dynamic on every call of "
    "the module it prepared; compile that module (torch.compile(model, ...)), or mark it on the "
    "arguments of the function you compile before each call (torch._dynamo.mark_dynamic(x, 0))")


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
        check_a_scalar_loss(gm, loss, strategy.microbatches)
    gm, traced_inputs, arg_indices = _specialize_to_microbatch(gm, example_inputs, strategy.microbatches)
    made = {index: made_where(node) for index, node in enumerate(flat_returns(gm)) if isinstance(node, fx.Node)}
    attached = {index: made[index] for index in detach_outputs_beside_the_loss(gm, loss)} \
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
    outputs, kept = describe_outputs(output_node, arg_indices, loss, attached)
    if training:
        check_one_scalar_loss(joint, inputs, outputs, strategy.microbatches, gm)
    if strategy.microbatches > 1:
        check_outputs_split_by_rows(joint, inputs, outputs, made, strategy.microbatches)

    # A flat calling convention (placeholders in, flat tuple out) for the passes.
    joint.graph._codegen = fx.graph.CodeGen()
    output_node.args = (tuple(kept),)
    output_node.meta.pop("desc", None)
    joint.recompile()
    return TrainingDAG(joint, inputs, outputs, strategy, dp_group, training)
