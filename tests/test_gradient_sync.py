"""Gradient accumulation without communication (`piper_fx.no_sync`, `set_requires_gradient_sync`):
the calls of a window hold their gradients unreduced, the first call after reduces them once, and
training equals single-process training on the same batches."""
import os

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import piper_fx
from gradient_sync_workers import backward_forms_worker, calls_worker, gradient_sync_worker
from ranks import run_ranks

RTOL = 1e-5
REDUCTIONS = ("all_reduce", "reduce_scatter")
PIPELINE = {"mesh": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 2}}
TWO_RANKS = [
    *({"options": {"zero": zero}} for zero in range(4)),
    # Every call synchronizing: what one call's reductions send, for the window's to be compared with.
    *({"options": {"zero": zero}, "window": False} for zero in range(4)),
    {"options": {"zero": 2}, "context": False},  # FSDP2's set_requires_gradient_sync
    {"options": {"zero": 1, "pipeline": {"microbatches": 2}}},  # ZeRO-1's once-a-step reduction
    # ZeRO-3 reduce-scatters each microbatch's gradient: each adds its share of what the window held.
    {"options": {"zero": 3, "pipeline": {"microbatches": 2}}},
    # Experts over ep 2 = dp: a block no other rank holds, whose group is the very ranks of dp (found
    # by the strategy search: the dense parameters were taken for experts by their group, and kept
    # unreduced).
    {"options": {"mesh": {"dp": 2, "ep": 2}}, "experts": 4},
    # A window on a submodule alone: its parameters' gradients held, the others' reduced at every call.
    {"options": {"zero": 0}, "part": "blocks.0"},
    {"options": {"zero": 3}, "part": "blocks.1", "context": False},
]
FOUR_RANKS = [
    # A tied embedding read by both stages, its two reads' whole gradients summed across the stages at
    # every call, as the window holds the last block alone, which the second stage holds: every rank
    # runs the program without reductions until its gradients are reduced, the first stage's ranks too,
    # which hold none of them (they ran the program with reductions, and the stages waited on each
    # other's sends).
    {"options": {**PIPELINE, "zero": 3}, "part": "blocks.3"},
    {"options": {"mesh": {"pp": 2, "dp": 2}, "zero": 2,
                 "pipeline": {"schedule": "interleaved_1f1b", "microbatches": 4, "stages_per_rank": 2}}},
    {"options": {"mesh": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "dualpipev", "microbatches": 4}}},
    {"options": {"zero": 3, "codegen": "inductor"}, "tied": False},  # dp 4, the compiled code
    # Blocks of experts over ep 2, each held by 2 ranks: summed over their ep group's tokens in every
    # call, averaged over their 2 holders at the window's end; the dense parameters at ZeRO-2.
    {"options": {"mesh": {"dp": 4, "ep": 2}, "zero": 2}, "experts": 4},
]


@pytest.fixture(scope="module")
def two_ranks():
    return run_ranks(gradient_sync_worker, 2, TWO_RANKS, deadline_s=300)


@pytest.fixture(scope="module")
def four_ranks():
    return run_ranks(gradient_sync_worker, 4, FOUR_RANKS, deadline_s=400)


def _reductions(comm_bytes: dict) -> dict:
    return {kind: n for kind, n in comm_bytes.items() if kind in REDUCTIONS}


def _check_window(config: dict, rank: int, run: dict, calls: int = 3) -> None:
    assert max(run["loss_errors"]) < RTOL, (config, rank, run["loss_errors"])
    worst = max(run["param_errors"], key=run["param_errors"].get)
    assert run["param_errors"][worst] < RTOL, (config, rank, worst, run["param_errors"][worst])
    if config.get("window", True):
        # Inside a window no gradient of its parameters changes (a part's: the others' do); no gradient
        # is reduced (a part's: the others' are), and its last call reduces.
        assert run["grads_changed_in_window"] == [False] * len(run["grads_changed_in_window"]), (config, rank)
        assert run["others_changed_in_window"] == ["part" in config] * len(run["grads_changed_in_window"]), \
            (config, rank)
        for call, comm in enumerate([] if "part" in config else run["comm_bytes"]):
            reduced = _reductions(comm)
            assert bool(reduced) == (call % calls == calls - 1), (config, rank, call, run["comm_bytes"])
        # The window's first call after it reduces what the window held in its program, overlapped with
        # its backward (without a pipeline or experts), else after its program, in its backward.
        for call, comm in enumerate(run["comm_in_call"]):
            if call % calls == calls - 1:
                after = _reductions(comm) == _reductions(run["comm_bytes"][call])
                assert after == _overlapped(config), (config, rank, call, comm, run["comm_bytes"][call])


