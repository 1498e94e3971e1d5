"""Mixed precision with FSDP2's `MixedPrecisionPolicy` semantics (option `mixed_precision`).

piper_fx has Dynamo trace the model with its parameters in `param_dtype`
(`prepare`), traces the policy's casts into the program (`capture`), gathers
parameters in `param_dtype` (`unshard_parameters`) and reduces gradients in
`reduce_dtype` (`reduce_gradients`), keeping fp32 parameters and optimizer
state. Each case of the example GPT trains it 10 steps with piper_fx, with FSDP2
`fully_shard` per block and at the root under the same policy, and in one
process reading its parameters cast to `param_dtype`, on the same global
batches (real gloo ranks, eager codegen); the Hugging Face cases train 3 steps
against FSDP2 `fully_shard` per layer and at the root.

The bounds:
- FSDP2: parameters exactly equal. Both run the same ATen ops in bf16 on the
  same rows of the batch (a pipeline's microbatch holds the rows one FSDP2
  rank holds), gather bf16 copies of the same fp32 shards (a cast commutes
  with the gather), and average gradients in `reduce_dtype` over the same
  ranks (a microbatch's gradient is seeded with 1/M, a power of two here,
  which scales exactly; a tied weight's reads' gradients are summed in bf16
  first, as FSDP2's unsharded parameter accumulates them). Losses are equal
  too, except that with microbatches piper_fx returns their mean rounded to
  bf16.
- One process: its loss is the mean over the whole batch, computed in bf16,
  where the ranks' are means over their rows, so every gradient differs by
  bf16 rounding (relative 2^-8 per op). With SGD (whose update is linear in
  the gradient) the parameters after 10 steps differ by at most 5% of how far
  training moved them (measured: under 3%), and each loss by at most 4 bf16
  ulps (2^-6 each near 3.6; measured: 2.5).
"""
from __future__ import annotations

import copy

import pytest
import torch

import piper_fx
from mixed_precision_workers import autocast_worker, hf_mixed_precision_worker, mixed_precision_worker
from piper_fx import PiperConfigError
from ranks import run_ranks

BF16_FP32 = {"param_dtype": "bfloat16", "reduce_dtype": "float32"}
PIPELINE = {"mesh": {"pp": 2, "dp": 2}, "zero": 3, "pipeline": {"schedule": "1f1b", "microbatches": 2}}


def _train(world: int, options: dict, optimizer: str, pp_regions: bool = False, tied: bool = False,
           steps: int = 10, accumulate: int = 1) -> dict:
    return run_ranks(mixed_precision_worker, world, {"codegen": "eager", **options}, optimizer, steps, 2, pp_regions,
                     tied, accumulate, deadline_s=400)[0]


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in b)


def _check_losses_equal_fsdp2s(result: dict, microbatches: int) -> None:
    """Equal; with microbatches, up to the rounding of their mean to the bf16 loss piper_fx
    returns (half an ulp, 2^-7 near 3.6), where FSDP2's ranks' means are averaged in fp32."""
    bound = 0.0 if microbatches == 1 else 2.0 ** -7
    for piper_loss, fsdp_loss in zip(result["losses"]["piper"], result["losses"]["fsdp2"]):
        assert abs(piper_loss - fsdp_loss) <= bound


def _check_single_process_bound(result: dict) -> None:
    bf16_ulp_at_loss = 2.0 ** -6
    for piper_loss, single_loss in zip(result["losses"]["piper"], result["losses"]["single"]):
        assert abs(piper_loss - single_loss) <= 4 * bf16_ulp_at_loss
    for name, single in result["single"].items():
        moved = (single - result["initial"][name]).abs().max().item()
        assert (result["piper"][name] - single).abs().max().item() <= 0.05 * moved, name


@pytest.mark.parametrize("options", [{"mesh": {"dp": 2}, "zero": 3}, PIPELINE], ids=["dp2-zero3", "pp2xdp2-1f1b"])
def test_bf16_equals_fsdp2_exactly_and_single_process_within_bf16_rounding(options):
    result = _train(4 if "pipeline" in options else 2, {**options, "mixed_precision": BF16_FP32}, "sgd",
                    pp_regions="pipeline" in options)
    assert result["loss_dtypes"] == ["torch.bfloat16"] * 3
    assert result["param_dtypes"] == ["torch.float32"]  # master weights stay fp32
    _check_losses_equal_fsdp2s(result, options.get("pipeline", {}).get("microbatches", 1))
    assert _max_difference(result["piper"], result["fsdp2"]) == 0.0
    _check_single_process_bound(result)
    # Parameters are gathered in bf16 (half the bytes), gradients reduced in fp32 (the same).
    fp32, bf16 = result["fp32_comm_bytes"], result["comm_bytes"]
    assert bf16["all_gather"] * 2 == fp32["all_gather"] > 0
    assert bf16["reduce_scatter"] == fp32["reduce_scatter"] > 0


