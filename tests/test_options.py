"""Every bad option is a PiperConfigError naming the key, before anything runs."""
import os
from unittest import mock

import pytest
import torch

import piper_fx
from piper_fx import PiperConfigError, parse_options
from ranks import RankFailed, run_ranks, run_ranks_collect


@pytest.mark.parametrize("options, key", [
    ({"zeroo": 1}, "zeroo"),
    ({"zero": 4}, "zero"),
    ({"zero": "1"}, "zero"),
    ({"zero": True}, "zero"),
    ({"codegen": "triton"}, "codegen"),
    ({"bucket_mb": 0}, "bucket_mb"),
    ({"bucket_mb": "25"}, "bucket_mb"),
    ({"overlap": "yes"}, "overlap"),
    ({"broadcast_buffers": 1}, "broadcast_buffers"),
    ({"profile": 1}, "profile"),
    ({"regions": 1}, "regions"),
    ({"regions": "layers"}, "regions"),
    ({"prefetch": -1}, "prefetch"),
    ({"prefetch": 1.5}, "prefetch"),
    ({"debug_dir": 3}, "debug_dir"),
    ({"mesh": [2]}, "mesh"),
    ({"mesh": {"dp": 0}}, "mesh.dp"),
    ({"mesh": {"dp": 1.0}}, "mesh.dp"),
    ({"mesh": {"tp": 2}}, "mesh.tp"),
    ({"mesh": {"pp": 2, "dp": 1}}, "mesh"),  # world size 1
    ({"pipeline": {"schedule": "zigzag"}}, "pipeline.schedule"),
    ({"pipeline": {"microbatches": 0}}, "pipeline.microbatches"),
    ({"pipeline": {"schedule": "1f1b", "stages_per_rank": 2}}, "pipeline.stages_per_rank"),
    ({"pipeline": {"schedule": "interleaved_1f1b", "stages_per_rank": 1}}, "pipeline.stages_per_rank"),
    ({"pipeline": {"depth": 2}}, "pipeline.depth"),
    ({"pipeline": "1f1b"}, "pipeline"),
    ({"mesh": {"dp": 2}}, "mesh"),  # world size 1: no process group for 2 ranks
    ({"mesh": {"ep": 2}}, "mesh.ep"),  # does not divide dp = 1
    ({"mesh": {"ep": 0}}, "mesh.ep"),
    ({"units": "model.layers.*"}, "units"),  # a list of patterns, not one
    ({"units": []}, "units"),
    ({"units": ["LlamaDecoderLayer", 3]}, "units"),
    ({"units": [""]}, "units"),
    ({"mixed_precision": "bf16"}, "mixed_precision"),
    ({"mixed_precision": {"param_type": "bfloat16"}}, "mixed_precision.param_type"),
    ({"mixed_precision": {"param_dtype": "int8"}}, "mixed_precision.param_dtype"),
    ({"mixed_precision": {"param_dtype": "bf16"}}, "mixed_precision.param_dtype"),
    ({"mixed_precision": {"output_dtype": torch.int32}}, "mixed_precision.output_dtype"),
    # A gradient computed in fp32 loses its low bits reduced in bf16; fp16 and bf16 hold different ranges.
    ({"mixed_precision": {"param_dtype": "float32", "reduce_dtype": "bfloat16"}}, "mixed_precision.reduce_dtype"),
    ({"mixed_precision": {"param_dtype": "bfloat16", "reduce_dtype": "float16"}}, "mixed_precision.reduce_dtype"),
    ({"mixed_precision": {"param_dtype": "bfloat16", "cast_forward_inputs": 1}},
     "mixed_precision.cast_forward_inputs"),
    ({"activation_checkpointing": "full"}, "activation_checkpointing"),
    ({"activation_checkpointing": {"mode": "some"}}, "activation_checkpointing"),
    ({"activation_checkpointing": {"mode": "full", "every": 2}}, "activation_checkpointing"),
])
def test_bad_option_names_its_key(options, key):
    with pytest.raises(PiperConfigError) as info:
        parse_options(options)
    assert info.value.key == key
    assert str(info.value).startswith(f"options[{key!r}] = {info.value.value!r} is invalid: ")


