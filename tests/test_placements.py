"""Placements (`passes.propagate_placements`, `sharding.specs`): every node of the joint graph
gets a decided one, from DTensor's sharding propagator or piper_fx's own rules, and an op
no rule places is a `PiperError` naming it.

The models of the suite are planned up to the pass on a fake process group of their
world in this process (each plan destroys its group, as `training.plan_all_ranks` does:
a fresh process would double this file's time); the rules themselves are tested on
graphs made here.
"""
import pytest
import torch
import torch.distributed as dist
import torch.fx as fx
from torch.distributed.tensor import Partial, Placement, Replicate, Shard
from torch.fx.experimental.proxy_tensor import make_fx

from piper_fx.compat import TORCH_VERSION
from piper_fx.errors import PiperError
from piper_fx.sharding.specs import READS_KEY, SPEC_KEY, format_spec, is_decided, planning_mesh, propagate


# An op no rule knows: the first three rows of a batch-sharded tensor (another leading size).
@torch.library.custom_op("piper_test::first_three_rows", mutates_args=())
def first_three_rows(x: torch.Tensor) -> torch.Tensor:
    return x[:3].clone()


@first_three_rows.register_fake
def _(x):
    return x.new_empty(3, *x.shape[1:])


class ThreeRows(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 1)

    def forward(self, x, y):
        return (self.fc(first_three_rows(x)) - y[:3]).square().mean()


# ---- Planning the models of the suite.

def _model(name: str, pp: bool):
    """(module, the callable to compile, its arguments) of a model of the suite."""
    from examples.gpt import GPT, GPTConfig
    from models import MODELS, DropoutMLP, batch
    from training import SMALL, global_batch, mark_regions

    if name.startswith("gpt"):  # a layer per pipeline stage, else one
        cfg = GPTConfig(**{**SMALL, "n_layer": 2 if pp else 1}, tied_embeddings="untied" not in name,
                        n_expert=4 if "moe" in name else 0)
        model = mark_regions(GPT(cfg), pipeline=bool(pp), experts=bool(cfg.n_expert))
        return model, model, global_batch(0, 4, cfg)
    model = {"dropout_mlp": lambda: DropoutMLP(0.1), "three_rows": ThreeRows}.get(name, MODELS.get(name))()
    return model, model, batch(0, 4)