def test_a_zero_bubble_v_schedule_in_bf16_equals_fsdp2_exactly():
    """ZBV: two stages per rank, the backward split into input and weight gradients."""
    options = {"mesh": {"pp": 2}, "pipeline": {"schedule": "zbv", "microbatches": 2}, "mixed_precision": BF16_FP32}
    result = _train(2, options, "adamw")
    _check_losses_equal_fsdp2s(result, microbatches=2)
    assert _max_difference(result["piper"], result["fsdp2"]) == 0.0


@pytest.mark.parametrize("zero,reduce_dtype", [(0, "float32"), (1, None), (2, "float32"), (3, None)])
def test_every_zero_level_with_adamw_equals_fsdp2_exactly(zero, reduce_dtype):
    """AdamW (fp32 state) and both reduction dtypes: without `reduce_dtype`, gradients
    are reduced in `param_dtype`, as FSDP2 does."""
    policy = {"param_dtype": "bfloat16", "reduce_dtype": reduce_dtype}
    result = _train(2, {"mesh": {"dp": 2}, "zero": zero, "mixed_precision": policy}, "adamw")
    assert result["losses"]["piper"] == result["losses"]["fsdp2"]
    assert _max_difference(result["piper"], result["fsdp2"]) == 0.0
    reduction = "all_reduce" if zero <= 1 else "reduce_scatter"
    shrink = 1 if reduce_dtype == "float32" else 2
    assert result["comm_bytes"][reduction] * shrink == result["fp32_comm_bytes"][reduction] > 0
    if zero:
        assert result["comm_bytes"]["all_gather"] * 2 == result["fp32_comm_bytes"]["all_gather"]


@pytest.mark.parametrize("zero", [1, 3])
def test_a_tied_weight_is_reduced_once_on_its_reads_gradients_summed_in_param_dtype(zero):
    """The GPT's head tied to its embedding: a weight with a marker per read. Its reads'
    gradients are summed in bf16 and reduced once, as FSDP2 accumulates its unsharded
    parameter's gradient: equal to FSDP2 bit for bit (before, each read's gradient was reduced
    on its own and the two summed in fp32: parameters up to 0.09 apart after 10 AdamW steps),
    and each parameter's gradient is reduced once."""
    result = _train(2, {"mesh": {"dp": 2}, "zero": zero, "mixed_precision": BF16_FP32}, "adamw", tied=True)
    assert result["losses"]["piper"] == result["losses"]["fsdp2"]
    assert _max_difference(result["piper"], result["fsdp2"]) == 0.0
    if zero == 1:  # one fp32 all-reduce of every parameter's whole gradient
        assert result["comm_bytes"]["all_reduce"] == 4 * result["numel"]


@pytest.mark.parametrize("zero", [1, 3])
def test_accumulating_without_synchronization_in_bf16_equals_fsdp2_exactly(zero):
    """Four calls a step, the first three in `piper_fx.no_sync` and FSDP2's with
    `set_requires_gradient_sync(False)`, reduced in bf16: the window holds each gradient
    summed in bf16, as FSDP2's unsharded parameter accumulates it (held in fp32 and rounded
    once, parameters were 0.03 apart from FSDP2's after 4 AdamW steps)."""
    result = _train(2, {"mesh": {"dp": 2}, "zero": zero, "mixed_precision": {"param_dtype": "bfloat16"}}, "adamw",
                    tied=True, steps=3, accumulate=4)
    assert result["losses"]["piper"] == result["losses"]["fsdp2"]
    assert _max_difference(result["piper"], result["fsdp2"]) == 0.0