def test_mixed_precision_takes_fsdp2s_policy_or_its_fields_as_a_dict():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    as_dict = {"param_dtype": "bfloat16", "reduce_dtype": "torch.float32", "output_dtype": None,
               "cast_forward_inputs": True}
    assert parse_options({"mixed_precision": policy}) == parse_options({"mixed_precision": as_dict})
    mixed = parse_options({"mixed_precision": as_dict}).mixed_precision
    assert (mixed.param_dtype, mixed.reduce_dtype, mixed.reduction_dtype) == (torch.bfloat16, torch.float32,
                                                                              torch.float32)
    # As FSDP2: without reduce_dtype, gradients are reduced in param_dtype.
    assert parse_options({"mixed_precision": {"param_dtype": "bfloat16"}}).mixed_precision.reduction_dtype \
        == torch.bfloat16
    assert parse_options(None).mixed_precision.reduction_dtype is None


def test_units_are_patterns_or_found_automatically():
    assert parse_options({"units": ["LlamaDecoderLayer", "model.layers.*"]}).units == ("LlamaDecoderLayer",
                                                                                      "model.layers.*")
    assert parse_options({}).units is None


def test_units_naming_no_module_is_an_error_when_compiling():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    options = {"codegen": "eager", "units": ["Linear", "Block"]}
    step = torch.compile(lambda x: model(x).sum(), backend="piper", options=options)
    with pytest.raises(PiperConfigError, match=r"\['Block'\] name none") as info:
        step(torch.randn(3, 2))
    assert info.value.key == "units" and info.value.value == ["Linear", "Block"]


def test_options_must_be_a_dict():
    with pytest.raises(PiperConfigError, match="a dict"):
        parse_options(["zero", 1])


def test_launched_world_without_process_group_is_an_error():
    with mock.patch.dict(os.environ, {"WORLD_SIZE": "2"}):
        with pytest.raises(PiperConfigError, match="init_process_group"):
            parse_options({})


def test_defaults_at_world_size_one():
    s = parse_options(None)
    assert (s.dp, s.pp, s.zero, s.codegen, s.regions, s.bucket_mb, s.world_size) == (
        1, 1, 0, "inductor", "auto", 25.0, 1)


def test_regions_are_cut_as_the_option_says_and_by_default_on_a_cpu_or_in_a_deep_model():
    from piper_fx.codegen import DEEP, fewest_regions, regions
    for device in ("cpu", "cuda", "meta", None):
        device = torch.device(device) if device else None
        assert fewest_regions(True, device) == regions.FEWEST and fewest_regions(False, device) is None
    assert fewest_regions("auto", torch.device("cpu")) == fewest_regions("auto", None) == regions.FEWEST
    assert fewest_regions("auto", torch.device("cuda", 1)) == fewest_regions("auto", torch.device("xpu")) == DEEP > 4
    assert parse_options({"regions": False}).regions is False


def test_bad_option_raised_from_compiled_call_unwrapped():
    model = torch.nn.Linear(2, 1)
    step = torch.compile(lambda x: model(x).sum(), backend="piper", options={"codegen": "nope"})
    with pytest.raises(PiperConfigError, match="codegen"):
        step(torch.randn(3, 2))


def _mesh_mismatch(rank, world):
    return parse_options({"mesh": {"dp": 3}})


def test_mesh_not_matching_world_size():
    with pytest.raises(RankFailed, match=r"pp \* dp must equal the world size 2"):
        run_ranks(_mesh_mismatch, 2)


def _one_rank_bad_options(rank, world):
    options = {"zero": 7 if rank == 1 else 0, "codegen": "eager"}
    try:
        piper_fx.prepare(torch.nn.Linear(4, 4), options)
    except PiperConfigError as e:
        return str(e)
    return None


def test_a_rank_with_bad_options_stops_every_rank_with_its_name():
    messages = run_ranks(_one_rank_bad_options, 2, deadline_s=60)
    assert "zero" in messages[1]
    assert "rank 1" in messages[0] and "zero" in messages[0]


def _ranks_disagree(rank, world):
    from piper_fx.options import parse_options_on_all_ranks
    try:
        parse_options_on_all_ranks({"zero": rank, "codegen": "eager"})
    except PiperConfigError as e:
        return str(e)
    return None


