"""Placements decide the collectives: each placement change of `collectives.redistribute`'s table
computes what DTensor's `redistribute` computes and issues the collective the table names; the
strategy passes state changes and insert no collective; an unknown change is a PiperError."""
from collections import Counter

import pytest
import torch
import torch.fx as fx
from torch.distributed.tensor import Replicate, Shard

from ranks import run_ranks
from redistribute_workers import against_dtensor, collectives_of_each_row, stated_then_lowered

from piper_fx.collectives.redistribute import LOWERINGS, placement_name

KIND_OF_OP = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
              "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


def _all_checks(rank, world, debug_dir):
    return against_dtensor(rank, world), collectives_of_each_row(rank, world), stated_then_lowered(rank, world, debug_dir)


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory):
    return run_ranks(_all_checks, 2, str(tmp_path_factory.mktemp("dumps")))


def test_each_change_computes_what_dtensor_redistribute_computes(outcomes):
    for rank, (differences, _, _) in enumerate(outcomes):
        assert set(differences) == {f"{placement_name(s)}->{placement_name(d)}" for s, d in LOWERINGS}
        assert all(diff < 1e-6 for diff in differences.values()), (rank, differences)


def test_each_change_issues_the_collective_the_table_names(outcomes):
    for _, kinds, _ in outcomes:
        assert kinds["Shard(0)->Replicate()"][0] == "all_gather"
        assert kinds["Partial(avg)->Shard(0)"][0] == "reduce_scatter"
        assert kinds["Partial(avg)->Replicate()"][0] == "all_reduce"
        assert kinds["Replicate()->Shard(0)"][0] is None
        assert kinds["Shard(0)->Shard(1)"][0] == "all_to_all"
        for change, (kind, found) in kinds.items():
            assert found == ([kind] if kind else []), (change, found)


def test_strategy_passes_state_placements_and_the_lowering_makes_every_collective(outcomes):
    expected_changes = {0: {("Partial(avg)", "Replicate()")},
                        1: {("Shard(0)", "Replicate()"), ("Partial(avg)", "Replicate()"), ("Replicate()", "Shard(0)")},
                        3: {("Shard(0)", "Replicate()"), ("Partial(avg)", "Shard(0)")}}
    for _, _, runs in outcomes:
        for run in runs:
            assert run["collectives_before"] == [] and run["markers_after"] == [], run
            assert set(run["stated"]) == expected_changes[run["zero"]], run
            # One collective per stated change that is one, of the kind the table names for it.
            stated = Counter(LOWERINGS[(_placement(s), _placement(d))].kind for s, d in run["stated"])
            stated.pop(None, None)
            assert Counter(KIND_OF_OP[op] for op in run["lowered"]) == stated, run


def _placement(name: str):
    from piper_fx.collectives.redistribute import _PLACEMENTS
    return _PLACEMENTS[name]


def test_a_change_with_no_collective_is_an_error_naming_it():
    from piper_fx.collectives.redistribute import state_redistribution
    from piper_fx.errors import PiperError
    from piper_fx.passes.lower_redistributions import lower_redistributions

    class Joint:  # what the pass reads of a TrainingDAG
        def __init__(self, gm):
            self.joint = gm

        dp_group = "0"

        def refresh_output_names(self):
            pass

    from torch._subclasses.fake_tensor import FakeTensorMode

    graph = fx.Graph()
    x = graph.placeholder("x")
    with FakeTensorMode() as mode:
        x.meta["val"] = mode.from_tensor(torch.empty(4, 3))
    out = graph.output(None)
    marker = state_redistribution(graph, x, Replicate(), Shard(1), group_name="0", group_size=2, group_rank=0,
                                  global_shape=(2, 4, 3), before=out)
    out.args = (marker,)
    with pytest.raises(PiperError, match=r"redistribute.*no collective turns Replicate\(\) into Shard\(1\)"):
        lower_redistributions(Joint(fx.GraphModule(torch.nn.Module(), graph)), strategy=None)
