"""Pass: make random ops (dropout, rand, randn, bernoulli, ...) functions of the sample they act on.

Single-device training draws one random tensor per op for the whole batch.
Drawn from torch's generator per task, a microbatch's values would depend on
the microbatch split, the data-parallel rank and the schedule's order. Here
each random op becomes Philox-4x32 (`piper_fx.philox`, plain integer tensor
ops) of a counter (global element index, op index, step) under a per-run key:
the element of sample s of the global batch gets the same value however the
batch is split, on any device and with any codegen.

Requires: the captured joint graph, before any other pass (op indices are
positions in this graph, the same on every rank). Random tensors are
batch-major: dim 0 is the batch (or batch x sequence after a reshape), each
sample's elements contiguous, as for dropout on activations. A random tensor
whose dim 0 is not a multiple of the microbatch's samples is taken to be per
step (e.g. noise on a weight): every microbatch and replica draws the same
values, as the single device draws it once. (One whose dim 0 is such a
multiple by chance would be taken for batch-major.)
Guarantees: with no random op, the DAG is unchanged. Otherwise a new
placeholder, `InputRole.RNG`, of `philox.RNG_WORDS` int64 words per
microbatch (see `philox`; the step supplies it, from `step_randomness`), and
every random op replaced by ops computing its values from it:
`native_dropout` (eager capture) as `keep = u > p`, `keep * x / (1 - p)`,
`rand` / `rand_like` (Inductor's dropout decomposition) as u, `randn` /
`randn_like` by Box-Muller, `bernoulli` as `u < p`, and the in-place draws
(`uniform_`, `exponential_`, `normal_`, `log_normal_`) and `torch.normal` as
transforms of uniform or normal values. Nothing is drawn again in
the backward: it reads the forward's mask, a saved forward value, as before.
Eager and Inductor capture draw the same masks. Any other random op, and
attention with dropout, is a `PiperError` naming it.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.fx as fx

from ..decompositions import decompositions_for
from ..collectives.emit import insert_traced
from ..errors import PiperError
from ..ir import GraphInput, InputRole, TrainingDAG, add_placeholder
from ..ops import is_attention
from ..options import Strategy
from ..philox import RNG_WORDS, StepRandomness, Stream, draw_seed, normal, uniform

aten = torch.ops.aten
UNIFORM = {aten.rand.default, aten.rand_like.default}
NORMAL = {aten.randn.default, aten.randn_like.default}
BERNOULLI = {aten.bernoulli.p, aten.bernoulli.default}
DROPOUT = {aten.native_dropout.default}
prims = torch.ops.prims
# In-place draws as functionalization writes them (`x.uniform_(a, b)`, `x.exponential_()`,
# `x.normal_(m, s)`, `x.log_normal_()`), `torch.normal`, and the prims Inductor's decompositions
# write for them: a transform of uniform or normal values (Mixtral's router jitter is
# `uniform_`, PhiMoE's Gumbel sampling `exponential_`). Uniform ones by their bounds' names.
UNIFORM_BETWEEN = {aten.uniform.default: ("from", "to"), prims.uniform.default: ("low", "high")}
EXPONENTIAL = {aten.exponential.default}
NORMAL_WITH = {aten.normal_functional.default, aten.normal.Tensor_float, aten.normal.float_Tensor,
               aten.normal.Tensor_Tensor, aten.normal.float_float, aten.log_normal.default, prims.normal.default}
TRANSFORMED = UNIFORM_BETWEEN.keys() | EXPONENTIAL | NORMAL_WITH


def _op_index(rng: torch.Tensor, *, op_index: int) -> torch.Tensor:
    return torch.full((), op_index, dtype=torch.int64, device=rng.device)


def _keep(u: torch.Tensor, *, p: float) -> torch.Tensor:
    return u > p  # as Inductor's decomposition of dropout, so both captures draw the same mask


def _apply_mask(x: torch.Tensor, keep: torch.Tensor, *, scale: float) -> torch.Tensor:
    return keep * x * scale


def _bernoulli(u: torch.Tensor, probability, *, dtype: torch.dtype) -> torch.Tensor:
    return (u < probability).to(dtype)


def _uniform_between(u: torch.Tensor, *, low: float, high: float, dtype: torch.dtype) -> torch.Tensor:
    return (low + (high - low) * u).to(dtype)


def _exponential(u: torch.Tensor, *, rate: float, dtype: torch.dtype) -> torch.Tensor:
    return (-torch.log(1.0 - u) / rate).to(dtype)  # 1 - u is in (0, 1]


def _normal_with(n: torch.Tensor, *tensors: torch.Tensor, mean, std, log: bool, dtype: torch.dtype) -> torch.Tensor:
    """`mean + std * n` (its exp for a log-normal); `mean` or `std` None: the next of `tensors`."""
    given = iter(tensors)
    value = (next(given) if mean is None else mean) + (next(given) if std is None else std) * n
    return (torch.exp(value) if log else value).to(dtype)


def _argument(node: fx.Node, name: str, default=None):
    schema = node.target._schema
    for index, argument in enumerate(schema.arguments):
        if argument.name == name:
            return node.args[index] if index < len(node.args) else node.kwargs.get(name, default)
    return default


def _is_random(node: fx.Node) -> bool:
    # An ATen op overload carries its tags; other targets (operator.getitem, ...) have none.
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def samples_per_microbatch(dag: TrainingDAG) -> int:
    """Samples in one microbatch: dim 0 of the batch arguments (traced at microbatch size)."""
    placeholders = dag.placeholders()
    for graph_input in dag.inputs:
        val = placeholders[graph_input.name].meta.get("val")
        if graph_input.role is InputRole.INPUT and isinstance(val, torch.Tensor) and val.dim() >= 1:
            return val.shape[0]
    return 1


def _per_sample(shape, samples: int) -> int:
    """Elements per sample of a batch-major random tensor; 0 for a per-step one."""
    if len(shape) >= 1 and shape[0] % samples == 0:
        return math.prod(shape) // samples
    return 0


def _random_ops(graph: fx.Graph) -> list[fx.Node]:
    """The random ops to replace, in graph order; a `PiperError` for one that cannot be."""
    random_ops = []
    for node in graph.nodes:
        if not _is_random(node):
            continue
        if is_attention(node):
            if (_argument(node, "dropout_p") or 0.0) > 0.0:
                raise PiperError(f"{node.name} ({node.target}) is attention with dropout, whose random values "
                                 "piper_fx cannot reproduce across microbatches and ranks: apply "
                                 "torch.nn.functional.dropout to the attention weights instead")
            continue
        if node.target in DROPOUT and (_argument(node, "train") is False or float(node.args[1]) == 0.0):
            continue  # evaluation, or p = 0: keeps every element whatever is drawn
        if node.target not in UNIFORM | NORMAL | BERNOULLI | DROPOUT | TRANSFORMED:
            raise PiperError(f"{node.name} is the random op {node.target}, which piper_fx cannot make "
                             "reproducible across microbatches and ranks; it supports dropout, rand, randn, "
                             "bernoulli (and their _like forms), uniform_, normal_, log_normal_, exponential_ "
                             "and torch.normal")
        random_ops.append(node)
    return random_ops


def _add_rng_input(dag: TrainingDAG, like: fx.Node) -> fx.Node:
    """The `InputRole.RNG` placeholder: `RNG_WORDS` int64 words per microbatch, on `like`'s device."""
    graph = dag.joint.graph
    val = like.meta["val"]
    val = val[0] if isinstance(val, (tuple, list)) else val
    with graph.inserting_after(graph.find_nodes(op="placeholder")[-1]):
        rng = add_placeholder(graph, "rng")
    with val.fake_mode:
        rng.meta["val"] = torch.empty(RNG_WORDS, dtype=torch.int64, device=val.device)
    dag.inputs.append(GraphInput(rng.name, InputRole.RNG, None))
    return rng


