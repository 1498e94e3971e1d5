"""Under gloo, a process group has one all-gather in flight at a time (`passes.limit_gathers_in_flight`):
two at once corrupt the heap in torch's ProcessGroupGloo (`benchmarks/gloo_gather_race.py`).
Other backends keep the overlap policy's gathers ahead (here the fake group, as large
worlds are planned)."""
import pytest

from ranks import processes
from training import gathers_in_flight, gathers_in_flight_worker, plan_all_ranks

CASES = {
    "zero3, two layers gathered ahead": {"zero": 3, "prefetch": 2, "bucket_mb": 1e-9, "codegen": "eager"},
    "zero2, the prologue's gathers": {"zero": 2, "bucket_mb": 1e-9, "codegen": "eager"},
}


def _on_fake_group(options: dict) -> int:
    programs, _ = plan_all_ranks(options, world=2, n_layer=2, batch_rows=4)
    return gathers_in_flight(programs)


@pytest.mark.parametrize("case", CASES)
def test_gloo_groups_gather_one_at_a_time(rank_pools, case):
    options = CASES[case]
    with processes().Pool(1) as pool:  # the fake group must not leak into other tests
        assert pool.apply(_on_fake_group, (options,)) >= 2
    outcomes = rank_pools(2).run(gathers_in_flight_worker, options, deadline_s=300)
    assert [outcome.get("value") for outcome in outcomes] == [1, 1], outcomes
