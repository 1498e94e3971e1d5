"""Failures end cleanly: a step that fails on one rank ends on every rank, each naming that rank.

Every run uses a short collective timeout and checks, on every rank, what its
failed step raised and that it ended in time: before that timeout when the
failed rank's process exits, by the timeout when it stays alive.
"""
import pytest

import piper_fx
from ranks import run_ranks_collect
from training import InjectedFailure, bad_input_worker, failing_step_worker, mismatched_batches_worker, \
    recompiled_dtype_worker

TIMEOUT_S = 15  # gloo's timeout for every receive and collective
# A peer blocked on a rank that keeps running learns of the failure only from gloo's timeout,
# which starts when it blocks, shortly after the step began on every rank.
TIMED_OUT_BY_S = TIMEOUT_S + 10


def _values(outcomes):
    for rank, outcome in enumerate(outcomes):
        assert "value" in outcome, f"rank {rank} failed outside the step:\n{outcome['error']}"
    return [outcome["value"] for outcome in outcomes]


def _check_failed_rank(outcome, rank, error_type, where):
    """The rank that failed raises its own error, type kept, with a note naming it and where."""
    assert outcome["type"] == error_type, outcome
    assert f"piper_fx rank {rank}: failed {where}" in outcome["notes"], outcome


def _check_peer(outcome, rank, failed_rank, failed_where, failed_error, within_s):
    """A peer raises `PeerFailedError` (a `PiperError`) naming the failed rank, where and why,
    noting its own (communication) error, within `within_s` seconds of the step's start."""
    assert outcome["type"] == "PeerFailedError" and "PiperError" in outcome["types"], outcome
    assert outcome["failed_rank"] == failed_rank and outcome["failed_where"] == failed_where, outcome
    assert outcome["message"].startswith(
        f"piper_fx rank {rank}: rank {failed_rank} failed {failed_where}: {failed_error}"), outcome
    stopped_on = f"piper_fx rank {rank} stopped on: RuntimeError: "
    assert any(note.startswith(stopped_on) for note in outcome["notes"]), outcome
    assert outcome["elapsed_s"] < within_s, outcome


PIPELINE = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"schedule": "1f1b", "microbatches": 4}}
ZERO3 = {"zero": 3, "codegen": "eager"}


@pytest.mark.parametrize("failed_rank_stays", [False, True], ids=["failed-rank-exits", "failed-rank-stays"])
@pytest.mark.parametrize("options, nth_task, error, failed_where, error_text", [
    # Rank 1 (the last stage) fails in its third task; rank 0 is blocked receiving from it.
    (PIPELINE, 3, InjectedFailure("injected in a task"), "in task F1.1", "InjectedFailure: injected in a task"),
    # Rank 1 fails in its backward; rank 0 is blocked in ZeRO-3's collectives inside its own.
    # A PiperError raised in a task stays a PiperError.
    (ZERO3, 2, piper_fx.PiperError("injected in a task"), "in task B0.0", "PiperError: injected in a task"),
], ids=["pipeline-receive", "zero3-collective"])
def test_a_rank_failing_mid_step_is_named_by_every_peer(options, nth_task, error, failed_where, error_text,
                                                        failed_rank_stays):
    outcomes = _values(run_ranks_collect(failing_step_worker, 2, options, 1, nth_task, error, failed_rank_stays,
                                         deadline_s=240, collective_timeout_s=TIMEOUT_S))
    _check_failed_rank(outcomes[1], 1, type(error).__name__, failed_where)
    # When the failed rank's process exits (as under torchrun), its connections close and the
    # peer ends at once; when it stays, the peer ends at its own receive's or collective's timeout.
    _check_peer(outcomes[0], 0, 1, failed_where, error_text, TIMED_OUT_BY_S if failed_rank_stays else TIMEOUT_S)


def test_every_rank_of_a_pipeline_with_data_parallel_zero3_names_the_first_to_fail():
    # Rank 3 (pipeline rank 1, dp index 1) fails in its second task. Its data-parallel peer (rank 2) and
    # pipeline peer (rank 1) are blocked on it; rank 0 is blocked only on ranks 1 and 2, which it sees fail.
    options = {"mesh": {"pp": 2, "dp": 2}, "zero": 3, "codegen": "eager",
               "pipeline": {"schedule": "1f1b", "microbatches": 2}}
    outcomes = _values(run_ranks_collect(failing_step_worker, 4, options, 3, 2, InjectedFailure("injected"), False,
                                         deadline_s=400, collective_timeout_s=TIMEOUT_S))
    _check_failed_rank(outcomes[3], 3, "InjectedFailure", "in task B1.0")
    for rank in (0, 1, 2):
        _check_peer(outcomes[rank], rank, 3, "in task B1.0", "InjectedFailure: injected", TIMEOUT_S)