ONE_F_ONE_B = {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
# Models that choose dtypes by reading them: Llama's and Qwen2's RMSNorm return
# `weight * x.to(input_dtype)` and cast their rotary tables to the activations' dtype. Under a
# pipeline alone (dp = 1) the parameters are plain tensors; Qwen2's head is tied to its embedding,
# and so is Gemma's, read by two gathers under ZeRO-3 whose gradients are summed in bf16.
# Mixtral routes its tokens to experts (transformers' grouped matmul) with its router's softmax
# in fp32, and Qwen3-Next's linear attention casts its query, key and value to fp32 for its gated
# delta rule.
HF_EXACT = {"llama-zero3": ("llama", {"mesh": {"dp": 2}, "zero": 3}), "qwen2-1f1b": ("qwen2", ONE_F_ONE_B),
            "gemma-zero3": ("gemma", {"mesh": {"dp": 2}, "zero": 3}),
            "mixtral-zero3": ("mixtral", {"mesh": {"dp": 2}, "zero": 3}),
            "qwen3_next-zero3": ("qwen3_next", {"mesh": {"dp": 2}, "zero": 3})}


@pytest.mark.parametrize("case", HF_EXACT)
def test_a_hugging_face_model_reading_its_dtypes_trains_in_bf16_as_fsdp2_does(case):
    """Dynamo traces the model with its parameters in `param_dtype`, as FSDP2 runs it, so the
    dtypes the model reads are bf16, and piper_fx equals FSDP2 bit for bit (before, the
    choices were traced in fp32 and the step stopped at a matmul of mixed dtypes)."""
    name, options = HF_EXACT[case]
    result = run_ranks(hf_mixed_precision_worker, 2, name, {"codegen": "eager", **options,
                                                           "mixed_precision": BF16_FP32}, deadline_s=300)[0]
    assert result["losses"]["piper"] == result["losses"]["fsdp2"]
    assert _max_difference(result["piper"], result["fsdp2"]) == 0.0


def test_t5_in_bf16_stays_within_bf16_rounding_of_fsdp2():
    """T5 casts its attention mask to the query's dtype, and shares one embedding between its
    encoder, its decoder and its head. Not bit for bit: FSDP2's hooks at each block's inputs
    sum the gradients of a value used by several blocks (the encoder's output, the position
    bias) block by block, where piper_fx's graph sums them as one process does. After 3 SGD
    steps every parameter is within 2 bf16 ulps (at its largest value) of FSDP2's (measured:
    0.93), and the losses (bf16, T5 computes its loss in the logits' dtype) are equal."""
    options = {"codegen": "eager", "mesh": {"dp": 2}, "zero": 3, "mixed_precision": BF16_FP32}
    result = run_ranks(hf_mixed_precision_worker, 2, "t5", options, "sgd", deadline_s=300)[0]
    assert result["losses"]["piper"] == result["losses"]["fsdp2"]
    for name, fsdp in result["fsdp2"].items():
        bf16_ulp = 2.0 ** -8 * fsdp.abs().max().item()
        assert (result["piper"][name] - fsdp).abs().max().item() <= 2 * bf16_ulp, name


def test_one_process_traces_a_prepared_model_in_param_dtype():
    """At world size 1 the parameters are plain tensors, traced through program placeholders in
    `param_dtype`: the step equals the model run with its parameters cast, bit for bit."""
    from torch.func import functional_call

    from training import llama_batch, tiny_llama

    torch.manual_seed(0)
    model = tiny_llama()
    reference = copy.deepcopy(model)
    options = {"codegen": "eager", "mixed_precision": BF16_FP32}
    piper_fx.prepare(model, options)
    step = torch.compile(lambda x, y: model(input_ids=x, labels=y).loss, backend="piper", options=options)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, reference)]
    for i in range(3):
        x, y = llama_batch(i, 4)
        loss = step(x, y)
        cast = {name: p.to(torch.bfloat16) for name, p in reference.named_parameters()}
        expected = functional_call(reference, cast, (), {"input_ids": x, "labels": y}).loss
        assert loss.item() == expected.item()
        for value, optimizer in zip((loss, expected), optimizers):
            value.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)


def test_compiling_with_another_param_dtype_than_prepare_laid_out_is_an_error():
    """`prepare` lays out the dtype Dynamo traces the parameters in; compiling with options
    whose `param_dtype` differs would trace the model's dtype choices in the wrong one."""
    def compile_and_call(model, options):
        step = torch.compile(lambda x: model(x).sum(), backend="piper", options={"codegen": "eager", **options})
        step(torch.randn(3, 4))

    mixed = {"mixed_precision": BF16_FP32}
    with pytest.raises(PiperConfigError, match="call piper_fx.prepare") as info:
        compile_and_call(torch.nn.Linear(4, 2), mixed)
    assert info.value.key == "mixed_precision.param_dtype"
    prepared = piper_fx.prepare(torch.nn.Linear(4, 2), mixed)
    with pytest.raises(PiperConfigError, match="the param_dtype the model was prepared with"):
        compile_and_call(prepared, {})
    with pytest.raises(PiperConfigError, match="already prepared"):
        piper_fx.prepare(prepared, {})
    compile_and_call(prepared, mixed)


def test_training_under_autocast_equals_ddp_and_one_process_under_autocast():
    """`torch.autocast` around the step, as DDP users train in bf16: the ops autocast lists run
    in bf16 inside the compiled step, as in the eager model. Against DDP under autocast (data
    parallel, ZeRO-3) or one process under autocast stepping the same microbatches (1F1B, ZBV):
    losses and parameters after 3 AdamW steps equal to fp32 rounding (measured: equal). A call
    outside autocast afterwards compiles again (the plan is keyed by autocast's state) and runs
    in fp32."""
    dp_configs = [{"codegen": "eager", "zero": 0}, {"codegen": "eager", "zero": 3}]
    pp_configs = [{"codegen": "eager", "mesh": {"pp": 2}, "pipeline": {"schedule": schedule, "microbatches": 2}}
                  for schedule in ("1f1b", "zbv")]
    for rank_results in run_ranks(autocast_worker, 2, dp_configs + pp_configs, deadline_s=400):
        for options, result in zip(dp_configs + pp_configs, rank_results):
            piper, reference = result["piper"], result["reference"]
            # Autocast changes the first loss (by about 4e-5 here), well above the bound below.
            assert abs(reference[0] - result["fp32_first_loss"]) > 1e-5, options
            assert max(abs(a - b) for a, b in zip(piper, reference)) <= 1e-6, (options, piper, reference)
            assert result["param_error"] <= 1e-6, options