def _replace(graph: fx.Graph, node: fx.Node, op_index: int, rng: fx.Node, samples: int, splice) -> None:
    """Replace the random op `node` by ops computing its values from `rng` (module docstring)."""
    val = node.meta["val"]
    out_val = val[0] if node.target in DROPOUT else val
    shape = tuple(out_val.shape)
    # The op's index as a value, so ops of one shape share one trace of the generator (tracing is slow).
    index = splice(functools.partial(_op_index, op_index=op_index), [rng], before=node, like=node)
    transformed = node.target in TRANSFORMED  # drawn in float32, then transformed and converted
    draw = functools.partial(normal if node.target in NORMAL | NORMAL_WITH else uniform, shape=shape,
                             per_sample=_per_sample(shape, samples),
                             dtype=torch.float32 if transformed else out_val.dtype)
    values = splice(draw, [rng, index], before=node, like=node)
    if node.target in DROPOUT:
        x, p = node.args[0], float(node.args[1])
        keep = splice(functools.partial(_keep, p=p), [values], before=node, like=node)
        out = splice(functools.partial(_apply_mask, scale=0.0 if p >= 1 else 1.0 / (1.0 - p)), [x, keep],
                     before=node, like=node)
        for user in list(node.users):  # getitem 0: the output, 1: the mask
            user.replace_all_uses_with((out, keep)[user.args[1]])
            graph.erase_node(user)
    elif node.target in BERNOULLI:
        probability = node.args[1] if node.target is aten.bernoulli.p else node.args[0]
        if isinstance(probability, fx.Node):  # a tensor of probabilities
            values = splice(functools.partial(_bernoulli, dtype=val.dtype), [values, probability],
                            before=node, like=node)
        else:
            values = splice(functools.partial(_bernoulli, probability=float(probability), dtype=val.dtype),
                            [values], before=node, like=node)
        node.replace_all_uses_with(values)
    elif transformed:
        node.replace_all_uses_with(_transform(node, values, val.dtype, splice))
    else:
        node.replace_all_uses_with(values)
    graph.erase_node(node)


