"""Generated strategies (hypothesis): a legal one trains exactly like single-process
training, an illegal one is a `PiperConfigError` on every rank before anything runs.

The space: pp in {1, 2, 4}, dp in {1, 2} (world <= 4), ep where the model has
experts (and sometimes where it has none), zero 0..3, every schedule with
legal and illegal microbatches and stages_per_rank, bucket_mb, overlap,
prefetch, activation checkpointing (none, full, selective), SGD or AdamW, the
model built as usual or on the meta device (materialized after `prepare`), two
of its parameters frozen or none;
models: an MLP whose first layer's output crosses every stage boundary, the
example GPT with tied embeddings, and its MoE version. CI runs a fixed-seed profile of 25 examples; set
`PIPER_STRATEGY_EXAMPLES=N` for a longer, randomly seeded search (with
shrinking of a failing case).
"""
import os
import re

import torch
from hypothesis import HealthCheck, Phase, given, settings

from ranks import run_ranks
from strategy_space import Case, cases, check_outcomes, train_case
from training import (ddp_buffers_worker, frozen_worker, local_rows_worker, pipeline_evaluation_worker,
                      pipeline_worker, recurrent_worker, sync_batch_norm_worker)

EXAMPLES = int(os.environ.get("PIPER_STRATEGY_EXAMPLES", "0"))
PROFILE = settings(
    max_examples=EXAMPLES or 25,
    derandomize=not EXAMPLES,               # CI: the same 25 cases every run
    database=None,
    deadline=None,
    # Each case trains on real ranks for seconds: CI reports a failing case as drawn, a long run shrinks it.
    phases=(Phase.generate, Phase.shrink) if EXAMPLES else (Phase.generate,),
    suppress_health_check=(HealthCheck.too_slow,),
)


@PROFILE
@given(case=cases())
def test_generated_strategies_train_like_one_process_or_are_config_errors(rank_pools, case):
    print(case.label())
    check_outcomes(case, rank_pools(case.world).run(train_case, case, deadline_s=400))


def test_a_value_sent_to_several_ranks_is_let_go_per_peer(rank_pools):
    """Found by the search: the MLP's first output, sent to every later stage's rank under one
    tag (a transfer's tag is a pair of ranks' own), was let go, and its send to every rank
    waited for, once the first peer had answered. Under gloo that send waits for the other
    peers' receives, which waited for this rank: the step hung until gloo's timeout. A send
    is now let go when its own peer answers (`RankProgram.acknowledged_by`, by peer)."""
    case = Case(model="mlp", pp=4, dp=1, zero=0, schedule="zbv", microbatches=5, overlap=False, prefetch=0,
                optimizer="sgd")
    check_outcomes(case, rank_pools(case.world).run(train_case, case, deadline_s=120))


