"""The coverage matrix: every schedule with dp = 1 and dp = 2, every ZeRO level under a
pipeline, and every schedule once with Inductor, each against single-process training.

The table below is the matrix (the README lists it). All rows use pp = 2; the model
is the MLP whose first layer's output crosses every stage boundary, or the example
GPT with tied embeddings (shared by the first and the last stage). Every row also copies
the model (`copy.deepcopy`) after each backward, holding its gradients.
"""
import pytest

from strategy_space import Case, check_outcomes, train_case

MATRIX = [
    # model  schedule            dp  zero  codegen
    ("mlp", "gpipe",             1,  0,    "eager"),
    ("gpt", "gpipe",             2,  0,    "eager"),
    ("mlp", "gpipe",             1,  0,    "inductor"),
    ("gpt", "1f1b",              1,  0,    "eager"),
    ("mlp", "1f1b",              2,  1,    "eager"),
    ("gpt", "1f1b",              1,  0,    "inductor"),
    ("mlp", "interleaved_1f1b",  1,  0,    "eager"),
    ("gpt", "interleaved_1f1b",  2,  2,    "eager"),
    ("mlp", "interleaved_1f1b",  1,  0,    "inductor"),
    ("gpt", "zb1p",              1,  0,    "eager"),
    ("mlp", "zb1p",              2,  3,    "eager"),
    ("mlp", "zb1p",              1,  0,    "inductor"),
    ("mlp", "zbv",               1,  0,    "eager"),
    ("gpt", "zbv",               2,  1,    "eager"),
    ("mlp", "zbv",               1,  0,    "inductor"),
    ("gpt", "dualpipev",         1,  0,    "eager"),
    ("mlp", "dualpipev",         2,  2,    "eager"),
    ("mlp", "dualpipev",         1,  0,    "inductor"),
    ("mlp", "dualpipe",          1,  0,    "eager"),
    ("gpt", "dualpipe",          2,  3,    "eager"),
    ("mlp", "dualpipe",          1,  0,    "inductor"),
]
PP = 2


def _case(model: str, schedule: str, dp: int, zero: int, codegen: str) -> Case:
    microbatches = 2 * PP if schedule.startswith("dualpipe") else PP
    return Case(model=model, pp=PP, dp=dp, zero=zero, schedule=schedule, microbatches=microbatches,
                codegen=codegen, optimizer="adamw_eps", deep_copy=True)


@pytest.mark.parametrize("model, schedule, dp, zero, codegen", MATRIX,
                         ids=[f"{s}-dp{dp}-zero{z}-{c}-{m}" for m, s, dp, z, c in MATRIX])
def test_schedule_dp_zero_codegen_matrix(rank_pools, model, schedule, dp, zero, codegen):
    case = _case(model, schedule, dp, zero, codegen)
    check_outcomes(case, rank_pools(case.world).run(train_case, case, deadline_s=600))


def test_the_matrix_covers_what_it_claims():
    from strategy_space import SCHEDULES
    assert {(s, dp) for _, s, dp, _, _ in MATRIX} == {(s, dp) for s in SCHEDULES for dp in (1, 2)}
    assert {z for _, _, dp, z, _ in MATRIX if dp == 2} == {0, 1, 2, 3}
    assert {s for _, s, _, _, c in MATRIX if c == "inductor"} == set(SCHEDULES)