def test_ranks_with_different_strategies_are_rejected():
    for message in run_ranks(_ranks_disagree, 2, deadline_s=60):
        assert "same strategy" in message and "rank 1" in message


def _compiled_with_options_of_its_own(rank, world):
    """Both ranks prepare a model with the same strategy; rank 1 compiles it with another."""
    model = torch.nn.Linear(4, 4)
    options = {"zero": 0, "codegen": "eager"}
    piper_fx.prepare(model, options)
    step = torch.compile(lambda x: model(x).sum(), backend="piper",
                         options={**options, "bucket_mb": 1.0} if rank == 1 else options)
    try:
        step(torch.randn(2, 4))
    except PiperConfigError as e:
        return str(e)
    return None


def test_a_model_compiled_with_other_options_than_its_peers_is_rejected_by_every_rank():
    """The ranks agreed on `prepare`'s strategy, which does not spare a model's first compile
    the agreement (only a recompile of a model compiled before, which may be one rank's alone)."""
    for message in run_ranks(_compiled_with_options_of_its_own, 2, deadline_s=120):
        assert message is not None and "same strategy" in message and "rank 1" in message, message


def _zero_without_prepare(rank, world):
    model = torch.nn.Linear(4, 4)
    step = torch.compile(lambda x: model(x).sum(), backend="piper", options={"zero": 3, "codegen": "eager"})
    step(torch.randn(2, 4))


def test_zero_without_prepare_is_an_error():
    with pytest.raises(RankFailed, match="piper_fx.prepare"):
        run_ranks(_zero_without_prepare, 2, deadline_s=60)


def _prepare_twice_with_other_layout(rank, world):
    model = torch.nn.Linear(4, 4)
    piper_fx.prepare(model, {"zero": 3})
    piper_fx.prepare(model, {"zero": 3})  # same layout: a no-op
    piper_fx.prepare(model, {"zero": 0})


def test_prepare_again_with_another_layout_is_an_error():
    with pytest.raises(RankFailed, match="already prepared"):
        run_ranks(_prepare_twice_with_other_layout, 2, deadline_s=60)


def _prepare_sync_batch_norm_of_its_own_group(rank, world):
    import torch.distributed as dist
    from models import ConvNet

    group = dist.new_group([0, 1])
    piper_fx.prepare(torch.nn.SyncBatchNorm.convert_sync_batchnorm(ConvNet(), group), {"codegen": "eager"})


def test_sync_batch_norm_over_a_group_of_its_own_is_refused_by_prepare():
    with pytest.raises(RankFailed, match=r"the model's norm1 \(SyncBatchNorm\) synchronizes over a process "
                                         r"group of its own"):
        run_ranks(_prepare_sync_batch_norm_of_its_own_group, 2, deadline_s=60)


def _rank_one_dies_mid_training(rank, world):
    import time
    import traceback
    model = torch.nn.Linear(4, 4)
    options = {"codegen": "eager"}
    step = torch.compile(lambda x: model(x).sum(), backend="piper", options=options)
    step(torch.randn(2, 4)).backward()
    if rank == 1:
        raise RuntimeError("rank 1 lost its data loader")
    start = time.monotonic()
    try:
        step(torch.randn(2, 4)).backward()  # its all-reduce waits for rank 1, which never comes
    except RuntimeError as e:  # with the notes saying where piper_fx stopped
        return {"error": "".join(traceback.format_exception_only(e)), "waited": time.monotonic() - start}
    return {"error": None}


def test_a_failing_rank_does_not_leave_its_peer_hanging():
    outcomes = run_ranks_collect(_rank_one_dies_mid_training, 2, collective_timeout_s=5, deadline_s=90)
    assert "rank 1 lost its data loader" in outcomes[1]["error"]
    survivor = outcomes[0]["value"]
    assert survivor["error"] is not None and "piper_fx rank 0" in survivor["error"], survivor
    assert survivor["waited"] < 30, survivor


ONE_RANK = [{"split": {"microbatches": 2}}, {"place": {"stage": 0, "rank": 0}}]


