"""The test harness's rank pool says what went wrong with a rank that does not answer:
where a stuck rank was (every thread's stack), and at once, the exit code of one that died."""
import os
import time

import pytest

from rank_pool import RankPool


def _stuck_on_rank_1(rank, world_size):
    while rank == 1:
        time.sleep(0.1)
    return rank


def _return_rank(rank, world_size):
    return rank


def _dies_on_rank_1(rank, world_size):
    if rank == 1:
        os.abort()  # as glibc ends a process whose heap it finds corrupted
    return rank


def test_a_rank_past_its_deadline_is_shown_where_it_was_and_one_that_dies_ends_the_run_at_once():
    pool = RankPool(2)
    try:
        assert pool.run(_return_rank, deadline_s=120) == [{"value": 0}, {"value": 1}]  # started
        with pytest.raises(AssertionError) as stuck:
            pool.run(_stuck_on_rank_1, deadline_s=5)
        message = str(stuck.value)
        assert "ranks [1] did not finish within 5s" in message, message
        assert "_stuck_on_rank_1" in message and "rank 1:" in message, message
        # The pool was torn down; the next run starts fresh ranks.
        assert pool.run(_return_rank, deadline_s=120) == [{"value": 0}, {"value": 1}]
        started = time.monotonic()
        with pytest.raises(AssertionError, match=r"rank 1 exited with code -6 without answering") as died:
            pool.run(_dies_on_rank_1, deadline_s=120)
        # Where it died is in the error itself, not only in a stderr a long log may cut.
        message = str(died.value)
        assert "Fatal Python error: Aborted" in message and "_dies_on_rank_1" in message, message
        assert "Extension modules" not in message, message
        assert time.monotonic() - started < 30
    finally:
        pool.close()