def test_arguments_unlike_the_compiled_ones_are_rejected_before_the_step_runs():
    for rank, outcomes in enumerate(_values(run_ranks_collect(bad_input_worker, 2, deadline_s=240,
                                                              collective_timeout_s=TIMEOUT_S))):
        rejected = {case: outcomes[case] for case in ("dtype", "device", "shape")}
        for case, outcome in rejected.items():
            assert outcome["type"] == "PiperError", (rank, case, outcome)
            assert f"piper_fx rank {rank}: failed before running its step" in outcome["notes"], (rank, case, outcome)
        assert "has dtype torch.int32, but this step was compiled for torch.int64" in rejected["dtype"]["message"]
        placement = outcomes["placement"]
        assert placement["type"] == "PiperError", (rank, placement)
        assert "(lm_head.weight) is placed" in placement["message"], placement
        assert "but this step was compiled for" in placement["message"], placement
        assert f"piper_fx rank {rank}: failed before running its step" in placement["notes"], placement
        assert outcomes["equal_placement"]["type"] is None, (rank, outcomes["equal_placement"])
        # Dynamo traced the parameters' plain program placeholders and installed no guard on any
        # DTensor parameter, its spec or its mesh: the step checks the placements itself.
        guards = outcomes["spec_guards"]
        assert guards["frames"] >= 1 and guards["dtensor_parameters"] > 0, guards
        assert guards["placeholder_guards"] > 0, guards
        assert guards["placeholder_contains_guards"] == 0, guards  # a read does not ask (`read_through`)
        assert guards["guards"] == 0, guards
        assert "is on device meta, but this step was compiled for cpu" in rejected["device"]["message"]
        assert "has shape (1, 9), but this step was compiled for (2, 9)" in rejected["shape"]["message"]
        # Every rank rejected the same calls and ran nothing, so the process group is intact.
        assert outcomes["good_after_rejections"]["type"] is None, (rank, outcomes["good_after_rejections"])
        alone = outcomes["dtype_on_rank_1_only"]
        if rank == 1:
            assert alone["type"] == "PiperError" and "has dtype torch.int32" in alone["message"], alone
        else:  # already running the step, blocked in its all-reduce with rank 1
            _check_peer(alone, 0, 1, "before running its step", "PiperError: compiled argument", TIMEOUT_S)


def test_a_dtype_change_recompiles_and_a_stage_it_breaks_is_named_by_its_peers():
    # What a user of torch.compile sees: no PiperError from the step, whose new program was compiled
    # for int32 targets, but the loss's own error on the last stage, which its peer names.
    first_stage, last_stage = _values(run_ranks_collect(recompiled_dtype_worker, 2, deadline_s=240,
                                                        collective_timeout_s=TIMEOUT_S))
    assert last_stage["type"] == "RuntimeError" and "expected target dtype" in last_stage["message"], last_stage
    assert "piper_fx rank 1: failed in task F1.0" in last_stage["notes"], last_stage
    _check_peer(first_stage, 0, 1, "in task F1.0", "RuntimeError: expected target dtype", TIMEOUT_S)


PIPELINE = {"codegen": "eager", "pipeline": {"microbatches": 2}}


@pytest.mark.parametrize("case", ["pipeline", "experts", "pipeline_later_shape", "experts_later_shape", "dp2_pp2"])
def test_ranks_that_exchange_batch_sized_messages_called_with_other_batch_shapes_all_raise(case):
    """Ranks of a pipeline, or of the experts' group, called with batches of different shapes
    would send each other messages of sizes their peers did not post (gloo ended both processes
    with `terminate`). Every rank raises a PiperError naming each rank's shapes instead, at the
    model's first compile and at the compile for a later batch shape. Data-parallel replicas may
    differ (dp2_pp2: the pipeline of ranks 0 and 2 agrees at 4 rows, that of 1 and 3 does not),
    and every rank raises, those of the pipeline that agrees too."""
    pp, ep = {"mesh": {"pp": 2}, **PIPELINE}, {"mesh": {"dp": 2, "ep": 2}, "codegen": "eager"}
    options, rows, later, world = {
        "pipeline": (pp, [4, 8], None, 2),
        "experts": (ep, [4, 8], None, 2),
        "pipeline_later_shape": (pp, [4, 4], [6, 8], 2),
        "experts_later_shape": (ep, [4, 4], [6, 8], 2),
        "dp2_pp2": ({"mesh": {"pp": 2, "dp": 2}, **PIPELINE}, [4, 6, 4, 8], None, 4),
    }[case]
    messages = _values(run_ranks_collect(mismatched_batches_worker, world, options, rows, later, deadline_s=300,
                                         collective_timeout_s=TIMEOUT_S))
    shown = later or rows
    mismatched = [1, 3] if case == "dp2_pp2" else [0, 1]
    group = "the ranks of a pipeline (mesh dimension pp)" if "pipeline" in case or case == "dp2_pp2" else \
        "the ranks sharing out the experts (mesh dimension ep)"
    for rank, message in enumerate(messages):
        assert message.startswith(group) and "must be called with batches of the same shapes" in message, \
            (rank, message)
        for peer in mismatched:
            assert f"rank {peer}: compiled argument" in message and f"of shape ({shown[peer]}, 9)" in message, \
                (rank, message)
        if case == "dp2_pp2":  # the pipeline that agrees is not named
            assert "rank 0:" not in message and "rank 2:" not in message, (rank, message)


def test_a_rank_compiling_for_a_batch_shape_its_pipeline_peer_has_a_step_for_is_named_by_both():
    """Rank 0 is called with 8 rows after a step of 4, rank 1 with 4 again: rank 1 runs the step
    it has, blocked on rank 0, and rank 0 compiles one for 8 rows. Rank 0 waited for rank 1 to
    compile too until the process group's timeout, with nothing said of why; now it waits half
    of it and raises, and rank 1, whose receive gives up later, names it."""
    pipeline = {"mesh": {"pp": 2}, "codegen": "eager", "pipeline": {"schedule": "1f1b", "microbatches": 4}}
    messages = _values(run_ranks_collect(mismatched_batches_worker, 2, pipeline, [4, 4], [8, 4], deadline_s=300,
                                         collective_timeout_s=TIMEOUT_S))
    mine = "this rank was called with batch shapes new to it (compiled argument "
    assert messages[0].startswith(mine) and "of shape (8, 9)" in messages[0] and "ranks [0, 1]" in messages[0] \
        and "must be called with batches of the same shapes" in messages[0], messages[0]
    assert messages[1].startswith("piper_fx rank 1: rank 0 failed compiling a step for a new batch shape: "
                                  "PiperError: " + mine), messages[1]
