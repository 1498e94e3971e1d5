"""Dynamo traces a prepared model's parameters as plain program placeholders (`dtensor_params`)."""
import re

import pytest
import torch

import piper_fx
from ranks import run_ranks
from training import (attribute_reads_worker, ema_worker, meta_init_worker, program_placeholders_worker,
                      replaced_memory_worker)


def test_placeholders_stand_for_the_parameters_and_follow_what_becomes_of_them():
    for rank, by_zero in enumerate(run_ranks(program_placeholders_worker, 2, deadline_s=300)):
        for zero, result in by_zero.items():
            where = (rank, zero)
            assert result["stands_for_its_parameter"] and result["placeholder_is_plain"], (where, result)
            assert result["tied_share_one"] and result["copy_tied_share_one"], (where, result)
            assert result["to_where_it_is"] and result["still_float32"], (where, result)
            converted = result["to_float64"]
            assert converted["type"] == "PiperError", (where, converted)
            assert re.search(r"parameter \S+ cannot be moved or converted after piper_fx.prepare", converted["message"])
            assert "before prepare" in converted["message"], (where, converted)
            frozen = result["frozen_call"]
            assert frozen["type"] == "PiperError", (where, frozen)
            assert "(blocks.0.mlp.fc.weight) has requires_grad=False" in frozen["message"], (where, frozen)
            assert "compiled for requires_grad=True" in frozen["message"], (where, frozen)
            assert result["after_frozen_call"]["type"] is None, (where, result["after_frozen_call"])
            assert result["frozen_grad_is_none"] and result["others_have_grads"], (where, result)
            assert result["copy_stands_for_copy"], (where, result)
            assert result["gradients_at_offsets"] and not result["copy_with_gradients_differs"], (where, result)
            assert result["registered_anew_dropped"] and result["registered_anew_read"], (where, result)
            assert result["original_reads_through"], (where, result)
            # Dynamo's guards ask neither whether a module holds a placeholder nor for a class's
            # forward through its MRO: each would be a check per parameter or module at every call.
            guards = result["guards"]
            assert guards["placeholder_guards"] > 0 and guards["guards"] == 0, (where, guards)
            assert guards["placeholder_contains_guards"] == 0 and guards["mro_guards"] == 0, (where, guards)
            other = result["other_backend"]
            assert other["type"] is not None, (where, other)
            assert re.search(r"piper_fx: parameter \S+ got its gradient through the plain placeholder",
                             other["message"]), (where, other)


def test_pytorchs_ema_of_a_prepared_model_averages_as_one_process_does():
    """`AveragedModel` deep-copies the model (here while it holds a step's gradients, which
    failed in torch's `Tensor.__deepcopy__`) and averages its parameters, DTensors, in place;
    the average and its eager forward are one process's."""
    for rank, by_zero in enumerate(run_ranks(ema_worker, 2, deadline_s=300)):
        for zero, result in by_zero.items():
            assert result["keys"] and result["difference"] < 1e-6, (rank, zero, result)
            ours, expected = result["losses"]
            assert abs(ours - expected) <= 1e-6 * abs(expected), (rank, zero, result)


def test_a_step_reads_a_parameters_memory_as_it_is_now():
    """The step remembers what its program reads for each parameter (`step._ProgramReads`);
    memory replaced since is read, padded anew under ZeRO-3."""
    for rank, by_zero in enumerate(run_ranks(replaced_memory_worker, 2, deadline_s=300)):
        for zero, losses in by_zero.items():
            assert losses["replaced"] == losses["in_place"] != losses["first"], (rank, zero, losses)