def _planned(name: str, options: dict, world: int):
    """The joint graph of `name` under `options`, after `propagate_placements`, on a fake
    process group of `world` ranks (data-parallel index 0)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import piper_fx
    from piper_fx.capture import capture, keep_input_sources
    from piper_fx.passes import PIPELINE, position, run_passes
    from piper_fx.passes.propagate_placements import propagate_placements
    from piper_fx.sharding.mesh import dp_group_name

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model, fn, args = _model(name, options.get("mesh", {}).get("pp", 1) > 1)
        piper_fx.prepare(model, options)
        strategy = piper_fx.parse_options(options)
        captured = {}

        def backend(gm, example_inputs):
            keep_input_sources(gm)
            captured["dag"] = capture(gm, example_inputs, strategy, dp_group_name(strategy))
            return gm.forward

        torch.compile(fn, backend=backend)(*args)
        pipeline = PIPELINE[:position(propagate_placements) + 1]
        return run_passes(captured["dag"], strategy.with_rank(0), lambda *_: None, pipeline)
    finally:
        dist.destroy_process_group()


def _summary(dag) -> dict:
    """What the tests check of a planned graph."""
    from piper_fx.ir import OutputRole

    nodes = [n for n in dag.joint.graph.nodes if n.op in ("placeholder", "get_attr", "call_function")]
    placeholders = dag.placeholders()
    by_name = {n.name: n for n in nodes}
    role_of_arg = {i.arg_index: i.role.value for i in dag.inputs if i.arg_index is not None}
    return {
        "nodes": len(nodes),
        "undecided": [f"{n.name} ({n.target}): {format_spec(n.meta.get(SPEC_KEY))}" for n in nodes
                      if not is_decided(n.meta.get(SPEC_KEY), n.meta.get("val"))],
        "inputs": [(i.role.value, placeholders[i.name].meta["val"].dim(), placeholders[i.name].meta[SPEC_KEY])
                   for i in dag.inputs],
        "grads": [(role_of_arg[o.index], by_name[o.name].meta[SPEC_KEY]) for o in dag.outputs
                  if o.role is OutputRole.GRAD],
        "loss": [by_name[o.name].meta[SPEC_KEY] for o in dag.outputs if o.role is OutputRole.LOSS],
        "reads": sorted({str(n.target) for n in nodes if n.meta.get(READS_KEY)}),
    }


def _plan_cases(cases: dict) -> dict:
    return {case: _summary(_planned(name, options, world)) for case, (name, options, world) in cases.items()}


def _unplaceable_error() -> dict:
    try:
        _planned("three_rows", {"codegen": "eager"}, 2)
    except PiperError as e:
        return {"type": type(e).__name__, "message": str(e), "notes": getattr(e, "__notes__", [])}
    return {"type": None}


DP2 = {"codegen": "eager"}
PP2xDP2 = {"mesh": {"pp": 2, "dp": 2}, "codegen": "eager"}
CASES = {  # case: (model, options, world)
    "gpt ddp": ("gpt", {**DP2, "zero": 0}, 2),
    "gpt zero3 inductor": ("gpt", {"zero": 3, "codegen": "inductor"}, 2),
    "gpt pp2 x dp2 zb1p zero2": ("gpt_untied", {**PP2xDP2, "zero": 2,
                                                "pipeline": {"schedule": "zb1p", "microbatches": 2}}, 4),
    "gpt zero1 microbatches 2": ("gpt", {**DP2, "zero": 1, "pipeline": {"microbatches": 2}}, 2),
    "gpt experts ep2": ("gpt_moe", {"mesh": {"dp": 2, "ep": 2}, "codegen": "eager"}, 2),
    "skip pp2 x dp2 1f1b": ("skip", {**PP2xDP2, "pipeline": {"schedule": "1f1b", "microbatches": 2}}, 4),
    "dropout_mlp zero3 inductor": ("dropout_mlp", {"zero": 3, "codegen": "inductor"}, 2),
}


@pytest.fixture(scope="module")
def planned():
    assert not dist.is_initialized()  # each plan makes its own fake group, and destroys it
    return {"cases": _plan_cases(CASES), "unplaceable": _unplaceable_error()}


@pytest.mark.parametrize("case", CASES)
def test_every_node_of_every_models_joint_graph_has_a_decided_placement(planned, case):
    result = planned["cases"][case]
    assert result["nodes"] > 0 and result["undecided"] == [], result["undecided"][:10]


@pytest.mark.parametrize("case", CASES)
def test_inputs_and_gradients_are_placed_as_the_strategy_holds_them(planned, case):
    result = planned["cases"][case]
    zero = CASES[case][1].get("zero", 0)
    expected = {"input": Shard(0), "param": Replicate(), "param_shard": Shard(0), "buffer": Replicate(),
                "tangent": Replicate(), "rng": Replicate()}
    for role, ndim, spec in result["inputs"]:
        if role == "input" and ndim == 0:
            continue  # a scalar argument is the same on every rank
        assert spec == expected[role], (role, spec)
    assert [role for role, _, _ in result["inputs"]].count("param_shard" if zero else "param") > 0
    grads = [spec for role, spec in result["grads"] if role in ("param", "param_shard")]
    assert grads
    if zero:  # reduce-scattered (ZeRO-2/3), or all-reduced then sliced (ZeRO-1): this rank's rows
        assert all(spec == Shard(0) for spec in grads), grads
    elif zero == 0 and "ep" not in CASES[case][1].get("mesh", {}):  # all-reduced
        assert all(spec == Replicate() for spec in grads), grads
    # The replica's loss: its mean over its own rows, whose average over dp is the global mean.
    # (Inductor's decomposition divides by the replica's count, read as the global one:
    # DTensor then takes the loss for a part of the sum.)
    (loss,) = result["loss"]
    assert loss == Partial("avg") or CASES[case][1]["codegen"] == "inductor" and isinstance(loss, Partial), loss


def test_placements_of_a_dense_model_take_dtensors_rules_as_they_are(planned):
    # At most one reading: the mean loss's backward divides by this replica's count (a partial sum).
    assert set(planned["cases"]["gpt ddp"]["reads"]) <= {"aten.nll_loss_backward.default"}
    # Random values are this rank's rows of the single-device ones: the dropout mask is read as placed.
    assert planned["cases"]["dropout_mlp zero3 inductor"]["reads"] == []


def test_an_op_no_rule_places_is_an_error_naming_it_in_the_pass(planned):
    error = planned["unplaceable"]
    assert error["type"] == "PiperError", error
    assert "piper_test.first_three_rows.default" in error["message"], error["message"]
    assert "dp:S(0)" in error["message"] and "no rule" in error["message"], error["message"]
    assert "in piper_fx pass 'propagate_placements'" in error["notes"], error["notes"]


# ---- The rules, on graphs made here (no process group: the planning mesh needs none).

def _propagate(fn, *inputs: tuple[tuple[int, ...], object], ranks: int = 2) -> fx.Graph:
    """`fn` traced on fake tensors of the given shapes, propagated from the given placements
    over a planning mesh of `ranks` ranks."""
    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(shape) for shape, _ in inputs])
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    propagate(gm.graph, {n.name: p for n, (_, p) in zip(placeholders, inputs)}, planning_mesh(ranks))
    return gm.graph


def _specs(graph: fx.Graph, target) -> list:
    return [n.meta[SPEC_KEY] for n in graph.nodes if n.target == target]


def test_an_op_with_no_rule_raises_naming_the_op_and_its_inputs():
    with pytest.raises(PiperError) as raised:
        _propagate(lambda x: first_three_rows(x) * 2, ((4, 8), Shard(0)))
    message = str(raised.value)
    assert "piper_test.first_three_rows.default(x_1: dp:S(0))" in message, message
    assert "no rule" in message and "report" in message, message
    # With replicated inputs every rank computes the same: replicated, whatever the op.
    graph = _propagate(lambda x: first_three_rows(x) * 2, ((4, 8), Replicate()))
    assert _specs(graph, torch.ops.piper_test.first_three_rows.default) == [Replicate()]


FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
FLASH_BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
QKV = (4, 2, 9, 8)  # batch, heads, sequence, head width


def _attention(q, k, v):
    out, logsumexp = FLASH(q, k, v, 0.0, True)
    return FLASH_BACKWARD(out.clone(), q, k, v, out, logsumexp, 0.0, True)


def test_cpu_flash_attention_and_its_backward_are_row_wise_in_the_batch():
    graph = _propagate(_attention, (QKV, Shard(0)), (QKV, Shard(0)), (QKV, Shard(0)))
    assert _specs(graph, FLASH) == [(Shard(0), Shard(0))]
    assert _specs(graph, FLASH_BACKWARD) == [(Shard(0), Shard(0), Shard(0))]
    # A key of the whole batch on every rank is not this rank's rows of it: no placement fits.
    with pytest.raises(PiperError, match="_scaled_dot_product_flash_attention_for_cpu.default"):
        _propagate(_attention, (QKV, Shard(0)), (QKV, Replicate()), (QKV, Shard(0)))
    # A mask made alike on every rank for its rows (Hugging Face's causal mask, materialized
    # for gradient checkpointing) is read as this rank's rows of the batch's mask.
    masked = _propagate(lambda q, k, v, mask: FLASH(q, k, v, 0.0, False, attn_mask=mask),
                        (QKV, Shard(0)), (QKV, Shard(0)), (QKV, Shard(0)), ((4, 1, 9, 9), Replicate()))
    flash, = (n for n in masked.nodes if n.target == FLASH)
    assert flash.meta[SPEC_KEY] == (Shard(0), Shard(0))
    assert flash.meta[READS_KEY] == (("mask_1", Shard(0)),)


def test_a_scatter_add_of_each_ranks_rows_into_zeros_is_a_partial_sum():
    aten = torch.ops.aten

    def embedding_backward(grad, tokens):  # as Inductor decomposes it
        mask = (tokens >= 0).unsqueeze(-1)
        return aten._unsafe_masked_index_put_accumulate(grad.new_zeros(37, 16), mask, [tokens], grad)

    gm = make_fx(embedding_backward, tracing_mode="fake")(torch.randn(4, 9, 16), torch.randint(0, 37, (4, 9)))
    grad, tokens = [n for n in gm.graph.nodes if n.op == "placeholder"]
    propagate(gm.graph, {grad.name: Shard(0), tokens.name: Shard(0)}, planning_mesh(2))
    assert _specs(gm.graph, aten._unsafe_masked_index_put_accumulate.default) == [Partial("sum")]
    # Ids made alike on every rank for its rows (BERT's token types, a buffer expanded over the
    # batch) are read as this rank's rows, as DTensor's rule for `embedding_dense_backward`
    # reads them (found by the Hugging Face strategy search: BERT under Inductor).
    propagate(gm.graph, {grad.name: Shard(0), tokens.name: Replicate()}, planning_mesh(2))
    (put,) = (n for n in gm.graph.nodes if n.target == aten._unsafe_masked_index_put_accumulate.default)
    assert put.meta[SPEC_KEY] == Partial("sum")
    assert {name for name, placement in put.meta[READS_KEY] if placement == Shard(0)} == {
        a.name for a in put.args[1:3] for a in (a if isinstance(a, list) else [a])}
    # A partial sum of values at this rank's rows of ids is neither its rows nor its part: no rule holds.
    with pytest.raises(PiperError, match="_unsafe_masked_index_put_accumulate"):
        propagate(gm.graph, {grad.name: Partial("sum"), tokens.name: Shard(0)}, planning_mesh(2))


def test_constants_and_empty_tensors_are_every_placement_they_are_read_as():
    # As Hugging Face's Llama concatenates an empty cache (a graph constant) with the keys.
    cache = torch.zeros(0)
    gm = make_fx(lambda keys: torch.cat([cache, keys], dim=-2))(torch.randn(QKV))
    (keys,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    propagate(gm.graph, {keys.name: Shard(0)}, planning_mesh(2))
    (constant,) = [n for n in gm.graph.nodes if n.op == "get_attr"]
    assert constant.meta[SPEC_KEY] == Replicate()
    (cat,) = [n for n in gm.graph.nodes if n.target == torch.ops.aten.cat.default]
    assert cat.meta[SPEC_KEY] == Shard(0) and READS_KEY not in cat.meta


def test_a_view_of_one_row_per_rank_keeps_the_rows_sharded():
    # Flattening a batch whose rows on this rank do not divide by the ranks (here one of
    # four): DTensor's checks are of the global batch, which does.
    graph = _propagate(lambda t: t.view(-1).view(1, 9) * 2, ((1, 9), Shard(0)), ranks=4)
    assert _specs(graph, torch.ops.aten.view.default) == [Shard(0), Shard(0)]


def test_a_view_folding_one_row_of_a_transposed_batch_keeps_the_rows_sharded():
    # With one row per rank, matmul's decomposition views a transposed batch (rows, heads,
    # tokens, width) as rows of heads: legal on this rank's row alone, whose stride is never
    # stepped, and so for the global batch laid out with its rows just outside the heads.
    graph = _propagate(lambda t: t.transpose(1, 2).view(2, 8, 16) * 2, ((1, 8, 2, 16), Shard(0)))
    assert _specs(graph, torch.ops.aten.view.default) == [Shard(0)]


def test_a_view_folding_one_row_of_keys_expanded_over_the_heads_keeps_the_rows_sharded():
    # Falcon's and Gemma 2's one key head expanded over the query's heads, then viewed as rows
    # of heads by matmul's decomposition: with one row per rank (ZBV's microbatches) DTensor
    # was asked about a global tensor laid out heads-outside-rows, which no view folds.
    graph = _propagate(lambda k: k.expand(1, 2, 8, 16).view(2, 8, 16) * 2, ((1, 1, 8, 16), Shard(0)))
    assert _specs(graph, torch.ops.aten.view.default) == [Shard(0)]


def test_a_reversal_keeps_the_placement_of_the_dimensions_it_does_not_reverse():
    # `prims.rev`, Inductor's decomposition of `flip` (Qwen3-Next's gated delta rule).
    rev = torch.ops.prims.rev.default
    graph = _propagate(lambda x: rev(x, [1, 2]) * 2, ((4, 3, 5), Shard(0)))
    assert _specs(graph, rev) == [Shard(0)]
    graph = _propagate(lambda x: rev(x * 2, [2]), ((4, 3, 5), Partial("sum")))
    assert _specs(graph, rev) == [Partial("sum")]
    with pytest.raises(PiperError, match="prims.rev.default"):
        _propagate(lambda x: rev(x, [0]) * 2, ((4, 3, 5), Shard(0)))


def test_an_adaptive_pools_reshapes_of_rows_keep_them_sharded():
    # Inductor's decomposition of an adaptive average pool (Swin) reads its means as rows
    # with strides of its own on dims of one element, and its backward writes the gradient's
    # rows over a flat buffer of zeros and reads that as rows again.
    aten = torch.ops.aten

    def pool_and_back(x):
        rows = aten.as_strided(x.mean(-1, keepdim=True), [4, 32, 1, 1], [32, 1, 32, 32])
        flat = aten.as_strided_scatter(x.new_zeros(128), rows.squeeze(-1).squeeze(-1) * 2, [4, 32], [32, 1], 0)
        return aten.as_strided(flat, [4, 32], [32, 1], 0) + 1

    graph = _propagate(pool_and_back, ((4, 32, 3), Shard(0)))
    assert _specs(graph, aten.as_strided.default) == [Shard(0), Shard(0)]
    assert _specs(graph, aten.as_strided_scatter.default) == [Shard(0)]
    # Over part of the destination, the rest of it is not this rank's alone: no rule holds.
    with pytest.raises(PiperError, match="as_strided_scatter"):
        _propagate(lambda x: aten.as_strided_scatter(x.new_zeros(256), x.mean(-1), [4, 32], [32, 1], 0) * 2,
                   ((4, 32, 3), Shard(0)))


def test_an_interpolations_backward_into_zeros_is_a_partial_sum():
    # BEiT interpolates its relative position bias table; the backward of the interpolation
    # (replicated indices, each rank's part of the gradient) adds into zeros in place.
    aten = torch.ops.aten

    def backward(grad, rows, cols):
        return aten._unsafe_index_put(grad.new_zeros(5, 5), [rows, cols], grad, True)

    gm = make_fx(backward, tracing_mode="fake")(torch.randn(3, 3), torch.randint(0, 5, (3, 1)),
                                                torch.randint(0, 5, (1, 3)))
    grad, rows, cols = [n for n in gm.graph.nodes if n.op == "placeholder"]
    propagate(gm.graph, {grad.name: Partial("sum"), rows.name: Replicate(), cols.name: Replicate()}, planning_mesh(2))
    assert _specs(gm.graph, aten._unsafe_index_put.default) == [Partial("sum")]


def test_a_slice_backward_into_zeros_keeps_the_rows_sharded():
    # Inductor's slice backward: the gradient's rows scattered into zeros, which are this
    # rank's rows of zeros as well as replicated ones (DTensor's rule follows the zeros).
    def slice_backward(grad):
        return torch.ops.aten.slice_scatter(grad.new_zeros(4, 16), grad, 1, 8)

    graph = _propagate(slice_backward, ((4, 8), Shard(0)))
    (scatter,) = [n for n in graph.nodes if n.target == torch.ops.aten.slice_scatter.default]
    assert scatter.meta[SPEC_KEY] == Shard(0) and READS_KEY not in scatter.meta


def test_keys_written_in_slices_of_an_empty_tensor_keep_the_rows_sharded():
    # DeepSeek-V3's latent attention: keys made with `new_empty`, then the parts without and
    # with rotary positions copied into slices of the last dim. Each rank's rows of the empty
    # tensor are read as its rows (no values to move); DTensor's rule replicated them all.
    def latent_keys(nope, rope):
        keys = nope.new_empty(4, 2, 16)
        keys = torch.ops.aten.slice_scatter(keys, nope, 2, 0, 8)
        return torch.ops.aten.slice_scatter(keys, rope.expand(4, 2, 8), 2, 8)

    graph = _propagate(latent_keys, ((4, 2, 8), Shard(0)), ((4, 1, 8), Shard(0)))
    first, second = [n for n in graph.nodes if n.target == torch.ops.aten.slice_scatter.default]
    assert first.meta[SPEC_KEY] == second.meta[SPEC_KEY] == Shard(0)
    empty = first.args[0]
    assert empty.target == torch.ops.aten.new_empty.default and first.meta[READS_KEY] == ((empty.name, Shard(0)),)
    assert READS_KEY not in second.meta


def test_a_slice_assignment_is_placed_as_what_it_copies():
    # Hugging Face's T5 shifts its labels right into zeros: functionalized, as AOTAutograd
    # traces it, a functional copy into the slice (DTensor's rule is the in-place one's).
    def shift_right(labels, start):
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, :1] = start  # one start token, the same for every row
        shifted[:, 0] = start.squeeze()  # and again, as T5 writes it: a fill
        return shifted * 2

    def propagated(labels: Placement) -> fx.Graph:
        gm = make_fx(torch.func.functionalize(shift_right), tracing_mode="fake")(torch.randn(4, 9), torch.randn(1))
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        propagate(gm.graph, dict(zip([n.name for n in placeholders], (labels, Replicate()))), planning_mesh(2))
        return gm.graph

    sharded, replicated = propagated(Shard(0)), propagated(Replicate())
    assert _specs(sharded, torch.ops.aten.copy.default) == [Shard(0), Shard(0)]
    assert _specs(sharded, torch.ops.aten.fill.Tensor) == [Shard(0)]
    assert _specs(replicated, torch.ops.aten.copy.default) == [Replicate(), Replicate()]
    assert _specs(replicated, torch.ops.aten.fill.Tensor) == [Replicate()]
    # A sharded source broadcast along the result's rows has no rows to give them: no placement.
    with pytest.raises(PiperError, match="broadcasts its source"):
        _propagate(lambda source, out: torch.ops.aten.copy(out, source), ((9,), Shard(0)), ((4, 9), Shard(0)))


def test_a_gradient_of_one_row_squeezed_to_a_broadcast_values_shape_is_the_rows_sum():
    # T5's position bias, one row broadcast along the batch: at one row a rank's gradient of the
    # scores already has the bias's shape, and autograd squeezes the row away with no sum over
    # the batch. Each rank holds its row's part of the sum: Partial(sum).
    import torch.fx.traceback as fx_traceback

    def bias_gradient(grad_scores):
        with fx_traceback._set_autograd_backward():
            return torch.ops.aten.squeeze.dim(grad_scores, 0) * torch.ops.aten.squeeze.dims(grad_scores, [-4])

    with fx_traceback.preserve_node_meta():
        graph = _propagate(bias_gradient, ((1, 2, 9, 9), Shard(0)))
    assert _specs(graph, torch.ops.aten.squeeze.dim) == _specs(graph, torch.ops.aten.squeeze.dims) == [Partial("sum")]
    # In the forward, a model squeezing every dimension of size 1 squeezes the batch away at one
    # row a rank (mBART's labels' shift, einsum at one row): no placement, and the error says
    # to give each rank more rows, wherever the rows are.
    for squeeze, rows in ((lambda x: torch.ops.aten.squeeze.dim(x, 0), Shard(0)),
                          (lambda x: torch.ops.aten.squeeze.default(x), Shard(0)),
                          (lambda x: torch.ops.aten.squeeze.dim(x, 3), Shard(3))):
        with pytest.raises(PiperError, match=r"squeezes away dimension \d, the batch's rows, one on this rank.*"
                                             r"has one row on this rank.*with 2 rows or more a rank"):
            _propagate(squeeze, ((1, 2, 9, 1), rows))


def test_indexing_a_batch_by_its_row_numbers_keeps_its_rows():
    # Hugging Face's masks read each row's attention mask at every key position:
    # mask[arange(rows)[:, None, None, None], positions[None, None, None, :]].
    def row_masks(mask, renumber):
        rows = renumber(torch.arange(mask.shape[0])).view(-1, 1, 1, 1)
        return mask[rows, (torch.arange(mask.shape[1]) + 0)[None, None, None, :]]

    in_order = _propagate(lambda mask: row_masks(mask, lambda rows: rows), ((4, 9), Shard(0)))
    assert _specs(in_order, torch.ops.aten.index.Tensor) == [Shard(0)]
    # As Inductor's decompositions number them.
    iota = lambda rows: torch.ops.prims.iota(len(rows), start=0, step=1, dtype=torch.int64,  # noqa: E731
                                             device=rows.device, requires_grad=False)
    decomposed = _propagate(lambda mask: row_masks(mask, iota), ((4, 9), Shard(0)))
    assert _specs(decomposed, torch.ops.aten.index.Tensor) == [Shard(0)]
    # Rows in another order are no longer each rank's own: the rule does not hold.
    reversed_rows = _propagate(lambda mask: row_masks(mask, lambda rows: rows.flip(0)), ((4, 9), Shard(0)))
    assert _specs(reversed_rows, torch.ops.aten.index.Tensor) != [Shard(0)]


def test_dtensor_is_asked_with_every_argument_that_decides_the_placement():
    # The sum over the rows is a partial sum, over the columns this rank's rows: DTensor's
    # own cache keys only the arguments an op's schema info names, so both must be asked as such.
    graph = _propagate(lambda x: (x.sum(1), x.sum(0)), ((4, 6), Shard(0)))
    assert _specs(graph, torch.ops.aten.sum.dim_IntList) == [Shard(0), Partial("sum")]


EFFICIENT = torch.ops.aten._scaled_dot_product_efficient_attention.default
EFFICIENT_BACKWARD = torch.ops.aten._scaled_dot_product_efficient_attention_backward.default


def _efficient_attention(q, k, v):
    # The memory-efficient kernel fp32 attention takes on a GPU; traced here on fake tensors.
    out, logsumexp, seed, offset = EFFICIENT(q, k, v, None, True, 0.0, True)
    return EFFICIENT_BACKWARD(out.clone(), q, k, v, None, out, logsumexp, seed, offset, 0.0,
                              [True, True, True, False], True)


def test_gpu_attention_kernels_bookkeeping_results_are_replicated_as_dtensor_reads_them():
    graph = _propagate(_efficient_attention, (QKV, Shard(0)), (QKV, Shard(0)), (QKV, Shard(0)))
    # DTensor's rule places the output and log-sum-exp and leaves the RNG seed and offset
    # (0-d tensors) unplaced; its backward rule reads them as Replicate().
    assert _specs(graph, EFFICIENT) == [(Shard(0), Shard(0), Replicate(), Replicate())]
    (backward,) = _specs(graph, EFFICIENT_BACKWARD)
    assert backward[:3] == (Shard(0), Shard(0), Shard(0)), backward


CUDNN = torch.ops.aten._scaled_dot_product_cudnn_attention.default
CUDNN_BACKWARD = torch.ops.aten._scaled_dot_product_cudnn_attention_backward.default


def _masked_efficient_attention(q, k, v, mask, mask_gradient=False):
    out, logsumexp, seed, offset = EFFICIENT(q, k, v, mask, True, 0.0, False)
    return EFFICIENT_BACKWARD(out.clone(), q, k, v, mask, out, logsumexp, seed, offset, 0.0,
                              [True, True, True, mask_gradient], False)


def _learned_bias_attention(q, k, v, bias):
    return _masked_efficient_attention(q, k, v, bias, mask_gradient=True)


def _masked_cudnn_attention(q, k, v, mask):
    # The kernel Hugging Face's bf16 attention takes on an H100 or H200 (found there: DTensor's
    # rule for it takes no mask).
    out, logsumexp, cum_q, cum_k, max_q, max_k, seed, offset, _ = CUDNN(q, k, v, mask, True, 0.0, False, False)
    return CUDNN_BACKWARD(out.clone(), q, k, v, out, logsumexp, seed, offset, mask, cum_q, cum_k, max_q, max_k,
                          0.0, False)


@pytest.mark.parametrize("kernels", ["efficient", "cudnn"])
@pytest.mark.parametrize("mask", [((4, 2, 9, 9), Shard(0)), ((4, 1, 9, 9), Replicate()), ((1, 1, 9, 9), Replicate())],
                         ids=["rows", "rows-made-alike", "broadcast"])
def test_the_cuda_attention_kernels_with_a_mask_are_row_wise_in_the_batch(kernels, mask):
    """Hugging Face's attention on a GPU with a mask (padding, or materialized for
    checkpointing): each batch row of the results reads that row of q, k, v and the mask.
    A mask of the batch's rows made alike on every rank is read as this rank's rows; one
    broadcast over the batch is read whole (where DTensor's rule gathered the batch's rows
    for it). Found on an H200, where the step stopped at planning."""
    attention, forward, backward = {"efficient": (lambda q, k, v, mask: _masked_efficient_attention(q, k, v, mask),
                                                  EFFICIENT, EFFICIENT_BACKWARD),
                                    "cudnn": (_masked_cudnn_attention, CUDNN, CUDNN_BACKWARD)}[kernels]
    graph = _propagate(attention, (QKV, Shard(0)), (QKV, Shard(0)), (QKV, Shard(0)), mask)
    (forward_spec,), (backward_spec,) = _specs(graph, forward), _specs(graph, backward)
    assert forward_spec[:2] == (Shard(0), Shard(0)) and backward_spec[:3] == (Shard(0),) * 3
    assert Replicate() in forward_spec  # the RNG seed and offset
    reads = {n.target: n.meta.get(READS_KEY) for n in graph.nodes if n.target in (forward, backward)}
    made_alike = mask[1] == Replicate() and mask[0][0] == 4
    assert all(read == ((("mask_1", Shard(0)),) if made_alike else None) for read in reads.values()), reads


def test_the_gradient_of_a_mask_every_row_reads_alike_is_not_one_rows():
    """A learned bias broadcast over the batch: its gradient sums every row's part, which the
    rule of the rows does not place; DTensor's rule computes it on the batch's rows gathered."""
    graph = _propagate(_learned_bias_attention, (QKV, Shard(0)), (QKV, Shard(0)), (QKV, Shard(0)),
                       ((1, 1, 9, 9), Replicate()))
    (backward,) = (n for n in graph.nodes if n.target == EFFICIENT_BACKWARD)
    assert backward.meta[SPEC_KEY] == (Replicate(),) * 4
    assert ("q_1", Replicate()) in backward.meta[READS_KEY]
    graph = _propagate(_learned_bias_attention, (QKV, Shard(0)), (QKV, Shard(0)), (QKV, Shard(0)),
                       ((4, 2, 9, 9), Shard(0)))
    assert _specs(graph, EFFICIENT_BACKWARD) == [(Shard(0),) * 4]


def test_layer_norm_statistics_are_row_wise_unless_they_reduce_over_the_rows():
    graph = _propagate(lambda x: torch.var_mean(x, dim=-1, keepdim=True, correction=0), ((4, 9, 8), Shard(0)))
    assert _specs(graph, torch.ops.aten.var_mean.correction) == [(Shard(0), Shard(0))]
    # Over the rows, no rank has a row's statistics: not Shard(0) (DTensor's rule, from torch
    # 2.13, reads the input whole; earlier, nothing places it).
    try:
        graph = _propagate(lambda x: torch.var_mean(x, dim=0, correction=0), ((4, 8), Shard(0)))
    except PiperError as e:
        assert "var_mean" in str(e) and TORCH_VERSION < (2, 13), e
    else:
        (spec,) = _specs(graph, torch.ops.aten.var_mean.correction)
        assert Shard(0) not in spec, spec


@pytest.mark.parametrize("placement", [Shard(0), Shard(1), Partial("sum")])
def test_piper_fx_rules_for_ops_earlier_dtensor_lacks_answer_as_dtensor_does(placement):
    # var_mean and prims.convert_element_type: torch 2.11's DTensor has no rule for them
    # (Inductor's decompositions write a layer norm's statistics and `.to(dtype)` so).
    from piper_fx.sharding import op_rules, specs
    from piper_fx.sharding.dtensor_rules import dtensor_answer

    def statistics_and_conversion(x):
        var, mean = torch.ops.aten.var_mean.correction(x, [-1], correction=0, keepdim=True)
        return var, torch.ops.prims.convert_element_type.default(x, torch.float64)

    gm = make_fx(statistics_and_conversion, tracing_mode="fake")(torch.randn(4, 6, 8))
    (x,) = [n for n in gm.graph.nodes if n.op == "placeholder"]
    propagate(gm.graph, {x.name: placement}, planning_mesh(2))
    ruled = [node for node in gm.graph.nodes if node.target in op_rules.RULES]
    assert len(ruled) == 2, gm.graph
    for node in ruled:
        try:
            ours = op_rules.RULES[node.target](node, [(x, placement)])
        except specs.NoRule:
            ours = None
        if TORCH_VERSION >= (2, 13):  # DTensor's own answer, where it has one, is ours
            spec, reads = dtensor_answer(planning_mesh(2), node)
            assert ours is None or (ours[0], [(a.name, p) for a, p in ours[1]]) == (
                spec, [(a.name, p) for a, p in reads]), (node.target, ours, spec, reads)
        if ours is not None:
            assert node.meta[SPEC_KEY] == ours[0]


def _layouts():
    """A tensor of one row (dim 0, as a rank's microbatch of one row is) in any layout: its
    dimensions in any order in memory, some broadcast (stride 0), as `expand` and `transpose`
    make them."""
    from hypothesis import strategies as st

    @st.composite
    def layout(draw):
        ndim = draw(st.integers(2, 4))
        shape = [1] + [draw(st.integers(1, 3)) for _ in range(ndim - 1)]
        order = draw(st.permutations(range(ndim)))  # innermost first
        stride, step = [0] * ndim, 1
        for d in order:
            stride[d], step = step, step * shape[d]
        for d in range(1, ndim):
            if draw(st.booleans()) and draw(st.booleans()):
                stride[d] = 0  # broadcast
        return shape, stride
    return layout()


def test_the_global_tensor_of_one_row_folds_wherever_the_row_does():
    """`dtensor_rules._meta`: DTensor is asked about the global tensor of a rank's rows, whose
    strides piper_fx makes up. A view that folds two neighbouring dimensions of a rank's one
    row (as `view`s traced with one row a microbatch do: matmul's decomposition folding the
    batch with the heads) must fold the made-up global tensor too: else DTensor's propagator
    fails on a view the program runs (Falcon and Gemma 2 under ZBV, keys of one row expanded
    over the heads; before, broadcast dimensions were ordered outer-last)."""
    from hypothesis import given, settings

    from piper_fx.sharding.dtensor_rules import _meta

    @settings(max_examples=300, deadline=None)
    @given(_layouts())
    def check(layout):
        shape, stride = layout
        row = torch.empty_strided(shape, stride)
        meta = _meta(row, Shard(0), 2)
        assert list(meta.shape) == [2] + shape[1:]
        try:  # the batch's dimension folded with the next
            row.view([shape[0] * shape[1]] + shape[2:])
        except RuntimeError:
            return
        torch.empty_strided(meta.shape, meta.stride).view([meta.shape[0] * meta.shape[1]] + shape[2:])
    check()
