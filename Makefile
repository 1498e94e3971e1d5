# Two entry points that work on a fresh machine: `make demo` and `make test`.
VENV ?= .venv
PYTHON ?= python3
PY := $(VENV)/bin/python
STAMP := $(VENV)/.piper_fx_installed
# Compile time is this machine's cost: one Inductor cache for every process and run.
export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.inductor_cache

.PHONY: venv test demo clean gpu-check

venv: $(STAMP)

# torch is pinned exactly: the CPU build of 2.13.0 installs from a local file;
# a looser pin would pull a multi-GB CUDA build. transformers is pinned to the
# release the tests' models were written against: from 5.25 its attention runs
# through the `kernels` package, which breaks Dynamo's graph in a checkpointed
# layer (README, ZeRO-3 units, on Hugging Face models).
$(STAMP): setup.py Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "torch==2.13.0" numpy pytest hypothesis "transformers==5.24.0"
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	touch $(STAMP)

test: venv
	$(PY) -m pytest -q --durations=25 tests

demo: venv
	$(PY) examples/train_gpt.py --nproc 4 --strategy examples/strategies/pp2_dp2_zero3_1f1b.json --steps 300 --debug-dir piper_debug --checkpoint-dir piper_checkpoints --checkpoint-every 150

# On a machine with GPUs and a CUDA build of torch (2.11 to 2.13) in $(PYTHON): not the CPU venv.
# piper_fx against single-device PyTorch on every case that fits the GPUs (examples/device_check.py);
# the cases of more ranks than GPUs, and Hugging Face models, planned and run as rank 0 of a fake group.
gpu-check:
	$(PYTHON) examples/device_check.py --device cuda --plan

clean:
	rm -rf piper_debug piper_checkpoints .pytest_cache