def _overlapped(config: dict) -> bool:
    """Whether a window's reduction overlaps the backward of its first call after it."""
    options = config["options"]
    return "pp" not in options.get("mesh", {}) and not config.get("experts")


def test_a_window_holds_its_gradients_and_trains_as_one_process(two_ranks):
    for index, config in enumerate(TWO_RANKS):
        for rank, ranks in enumerate(two_ranks):
            _check_window(config, rank, ranks[index])


def test_a_window_on_a_submodule_holds_its_gradients_alone(two_ranks):
    # As FSDP2's set_requires_gradient_sync on a submodule: the others are reduced at every call.
    # (A window's synchronization was its model's first parameter's: the submodule's calls reduced
    # every gradient, or none.)
    for config in (c for c in TWO_RANKS if "part" in c):
        zero = config["options"]["zero"]
        synced = TWO_RANKS.index({"options": {"zero": zero}, "window": False})
        for rank, ranks in enumerate(two_ranks):
            run, per_call = ranks[TWO_RANKS.index(config)], _reductions(ranks[synced]["comm_bytes"][0])
            for call, comm in enumerate(run["comm_bytes"]):
                kind, = per_call
                if call % 3 == 2:
                    assert _reductions(comm) == per_call, (config, rank, call, run["comm_bytes"])
                elif zero == 0:  # the others' whole gradients, all-reduced
                    assert _reductions(comm) == {kind: per_call[kind] - run["window_bytes"]}, (config, rank, call)
                else:  # their padded rows, reduce-scattered
                    assert 0 < _reductions(comm)[kind] < per_call[kind], (config, rank, call, run["comm_bytes"])


def test_a_window_reduces_once_what_each_call_would_have_reduced(two_ranks):
    # The window's one reduction sends what a synchronizing call sends: the same gradients, once.
    for zero in range(4):
        windowed, synced = (TWO_RANKS.index(c) for c in ({"options": {"zero": zero}},
                                                         {"options": {"zero": zero}, "window": False}))
        for rank, ranks in enumerate(two_ranks):
            per_call = [_reductions(c) for c in ranks[synced]["comm_bytes"]]
            assert all(c == per_call[0] and c for c in per_call), (zero, rank, per_call)
            assert _reductions(ranks[windowed]["comm_bytes"][2]) == per_call[0], (zero, rank, ranks[windowed])


def test_a_window_under_pipelines_and_compiled_code(four_ranks):
    for index, config in enumerate(FOUR_RANKS):
        for rank, ranks in enumerate(four_ranks):
            _check_window(config, rank, ranks[index])


@pytest.mark.parametrize("zero", [0, 3])
def test_backward_of_some_parameters_and_autograd_grad_through_a_window(zero):
    """`backward(inputs=...)` in a window holds what it names alone (it held every parameter's
    gradient, adding to the others' at the window's end: relative error 2.0); `torch.autograd.grad`
    in a window is refused (it said no parameter was used in the graph), and outside one gets its
    call's reduced gradients, leaving what the window holds for the next `backward()`. The first
    call after a window reduces what it held in its program, overlapped with its backward: its loss
    scaled otherwise than the window's calls, or its backward of some parameters alone, it hands over
    what single-process training does."""
    for rank, run in enumerate(run_ranks(backward_forms_worker, 2, zero)):
        assert "torch.autograd.grad of a step called while" in run["autograd_in_window"], (zero, rank, run)
        assert max(run["autograd_errors"]) < RTOL, (zero, rank, run["autograd_errors"])
        assert not any(run["grads_after_autograd"]), (zero, rank)
        assert max(run["grad_errors"]) < RTOL, (zero, rank, run["grad_errors"])
        assert max(run["named_errors"]) < RTOL, (zero, rank, run["named_errors"])
        assert max(run["seeds_errors"]) < RTOL, (zero, rank, run["seeds_errors"])


