"""Every rank of a process group issues the same collectives in the same order.

Read from each rank's dumped program: the instructions in order, and for each
task run, the collectives its graph issues in graph order.
"""
import re

import pytest

from ranks import run_ranks
from training import one_step_with_dumps_worker


def issued_collectives(program: str) -> list[str]:
    tasks: dict[str, list[str]] = {}
    current = None
    order = []
    for line in program.splitlines():
        task = re.match(r"\s+(\w+)\s+stage=\d+ lane=", line)
        if task:
            current = tasks.setdefault(task.group(1), [])
            continue
        collective = re.search(r"collective \w+: _c10d_functional\.(\w+)\.default", line)
        if collective and current is not None:
            current.append(collective.group(1))
        run = re.match(r"\s+\d+\s+run\s+(\w+)", line)
        if run:
            order.extend(f"{run.group(1)}:{c}" for c in tasks[run.group(1)])
    return order


@pytest.mark.parametrize("world, options", [
    (2, {"zero": 0}),
    (2, {"zero": 3, "bucket_mb": 0.002}),
    (4, {"mesh": {"pp": 2, "dp": 2}, "zero": 2, "pipeline": {"schedule": "1f1b", "microbatches": 2}}),
])
def test_data_parallel_peers_issue_identical_collective_sequences(tmp_path, world, options):
    options = {**options, "codegen": "eager", "debug_dir": str(tmp_path)}
    run_ranks(one_step_with_dumps_worker, world, options)
    sequences = {}
    for rank in range(world):
        (graph_dir,) = (tmp_path / f"rank{rank}").iterdir()
        sequences[rank] = issued_collectives((graph_dir / "program.txt").read_text())
    dp = options.get("mesh", {}).get("dp", world)
    for rank in range(world):
        first_peer = rank - rank % dp  # rank r's dp group: the ranks with the same pipeline index r // dp
        assert sequences[rank], rank
        assert sequences[rank] == sequences[first_peer], (rank, first_peer)
