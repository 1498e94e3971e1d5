"""torch.distributed.pipelining's schedule format: presets round-trip through it, and
schedules torch itself builds are read, validated and trained."""
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.pipelining.schedules as torch_schedules

from piper_fx import schedules
from piper_fx.schedules import ScheduleError, from_torch_csv, from_torch_rows, to_torch_csv

PRESETS_ONE_COPY = [name for name in schedules.PRESETS if name != "dualpipe"]


def _legal(name: str, ranks: int) -> tuple[int, int]:
    stages_per_rank = 2 if name in ("interleaved_1f1b", "zbv", "dualpipev") else 1
    return stages_per_rank, schedules.min_microbatches(name, ranks, stages_per_rank)


@pytest.mark.parametrize("name", PRESETS_ONE_COPY)
@pytest.mark.parametrize("ranks", [2, 4])
def test_presets_round_trip_through_torchs_csv(name, ranks):
    stages_per_rank, least = _legal(name, ranks)
    for microbatches in (least, 2 * least):
        built = schedules.build(name, ranks, microbatches, stages_per_rank)
        back = from_torch_csv(to_torch_csv(built), name=name)
        assert back.actions == built.actions
        assert back.stage_to_rank == built.stage_to_rank
        assert [set(p) for p in back.pairs] == [set(p) for p in built.pairs] + [set()] * (ranks - len(built.pairs))
        assert back.num_microbatches == built.num_microbatches


def test_overlapped_pairs_are_written_as_torchs_overlap_f_b():
    csv_text = to_torch_csv(schedules.build("dualpipev", 2, 4, 2))
    assert "(0F3;3B1)OVERLAP_F_B" in csv_text.splitlines()[0]


def test_bidirectional_dualpipe_has_no_torch_form():
    with pytest.raises(ValueError, match="2 copies of the stages"):
        to_torch_csv(schedules.build("dualpipe", 2, 4))


def test_bad_cells_are_schedule_errors():
    with pytest.raises(ScheduleError, match="'0X1' is not a compute action"):
        from_torch_rows([["0F0", "0X1"], ["1F0"]])
    with pytest.raises(ScheduleError, match="stage 0 has actions on ranks 0 and 1"):
        from_torch_rows([["0F0", "0B0"], ["0F1", "0B1"]])
    with pytest.raises(ScheduleError, match="B1.0"):  # the deadlock check of `validate` names the action
        from_torch_rows([["0F0", "0B0"], ["1B0", "1F0"]])


def _torch_csv(schedule_class, ranks: int, stages_per_rank: int, microbatches: int, tmp_path=None) -> str:
    """The schedule torch.distributed.pipelining builds, as CSV: its compute actions, or with
    `tmp_path`, the lowered form its `_dump_csv` writes (with communication). Built without real
    stages or processes: its builders read only these attributes of rank 0's stages."""
    stages = [SimpleNamespace(num_stages=ranks * stages_per_rank, group_size=ranks, group_rank=0,
                              stage_index=i, is_first=i == 0, is_last=False, has_backward=True,
                              submod=torch.nn.Linear(1, 1))
              for i in range(stages_per_rank)]
    built = schedule_class(stages, n_microbatches=microbatches, loss_fn=lambda output, target: output)
    if tmp_path is not None:
        built._dump_csv(str(tmp_path / "schedule.csv"))
        return (tmp_path / "schedule.csv").read_text()
    return "\n".join(",".join("" if a is None else str(a) for a in built.pipeline_order[r]) for r in range(ranks))


TORCH_SCHEDULES = {"interleaved_1f1b": torch_schedules.ScheduleInterleaved1F1B,
                   "interleaved_zero_bubble": torch_schedules.ScheduleInterleavedZeroBubble,
                   "zbv": torch_schedules.ScheduleZBVZeroBubble,
                   "dualpipev": torch_schedules.ScheduleDualPipeV}


@pytest.mark.parametrize("name", sorted(TORCH_SCHEDULES))
def test_torchs_own_schedules_are_read_and_validate(name, tmp_path):
    compute = from_torch_csv(_torch_csv(TORCH_SCHEDULES[name], 2, 2, 4), name=f"torch_{name}")
    lowered_text = _torch_csv(TORCH_SCHEDULES[name], 2, 2, 4, tmp_path)
    assert "SEND_F" in lowered_text and "RECV_B" in lowered_text  # torch's lowered form
    lowered = from_torch_csv(lowered_text, name=f"torch_{name}")
    assert compute.num_ranks == 2 and compute.num_stages == 4 and compute.num_microbatches == 4
    assert (lowered.actions, lowered.pairs, lowered.stage_to_rank) == (compute.actions, compute.pairs,
                                                                       compute.stage_to_rank)
    assert any(compute.pairs) == (name == "dualpipev")


def test_a_schedule_from_torchs_format_trains_like_one_process(rank_pools):
    from training import pipeline_worker

    configs = []
    for name in ("dualpipev", "zbv"):
        schedule = from_torch_csv(_torch_csv(TORCH_SCHEDULES[name], 2, 2, 4), name=f"torch_{name}")
        configs.append({"options": {"mesh": {"pp": 2}, "pipeline": {"schedule": schedule}},
                        "model": "cross", "model_kwargs": {"regions": 4}, "per_rank_batch": 4})
    outcomes = rank_pools(2).run(pipeline_worker, configs, deadline_s=400)
    for rank, outcome in enumerate(outcomes):
        assert "error" not in outcome, outcome["error"]
        for config, run in zip(configs, outcome["value"]):
            assert max(run["loss_errors"]) < 1e-5, (rank, config, run["loss_errors"])
            assert max(run["param_errors"].values()) < 1e-5, (rank, config, run["param_errors"])


def test_action_kinds_are_torchs_computation_types():
    from piper_fx.schedules import ActionKind

    for kind in ActionKind:
        assert torch_schedules._ComputationType(kind.value).value == str(kind)
    built = schedules.build("dualpipev", 2, 4, 2)
    torch_rows = [[str(torch_schedules._Action.from_str(cell)) for cell in row]
                  for row in schedules.to_torch_rows(built)]
    assert torch_rows == schedules.to_torch_rows(built)  # torch reads and prints our cells as they are