@pytest.mark.parametrize("directives, message", [
    (ONE_RANK + [{"order": {"rank": 0, "actions": ["F0.0", "W0.0", "I0.0", "F0.1", "B0.1"]}}],
     "deadlocks: rank 0 action 1 W0.0 waits for I0.0"),
    (ONE_RANK + [{"order": {"rank": 0, "actions": ["F0.0", "B0.0"]}}], r"F0\.1 \(stage 0, microbatch 1\) is missing"),
    (ONE_RANK + [{"order": {"rank": 0, "actions": ["X0.0"]}}], "is not <kind><stage>.<microbatch>"),
    (ONE_RANK + [{"replicate": {"zero": 1}}], "use options\\['zero'\\]"),
    ([{"place": {"stage": 0, "rank": 0}}], "'split' directive"),
])
def test_bad_directives_name_the_problem(directives, message):
    with pytest.raises(PiperConfigError, match=message) as info:
        parse_options({"directives": directives})
    assert info.value.key == "directives"


def test_directives_and_pipeline_together_are_refused():
    with pytest.raises(PiperConfigError, match="not both"):
        parse_options({"directives": ONE_RANK, "pipeline": {"schedule": "gpipe"}})


def test_directives_build_a_validated_schedule():
    s = parse_options({"directives": ONE_RANK + [{"order": {"rank": 0, "actions": ["F0.0", "F0.1", "B0.1", "B0.0"]}}]})
    assert (s.microbatches, s.stages_per_rank, s.schedule.name) == (2, 1, "directives")


def test_directives_write_overlapped_pairs_with_an_ampersand():
    order = ["F0.0", "F0.1&B0.0", "B0.1"]
    s = parse_options({"directives": ONE_RANK + [{"order": {"rank": 0, "actions": order}}]})
    assert s.schedule.pairs == [{1}] and [len(g) for g in s.schedule.steps(0)] == [1, 2, 1]
    waits = ["F0.0&B0.0", "F0.1", "B0.1"]
    with pytest.raises(PiperConfigError, match=r"B0\.0 waits for F0\.0, so they cannot run overlapped"):
        parse_options({"directives": ONE_RANK + [{"order": {"rank": 0, "actions": waits}}]})


@pytest.mark.parametrize("name, microbatches, stages_per_rank", [
    ("zbv", 1, 3), ("dualpipev", 1, 2), ("interleaved_1f1b", 1, 1), ("gpipe", 0, 1), ("1f1b", 1, "2")])
def test_pipeline_shapes_are_checked_by_the_preset(name, microbatches, stages_per_rank):
    from piper_fx.schedules import PRESETS, ShapeError

    with pytest.raises(ShapeError) as shape:
        PRESETS[name].check(1, microbatches, stages_per_rank)
    with pytest.raises(PiperConfigError) as info:
        parse_options({"pipeline": {"schedule": name, "microbatches": microbatches,
                                    "stages_per_rank": stages_per_rank}})
    assert info.value.key == f"pipeline.{shape.value.parameter}"
    assert (info.value.value, info.value.valid) == (shape.value.value, shape.value.valid)


def test_recurrent_layers_without_dynamos_allow_rnn_are_refused_by_prepare():
    """Found probing PyTorch's layers: without `torch._dynamo.config.allow_rnn`, Dynamo runs an
    `nn.LSTM` eagerly, and on one rank or in a pipeline alone the whole forward, so that
    piper_fx never saw the model and a pipeline ran all of it on every rank, silently."""
    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.encoder = torch.nn.ModuleDict({"rnn": torch.nn.LSTM(4, 4, batch_first=True)})
            self.head = torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(self.encoder["rnn"](x)[0]).sum()

    with torch._dynamo.config.patch(allow_rnn=False), \
            pytest.raises(piper_fx.PiperError, match=r"layers encoder.rnn \(LSTM\) are traced by Dynamo only with "
                                                     r"torch._dynamo.config.allow_rnn = True"):
        piper_fx.prepare(Tagger(), {"codegen": "eager"})
    with torch._dynamo.config.patch(allow_rnn=True):
        piper_fx.prepare(Tagger(), {"codegen": "eager"})