def test_no_sync_takes_a_model():
    with pytest.raises(piper_fx.PiperError, match="not a list"):
        with piper_fx.no_sync([torch.nn.Linear(2, 2)]):
            pass
    with pytest.raises(piper_fx.PiperError, match="no parameters"):
        piper_fx.set_requires_gradient_sync(torch.nn.ReLU(), False)
    with pytest.raises(piper_fx.PiperError, match="is a bool"):
        piper_fx.set_requires_gradient_sync(torch.nn.Linear(2, 2), 0)


def test_one_replica_has_nothing_to_hold_back(monkeypatch):
    # dp = 1 reduces nothing: calls in a window deliver their gradients as calls outside it do,
    # and compile no second step.
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, global_batch
    import piper_fx.backend

    compiles = []
    compile_step = piper_fx.backend._compile
    monkeypatch.setattr(piper_fx.backend, "_compile", lambda *a: compiles.append(a[2]) or compile_step(*a))

    cfg = GPTConfig(**SMALL)
    torch.manual_seed(0)
    model, reference = GPT(cfg), GPT(cfg)
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="piper", options={"codegen": "eager"})
    for call in range(2):
        x, y = global_batch(call, 2, cfg)
        with piper_fx.no_sync(compiled):
            compiled(x, y).backward()
        reference(x, y).backward()
        for (name, p), q in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad, msg=name)
    assert [strategy.gradient_sync for strategy in compiles] == [True]
    torch._dynamo.reset()


EXAMPLES = int(os.environ.get("PIPER_WINDOW_EXAMPLES", "0"))
SCALES = (1.0, 0.5, 0.25, 1 / 3, 0.0, 2.0)


@st.composite
def window_calls(draw) -> tuple[int, int, list[tuple[bool, str, float]]]:
    """A ZeRO level, the microbatches of a call, and a sequence of calls: in a window or not, how
    each goes back, its loss's scale."""
    calls = []
    for _ in range(draw(st.integers(1, 6))):
        in_window = draw(st.booleans())
        forms = ("backward", "inputs") if in_window else ("backward", "inputs", "autograd", "none")
        calls.append((in_window, draw(st.sampled_from(forms)), draw(st.sampled_from(SCALES))))
    return draw(st.integers(0, 3)), draw(st.sampled_from((1, 2))), calls


@settings(max_examples=EXAMPLES or 8, derandomize=not EXAMPLES, database=None, deadline=None,
          phases=(Phase.generate, Phase.shrink) if EXAMPLES else (Phase.generate,),
          suppress_health_check=(HealthCheck.too_slow,))
@given(case=window_calls())
def test_generated_calls_through_windows_give_what_one_process_gives(rank_pools, case):
    """Windows opened and closed between calls of every backward form and loss scale (the first
    call after a window reduces what it held in its program, read divided by the window's latest
    scale, and corrects where its own differs, its backward takes its gradients, leaves some out,
    or never runs), at every ZeRO level, in one microbatch or two: the gradients `torch.autograd.grad` gets and those in
    `.grad` at the end are one process's on the global batches. CI runs 8 fixed cases;
    `PIPER_WINDOW_EXAMPLES=N` searches N random ones (with shrinking)."""
    zero, microbatches, calls = case
    for rank, outcome in enumerate(rank_pools(2).run(calls_worker, zero, microbatches, calls, deadline_s=300)):
        assert "error" not in outcome, (case, rank, outcome.get("error"))
        assert max(outcome["value"]["errors"]) < RTOL, (case, rank, outcome["value"]["errors"])
