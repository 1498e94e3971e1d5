"""Inductor code generation: C++ kernels per task, same numerics as eager."""

import platform
from pathlib import Path

import pytest

from ranks import processes, run_ranks
from training import inductor_worker, regions_worker


def test_inductor_codegen_matches_single_process_for_every_zero_level(tmp_path):
    results = run_ranks(inductor_worker, 2, str(tmp_path), deadline_s=900)
    for rank, by_zero in enumerate(results):
        for zero, run in by_zero.items():
            assert max(run["loss_errors"]) < 1e-5, (rank, zero, run["loss_errors"])
            worst = max(run["param_errors"], key=run["param_errors"].get)
            assert run["param_errors"][worst] < 1e-5, (rank, zero, worst, run["param_errors"][worst])
    for zero in range(4):
        for rank in range(2):
            (graph_dir,) = (tmp_path / f"zero{zero}" / f"rank{rank}").iterdir()
            for task in ("F0", "B0"):
                code = (graph_dir / "codegen" / f"{task}.py").read_text()
                assert "cpp_fused" in code and 'extern "C"' in code, (zero, rank, task)
            # Collectives stay inside the compiled graphs (once-per-step ones in the prologue / epilogue).
            code = {p.stem: p.read_text() for p in (graph_dir / "codegen").iterdir()}
            gathers = code.get("P0", "") + code["F0"]
            reductions = code["B0"] + code.get("E0", "")
            assert ("gather_bucket" in gathers) == (zero > 0), zero  # (at 25 MB, a bucket)
            # copied out of it by one op, not by kernels of their own
            assert ("unpack_bucket" in gathers) == (zero > 0), zero
            assert "reduce_scatter_tensor" in reductions if zero >= 2 else "all_reduce" in reductions


def test_the_layers_of_a_deep_model_compile_as_regions_each_distinct_one_once(tmp_path):
    """A 6-layer GPT under ZeRO-3: each task is cut into one region per layer, the middle
    layers' regions are the same code, compiled once per process, and the step trains
    as single-process training does (gathers issued in one region and waited in the next)."""
    results = run_ranks(regions_worker, 2, str(tmp_path), deadline_s=900)
    for rank, run in enumerate(results):
        assert max(run["loss_errors"]) < 1e-5, (rank, run["loss_errors"])
        worst = max(run["param_errors"], key=run["param_errors"].get)
        assert run["param_errors"][worst] < 1e-5, (rank, worst, run["param_errors"][worst])
        # F: 6 regions, B: 7; the ranks split the distinct ones and load the peer's.
        assert run["tasks"]["repeated"] >= 5, (rank, run["tasks"])
        (graph_dir,) = (tmp_path / f"rank{rank}").iterdir()
        for task in ("F0", "B0"):
            code = (graph_dir / "codegen" / f"{task}.py").read_text()
            assert code.count(f"# {task} region ") >= 6 and "same code as region" in code, (rank, task)
            assert "cpp_fused" in code and "gather_bucket" in code, (rank, task)


def test_dualpipev_compiles_its_whole_and_split_backwards_with_inductor(tmp_path):
    from training import pipeline_worker
    options = {"mesh": {"pp": 2}, "codegen": "inductor", "debug_dir": str(tmp_path),
               "pipeline": {"schedule": "dualpipev", "microbatches": 4}}
    configs = [{"options": options, "pp_regions": True, "n_layer": 4, "per_rank_batch": 4}]
    for rank, (run,) in enumerate(run_ranks(pipeline_worker, 2, configs, deadline_s=900)):
        assert max(run["loss_errors"]) < 1e-5 and max(run["param_errors"].values()) < 1e-5, rank
    (graph_dir,) = (tmp_path / "rank1").iterdir()
    # Rank 1 holds stages 1 and 2 of the V; DualPipe runs some backwards whole (B, in the overlapped
    # pairs) and splits the others into I and W: all of them are compiled kernels.
    code = {task: (graph_dir / "codegen" / f"{task}.py").read_text() for task in ("F1", "F2", "B1", "B2", "I2", "W2")}
    assert all("cpp_fused" in source for source in code.values()), code.keys()
    # Stages 1 and 2 are the same layer on other values: one code each for forward and backward
    # (named by position, their graphs have one key in Inductor's cache; compiled once, loaded once).
    assert code["F1"] == code["F2"] and code["B1"] == code["B2"]
    # The overlapped F&B pairs run as fused tasks: compiled too.
    fused = [p for p in (graph_dir / "codegen").iterdir() if "&" in p.stem]
    assert fused and all("cpp_fused" in p.read_text() for p in fused), fused


