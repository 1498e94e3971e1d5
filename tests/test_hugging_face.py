"""Hugging Face models built from their configs (transformers), trained with piper_fx on 2 CPU
ranks against one process on the global batch: models unlike the example GPT in what they
hold (buffers, tied and shared embeddings, biased projections) and compute (rotary positions,
relative position biases, an encoder and a decoder, labels shifted by slice assignment).
`make test` trains Llama and T5 under ZeRO-3 and Qwen2 under 1F1B; with PIPER_HF_SWEEP=1,
every model of `training.HUGGING_FACE` under both (20 cases, under a minute on 2 cores)."""
import os

import pytest

from ranks import run_ranks
from training import HUGGING_FACE, hf_parity_worker

ZERO3 = {"zero": 3, "codegen": "eager"}
ONE_F_ONE_B = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"schedule": "1f1b", "microbatches": 2}}
STRATEGIES = {"zero3": ZERO3, "1f1b": ONE_F_ONE_B}
CASES = ([(name, strategy) for name in HUGGING_FACE for strategy in STRATEGIES] if os.environ.get("PIPER_HF_SWEEP")
         else [("llama", "zero3"), ("t5", "zero3"), ("qwen2", "1f1b")])


@pytest.mark.parametrize("name, strategy", CASES, ids=[f"{name}-{strategy}" for name, strategy in CASES])
def test_a_hugging_face_model_trains_as_one_process_does(name, strategy):
    for rank, result in enumerate(run_ranks(hf_parity_worker, 2, name, STRATEGIES[strategy])):
        assert max(result["loss_errors"]) < 1e-5, (rank, result["loss_errors"])
        assert not result["mismatched"], (rank, result["mismatched"])