def _transform(node: fx.Node, values: fx.Node, dtype: torch.dtype, splice) -> fx.Node:
    """The values of the random op `node` (in `TRANSFORMED`) from float32 `values` drawn for it:
    uniform ones for `uniform` and `exponential`, normal ones for the rest."""
    if node.target in UNIFORM_BETWEEN:
        low, high = UNIFORM_BETWEEN[node.target]
        transform = functools.partial(_uniform_between, low=float(_argument(node, low, 0.0)),
                                      high=float(_argument(node, high, 1.0)), dtype=dtype)
        return splice(transform, [values], before=node, like=node)
    if node.target in EXPONENTIAL:
        transform = functools.partial(_exponential, rate=float(_argument(node, "lambd", 1.0)), dtype=dtype)
        return splice(transform, [values], before=node, like=node)
    log = node.target is aten.log_normal.default
    mean, std = _argument(node, "mean", 1.0 if log else 0.0), _argument(node, "std", 2.0 if log else 1.0)
    tensors = [value for value in (mean, std) if isinstance(value, fx.Node)]
    transform = functools.partial(_normal_with, mean=None if isinstance(mean, fx.Node) else float(mean),
                                  std=None if isinstance(std, fx.Node) else float(std), log=log, dtype=dtype)
    return splice(transform, [values, *tensors], before=node, like=node)


def functionalize_random(dag: TrainingDAG, strategy: Strategy) -> TrainingDAG:
    graph = dag.joint.graph
    random_ops = _random_ops(graph)
    if not random_ops:
        return dag
    rng = _add_rng_input(dag, random_ops[0])
    samples = samples_per_microbatch(dag)
    splice = functools.partial(insert_traced, graph, decompositions=decompositions_for(strategy))
    for op_index, node in enumerate(random_ops):
        _replace(graph, node, op_index, rng, samples, splice)
    graph.lint()
    dag.joint.recompile()
    return dag


def random_input(dag: TrainingDAG) -> tuple[torch.device, int] | None:
    """The device of the graph's `InputRole.RNG` input and the samples in a microbatch, if it has one."""
    rng = next((i for i in dag.inputs if i.role is InputRole.RNG), None)
    if rng is None:
        return None
    return dag.placeholders()[rng.name].meta["val"].device, samples_per_microbatch(dag)


def step_randomness(random: tuple[torch.device, int] | None, strategy: Strategy,
                    stream: Stream | None = None) -> StepRandomness | None:
    """What the compiled step feeds the `InputRole.RNG` input (`random_input`), if the graph
    has one, drawing from `stream` (the model's, an earlier compile's), or else from a new
    stream, whose seed it draws (collective over every rank: call it on all of them)."""
    if random is None:
        return None
    device, samples = random
    return StepRandomness(stream or Stream(draw_seed(device)), samples,
                          strategy.dp_index * samples * strategy.microbatches, device)