def test_parameters_frozen_before_prepare_stay_as_they_are_while_the_rest_train(rank_pools):
    """Found probing Hugging Face models (ERNIE 4.5's mixture of experts keeps its router's
    score correction in a parameter with `requires_grad=False`): `prepare` of a model with a
    frozen parameter raised under every data-parallel strategy ("cannot register a hook on a
    tensor that doesn't require gradient"), registering on the parameter's program placeholder
    the hook that catches another backend training it. As under DDP and FSDP2, a frozen
    parameter is laid out like the others and neither gets a gradient nor is stepped."""
    one_f_one_b = {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    for options in ({"zero": 0}, {"zero": 3}, {"zero": 3, "codegen": "inductor"}, one_f_one_b):
        results = rank_pools(2).run(frozen_worker, {"codegen": "eager", **options}, "pipeline" in options)
        for rank, outcome in enumerate(results):
            assert "error" not in outcome, (options, rank, outcome.get("error"))
            result = outcome["value"]
            assert result["frozen"] == ["blocks.1.ln_1.weight", "wte.weight"], result["frozen"]
            assert not set(result["frozen"]) & set(result["params_with_state"]), (options, rank)
            assert max(result["loss_errors"]) < 1e-5 and max(result["param_errors"].values()) < 1e-5, (options, rank)


def test_a_parameter_the_loss_does_not_read_trains_as_one_process(rank_pools):
    """Found probing Hugging Face's FNet, whose masked language model has a pooler its loss
    never reads: the step took a parameter whose gradient it does not compute for one that does
    not require grad, and refused every call over replicas ("has requires_grad=True, but this
    step was compiled for requires_grad=False"). It checks the `requires_grad` the parameter
    had when the step was compiled."""
    configs = [{"options": options, "model": "unused_pooler", "per_rank_batch": 4}
               for options in ({"zero": 0}, {"zero": 3})]
    for rank, outcome in enumerate(rank_pools(2).run(pipeline_worker, configs)):
        assert "error" not in outcome, (rank, outcome.get("error"))
        for config, result in zip(configs, outcome["value"]):
            assert max(result["loss_errors"]) < 1e-5 and max(result["param_errors"].values()) < 1e-5, \
                (config, rank, result["loss_errors"], result["param_errors"])


def test_pytorchs_own_layers_train_like_one_process(rank_pools):
    """Found probing models unlike ours; each stopped planning, naming an op:
    - `nn.TransformerEncoderLayer` and `nn.GRU` fold the batch's rows inside the tokens (or
      steps) for a matmul, a strided shard, and unfold them again: DTensor's view rule, given
      the batch's rows where they had been, misplaced the unfolded value. The rows are now
      looked for after the strided shard's leading elements first (`_global_attempts`).
    - Weight norm's backward, `nn.EmbeddingBag`, `nn.Bilinear`, a bilinear interpolation's
      indexing, and `nn.Unfold` and `nn.Fold` (ConvBERT's) had no rule (`op_rules`).
    - Every op planned as over 2 replicas, for a pipeline alone (dp = 1) too. There every
      placement holds a value whole, so an op no rule places (a custom op of the model's) is
      `Replicate()`; over 2 replicas it is refused, naming the op, not guessed.
    Each trains at ZeRO-0 and ZeRO-3 and under 1F1B."""
    one_f_one_b = {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    strategies = [{"zero": 0}, {"zero": 3}, one_f_one_b]
    configs = [{"options": options, "model": model, "per_rank_batch": 4}
               for model in ("torch_encoder", "weight_normed", "bagged", "bilinear_image", "unfolded")
               for options in strategies]
    configs.append({"options": one_f_one_b, "model": "custom_op", "per_rank_batch": 4})
    recurrent = [{"options": options, "model": "recurrent", "per_rank_batch": 4} for options in strategies]
    for worker, cases in ((pipeline_worker, configs), (recurrent_worker, recurrent)):
        for rank, outcome in enumerate(rank_pools(2).run(worker, cases)):
            assert "error" not in outcome, (rank, outcome.get("error"))
            for config, result in zip(cases, outcome["value"]):
                assert max(result["loss_errors"]) < 1e-5 and max(result["param_errors"].values()) < 1e-5, \
                    (config, rank, result["loss_errors"], result["param_errors"])
    for outcome in rank_pools(2).run(pipeline_worker, [{"options": {"zero": 0}, "model": "custom_op"}]):
        assert re.search(r"PiperError: piper_fx cannot place node doubled = piper_tests.doubled.default",
                         outcome.get("error", "")), outcome


def _trains_as_one_process(rank_pools, cases: list, same_buffers: bool = False) -> None:
    """Each case (world, options, model of `local_rows_worker`) within 1e-5 of its reference, on
    every rank; with `same_buffers`, the model holding the buffer objects it started with."""
    for world, options, model in cases:
        for rank, outcome in enumerate(rank_pools(world).run(local_rows_worker, options, model)):
            assert "error" not in outcome, (options, model, rank, outcome.get("error"))
            result = outcome["value"]
            assert result["same_buffers"] or not same_buffers, (options, model, rank)
            assert max(result["loss_errors"]) < 1e-5, (options, model, rank, result)
            assert max(result["errors"].values()) < 1e-5, (options, model, rank, result["errors"])


def test_buffers_the_forward_mutates_take_their_new_values(rank_pools):
    """Found checking BatchNorm: the program returned the running statistics' new values and the
    step dropped them (kept per microbatch, looked up per step), so the statistics stayed as
    initialized while training went on, silently. Each rank now takes its own, as under FSDP2
    (and DDP without broadcast_buffers)."""
    _trains_as_one_process(rank_pools, [
        (1, {"codegen": "eager"}, "batch_norm"), (1, {"codegen": "inductor"}, "batch_norm"),
        (2, {"codegen": "eager", "zero": 0}, "batch_norm"), (2, {"codegen": "eager", "zero": 3}, "batch_norm")])
    # A convolutional network under Inductor: its group norm's statistics reshaped by `as_strided`
    # and its max pooling as prims of Inductor's decompositions had no placement (`op_rules`), and
    # Inductor made the forward's convolution outputs channels-last where the backward, compiled
    # apart, read them contiguous (the layout optimization is off for piper_fx's tasks).
    # Under a zero-bubble schedule (group norms only), the max pool's offsets, which only the
    # weights' backward reads, crossed from I to W as the pool's tuple, which Inductor cannot
    # return (`split_backward`); and the stages cut by cost
    # split a group norm's decomposition, whose one backward left the first part's stage none
    # (no I or W task for the schedule's actions, `split_stages`).
    zbv = {"mesh": {"pp": 2}, "pipeline": {"schedule": "zbv", "microbatches": 2}, "codegen": "inductor"}
    _trains_as_one_process(rank_pools, [(2, {"zero": 2, "codegen": "inductor"}, "conv"), (2, zbv, "conv_group_norm")])


def test_broadcast_buffers_gives_every_replica_the_first_ones_buffers_as_ddp():
    """`broadcast_buffers=True`, DDP's default: a call starts from the first replica's buffers
    where the model's previous call trained with synchronization on, as DDP decides it; without
    it each replica keeps its own, as DDP with `broadcast_buffers=False` and FSDP2. Both equal
    DDP's on every rank: losses, running statistics, and an eval call's loss, which reads them."""
    runs = [{"codegen": "eager", "broadcast_buffers": True}, {"codegen": "eager"}]
    for rank, outcome in enumerate(run_ranks(ddp_buffers_worker, 2, runs, deadline_s=300)):
        for options, run in zip(runs, outcome):
            # Before the first call, the window's first and the evaluation; not after the window's first.
            # The buffers each call reads: a batch norm's 8 means and 8 variances, and in training its
            # count (int64).
            expected = [72, 72, 0, 64] if options.get("broadcast_buffers") else [0] * 4
            assert run["broadcast_bytes"] == expected, (options, rank, run["broadcast_bytes"])
            torch.testing.assert_close(run["losses"]["piper"], run["losses"]["ddp"], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{options} rank {rank}: {m}")
            torch.testing.assert_close(run["buffers"]["piper"], run["buffers"]["ddp"], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{options} rank {rank}: {m}")
        # The second replica's statistics: rank 0's before each synchronizing call, or its own.
        broadcast, own = outcome[0]["buffers"]["ddp"], outcome[1]["buffers"]["ddp"]
        differ = not torch.allclose(broadcast["norm1.running_mean"], own["norm1.running_mean"])
        assert differ == (rank == 1), (rank, broadcast, own)


def test_sync_batch_norm_normalizes_by_every_replicas_rows_as_one_process():
    """`nn.SyncBatchNorm` (`convert_sync_batchnorm`) trains as one process's `BatchNorm2d` on the
    global batch, microbatch by microbatch, running statistics and an evaluation included. Found
    probing PyTorch's layers: Dynamo gave up on its forward (its eager collectives), compiled a
    parameter's read on its own, and piper_fx refused that as a graph without a loss, naming no
    cause (eager PyTorch refuses it on a CPU)."""
    pipeline = {"mesh": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}, "codegen": "eager"}
    for world, options in ((2, {"codegen": "eager", "zero": 3, "pipeline": {"microbatches": 2}}), (4, pipeline)):
        for rank, run in enumerate(run_ranks(sync_batch_norm_worker, world, options, deadline_s=300)):
            assert max(run["loss_errors"]) < 1e-5, (options, rank, run["loss_errors"])
            worst = max(run["errors"], key=run["errors"].get)
            assert run["errors"][worst] < 1e-5, (options, rank, worst, run["errors"][worst])


def test_an_evaluation_under_a_pipeline_cut_by_cost_is_cut_as_training_was():
    """Found with `nn.SyncBatchNorm`: a graph without a backward (`torch.no_grad()`) could not be
    cut into the stages its training graph was cut into by cost (the ConvNet's); autograd numbers
    none of its ops, which all then seemed parts of one op's decomposition, not to be cut."""
    options = {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}, "codegen": "eager"}
    for rank, (loss, expected) in enumerate(run_ranks(pipeline_evaluation_worker, 2, options, deadline_s=300)):
        assert abs(loss - expected) <= 1e-6 * abs(expected), (rank, loss, expected)


def test_buffers_the_forward_mutates_are_updated_microbatch_by_microbatch(rank_pools):
    """Each microbatch's forward updates the running statistics from those the one before left,
    as eager PyTorch run microbatch by microbatch (gradient accumulation) and the stages of
    torch.distributed.pipelining do; the rank whose stage updates them holds them, and the
    other pipeline ranks let go of them (`full_state_dict` fetches them from it, on every
    rank). Refused before: each forward started from the step's value, and the other stages'
    ranks would keep the old ones. A batch norm is no longer recomputed in the backward, where
    it would read the updated statistics (`checkpoint_activations`), so the one-microbatch
    case above checks that too."""
    def pipeline(schedule: str, microbatches: int, **options) -> dict:
        return {"mesh": {"pp": 2}, "pipeline": {"schedule": schedule, "microbatches": microbatches}, **options}
    cases = [(1, {"codegen": "eager", "pipeline": {"microbatches": 2}}, "batch_norm"),
             (1, {"codegen": "inductor", "pipeline": {"microbatches": 2}}, "batch_norm"),
             (2, {"codegen": "eager", "zero": 3, "pipeline": {"microbatches": 2}}, "batch_norm"),
             (2, pipeline("gpipe", 2, codegen="eager"), "batch_norm"),
             (2, pipeline("1f1b", 4, codegen="inductor", activation_checkpointing={"mode": "full"}), "conv"),
             (2, pipeline("zbv", 2, codegen="eager"), "conv"),
             (2, pipeline("dualpipev", 4, codegen="eager"), "conv"),
             (4, {"mesh": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 2},
                  "codegen": "eager"}, "conv")]
    _trains_as_one_process(rank_pools, cases)
    # DualPipe runs every stage on two ranks, which would each update the statistics from their
    # own microbatches: refused on every rank, naming the buffer.
    dualpipe = pipeline("dualpipe", 4, codegen="eager")
    for outcome in rank_pools(2).run(local_rows_worker, dualpipe, "conv"):
        assert "buffer norm1.num_batches_tracked in place" in outcome.get("error", "") \
            and "on pipeline ranks 0, 1" in outcome["error"], outcome


def test_buffers_an_out_op_writes_stay_the_modules(rank_pools):
    """Found probing PyTorch's layers: spectral norm's power iteration writes its `_u` and `_v`
    buffers with out= ops and sets them on its module again (`self._u = F.normalize(...,
    out=self._u)`), and Dynamo's graph returns them for its code to set. The step returned None
    there, the modules' buffers became None, and the next call broke Dynamo's graph (refused as
    a graph break). The step now returns the buffer itself (`outputs.return_arguments_themselves`),
    updated in place: each module keeps the buffers it has, and trains as one process does,
    microbatch by microbatch in a pipeline."""
    cases = [(1, {"codegen": "inductor"}), (2, {"codegen": "eager", "zero": 3}),
             (2, {"codegen": "eager", "zero": 1, "pipeline": {"microbatches": 2}}),
             (2, {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}, "codegen": "eager"})]
    _trains_as_one_process(rank_pools, [(world, options, "spectral_norm") for world, options in cases],
                           same_buffers=True)