def test_a_sharded_parameters_attribute_is_its_dtensor_outside_a_forward_and_full_inside():
    """As FSDP2's: a write through the attribute reaches the shards (it wrote into a gathered
    copy, and was lost); the model, and a module holding a sharded parameter called alone, run
    eagerly on the full tensors."""
    for rank, by_case in enumerate(run_ranks(attribute_reads_worker, 2, deadline_s=300)):
        for case, result in by_case.items():
            where = (rank, case)
            assert result["sharded"] > 0 and result["reads_are_the_parameters"], (where, result)
            assert result["signature"], (where, result)
            eager, unsharded = result["eager_loss"]
            assert abs(eager - unsharded) <= 1e-6 * abs(unsharded), (where, result)
            if case == "zero3":
                assert result["module_alone"], (where, result)
                assert result["after_a_raising_forward"] == "DTensor", (where, result)
            assert result["written"] <= 1e-6, (where, result)
            stepped, unsharded, before = result["step_loss"]
            assert abs(stepped - unsharded) <= 1e-5 * abs(unsharded) and unsharded != before, (where, result)


def test_a_model_built_on_the_meta_device_is_materialized_by_to_empty_and_trains():
    """FSDP2's initialisation: built on the meta device, prepared, `to_empty`, loaded with
    `set_model_state_dict`; it trains exactly as the same strategy on the model built as usual
    (bit for bit: the same values, the same program), tied embeddings still one parameter, and
    ZeRO-0's replicas start from the first one's values (rank 1 changed its own after loading)."""
    for rank, by_case in enumerate(run_ranks(meta_init_worker, 2, deadline_s=400)):
        for case, result in by_case.items():
            where = (rank, case)
            assert result["real_after_to_empty"] and result["still_tied"], (where, result)
            usual, meta = result["losses"]
            assert usual == meta, (where, result)
            assert result["same_parameters"], (where, result)


class _HoldsItsOwn(torch.nn.Module):
    """A model holding a parameter of its own beside its children's, two of them tied."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(3))
        self.first, self.second = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
        self.second.weight = self.first.weight

    def forward(self, x):
        return (self.second(self.first(x)) * self.scale).sum()


@pytest.mark.parametrize("options", [{}, {"mixed_precision": {"param_dtype": "bfloat16"}}], ids=["plain", "bf16"])
def test_to_empty_gives_every_parameter_of_a_meta_model_memory_and_keeps_ties(options):
    """In one process (nothing laid out but mixed precision's placeholders): every parameter,
    the model's own among them, is real after `to_empty`, and tied ones are one parameter
    (PyTorch alone makes a plain meta parameter anew in each module holding it; the model's
    own parameter was put back on the meta device after `_apply` had converted it)."""
    with torch.device("meta"):
        model = _HoldsItsOwn()
    piper_fx.prepare(model, {"codegen": "eager", **options})
    model.to_empty(device="cpu")
    assert not any(p.is_meta for p in model.parameters()), [n for n, p in model.named_parameters() if p.is_meta]
    assert model.second._parameters["weight"] is model.first._parameters["weight"]
    assert list(model._parameters) == ["scale"]


def test_a_model_still_on_the_meta_device_is_refused_by_name_until_to_empty():
    """As FSDP2's first forward: calling a model prepared on the meta device, eagerly or
    compiled, is a `PiperError` naming the parameters still there, not Dynamo's device mismatch
    deep in the trace; `to_empty` removes the check, and the compiled model then trains."""
    with torch.device("meta"):
        model = _HoldsItsOwn()
    piper_fx.prepare(model, {"codegen": "eager"})
    compiled = torch.compile(model, backend="piper", options={"codegen": "eager"}, fullgraph=True)
    x = torch.ones(2, 3)
    for call in (model, compiled):
        with pytest.raises(piper_fx.PiperError, match=r"materialized from the meta device before training, but "
                                                      r"these are still on it: \['scale', 'first.weight', "
                                                      r"'first.bias', 'second.bias'\]\. Call model.to_empty"):
            call(x)
    model.to_empty(device="cpu")
    assert not model._forward_pre_hooks  # nothing of piper_fx's left for Dynamo to trace
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(0.5)
    loss = compiled(x)
    loss.backward()
    assert loss.item() == 6 * (3 * (3 * 0.5 + 0.5) * 0.5 + 0.5) * 0.5 == model(x).item()
    assert model.scale.grad is not None