def test_expert_parallel_with_inductor(tmp_path):
    from training import pipeline_worker
    options = {"mesh": {"dp": 2, "ep": 2}, "codegen": "inductor", "debug_dir": str(tmp_path)}
    configs = [{"options": options, "experts": 4, "per_rank_batch": 2, "steps": 3}]
    for rank, (run,) in enumerate(run_ranks(pipeline_worker, 2, configs, deadline_s=900)):
        assert max(run["loss_errors"]) < 1e-5 and max(run["param_errors"].values()) < 1e-5, rank
    (graph_dir,) = (tmp_path / "rank0").iterdir()
    for task in ("F0", "B0"):  # the expert dispatch and combine stay inside the compiled graphs
        code = (graph_dir / "codegen" / f"{task}.py").read_text()
        assert "cpp_fused" in code and code.count("all_to_all_single.default(") == 2 * 2, task  # 2 MoE blocks


def _compiled_order(collective: str) -> list[str]:
    """The generated code of a task that issues a collective, multiplies, then waits: an
    all-to-all whose result is read, or a bucket's all-reduce whose result leaves the task
    as views of it (a bucket's per-gradient views)."""
    import re

    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from piper_fx.codegen.inductor import compile_task
    from piper_fx.ir import Task, TaskKind

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name

    def exchange(x, y):
        exchanged = c10d.all_to_all_single(x, [2, 2], [2, 2], group)
        z = torch.mm(torch.mm(y, y), y)
        return (c10d.wait_tensor(exchanged) * 2 + z.sum(),)

    def reduce(x, y):
        reduced = c10d.all_reduce(x.reshape(-1) * 2, "avg", group)
        z = torch.mm(torch.mm(y, y), y)
        first, second = torch.split_with_sizes(c10d.wait_tensor(reduced), [8, 24])
        return first, second.view(4, 6), z

    with FakeTensorMode():
        x, y = torch.randn(4, 8), torch.randn(16, 16)
    gm = make_fx(exchange if collective == "all_to_all_single" else reduce)(x, y)
    _, source = compile_task(Task("F0", TaskKind.F, 0, gm, ["x", "y"], ["out"]))
    found = re.finditer(rf"({collective}_?|wait_tensor|extern_kernels\.mm)(\.default)?\(", source)
    return [m.group(1).rstrip("_") for m in found]


@pytest.mark.parametrize("collective", ["all_to_all_single", "all_reduce"])
def test_inductor_keeps_the_planned_overlap_of_a_collective(collective):
    with processes().Pool(1) as pool:
        order = pool.apply(_compiled_order, (collective,))
    # Inductor's memory reordering would put the wait right after the collective.
    assert order == [collective, "extern_kernels.mm", "extern_kernels.mm", "wait_tensor"], order


def test_the_warm_up_probes_each_vector_isa_side_by_side_and_finds_what_inductor_finds():
    """The warm-up thread runs each ISA's check in a thread of its own (the checks are
    independent and cached per ISA); Inductor's list of valid ISAs is then the one a process
    probing them one after the other finds. Each side in a fresh process: the probe is cached
    per process."""
    import subprocess
    import sys

    probe = ("import torch; from piper_fx.codegen import inductor as i; from piper_fx.compat import "
             "valid_vec_isa_list; {}; print([str(isa) for isa in valid_vec_isa_list()])")
    side_by_side = "i.WarmUp(torch.device('cpu')).wait(); import platform; assert i._x86_candidates() or " \
                   "platform.machine() not in ('x86_64', 'AMD64')"
    found = [subprocess.run([sys.executable, "-c", probe.format(setup)], capture_output=True, text=True,
                            check=True).stdout.strip().splitlines()[-1]
             for setup in (side_by_side, "pass")]
    assert found[0] == found[1] and found[0] != "[]", found


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"),
                    reason="the record is kept for the x86 ISAs the warm-up checks side by side")
def test_a_later_process_skips_loading_the_vector_isa_test_libraries_an_earlier_one_loaded():
    """Inductor's check of each vector ISA ends in a subprocess loading its test library, in
    every process; the warm-up keeps which loaded, so the next process on this machine
    (a restarted job, another rank) loads none and finds the same ISAs."""
    import shutil
    import subprocess
    import sys

    from piper_fx.compat import inductor_cache_dir

    probe = """
import subprocess
loads = []
run = subprocess.run
def counted(command, *args, **kwargs):
    loads.extend(part for part in command if "LoadLibrary" in str(part))
    return run(command, *args, **kwargs)
subprocess.run = counted
import torch
from piper_fx.codegen import inductor
from piper_fx.compat import valid_vec_isa_list
inductor.WarmUp(torch.device("cpu")).wait()
print(len(loads), [str(isa) for isa in valid_vec_isa_list()])
"""
    record = Path(inductor_cache_dir()) / "piper_vec_isa"
    shutil.rmtree(record, ignore_errors=True)
    (first_loads, first), (later_loads, later) = [
        subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                       check=True).stdout.strip().splitlines()[-1].split(" ", 1) for _ in range(2)]
    assert int(first_loads) > 0 and len(list(record.iterdir())) == int(first_loads), (first_loads, record)
    assert int(later_loads) == 0 and later == first and first != "[]", (later_loads, later, first)