def test_a_loss_that_mixes_rows_is_each_replicas_as_under_ddp(rank_pools):
    """A loss that mixes the batch's rows (CLIP's, each row against every other) is each
    replica's over its own rows, and each microbatch's over its own, as under DDP, FSDP2,
    gradient accumulation and torch.distributed.pipelining: not the loss of the global batch,
    which none of them computes either."""
    cases = [(2, {"codegen": "eager", "zero": 3, "pipeline": {"microbatches": 2}}),
             (2, {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}, "codegen": "eager"})]
    _trains_as_one_process(rank_pools, [(world, options, "contrastive") for world, options in cases])


def test_a_value_made_before_a_graph_break_keeps_the_batchs_symbolic_size(rank_pools):
    """Found with ProphetNet, which shifts its decoder's inputs and asserts on them with
    `.item()` before its layers: the graph after the break took the shifted values at the
    first call's fixed size, and with microbatches it could not be traced at a microbatch's
    (refused, asking to mark the batch dynamic, which `prepare` had: on the module's arguments).
    The graph before the break, which reads no parameter and runs whole, now marks the sizes
    Dynamo made symbolic in what it returns dynamic, as `prepare` marks its arguments'."""
    cases = [(2, {"codegen": "eager", "zero": 3, "pipeline": {"microbatches": 2}}),
             (2, {"mesh": {"pp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}, "codegen": "inductor"})]
    _trains_as_one_process(rank_pools, [(world, options, "checks_targets") for world, options in cases])
