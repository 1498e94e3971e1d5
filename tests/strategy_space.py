"""The space of strategies as data: cases to train, and which of them are legal.

A case is a strategy (options) with the model it trains, drawn by the property
test in `test_strategies.py` or listed by the coverage matrix in
`test_coverage_matrix.py`. `expected_errors` is the oracle for legality, written
from the README's contract independently of `piper_fx.options`, so a
validation that drifts from the documented rules fails the tests.
"""
from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

from piper_fx import PiperConfigError

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "zb1p", "zbv", "dualpipev", "dualpipe")
MODELS = ("mlp", "gpt", "moe")  # a value crossing every stage; the GPT with tied embeddings; its MoE version
EXPERTS = 4


@dataclass(frozen=True)
class Case:
    model: str
    pp: int = 1
    dp: int = 1
    ep: int = 1
    zero: int = 0
    schedule: str | None = None          # None: no `pipeline` option
    microbatches: int | None = None      # None: the schedule's default
    stages_per_rank: int | None = None   # None: the schedule's default
    bucket_mb: float = 25.0
    overlap: bool = True
    prefetch: int = 1
    codegen: str = "eager"
    checkpointing: str = "none"  # `activation_checkpointing`'s mode: never changes what training computes
    optimizer: str = "adamw_eps"  # `training.make_optimizer`'s names: "sgd", "adamw_eps" (AdamW; see there)
    on_meta: bool = False  # the model built on the meta device, materialized after `prepare` (`to_empty`)
    # The 3 steps' batches of other sizes (a step compiled for each): with one replica, or experts shared
    # out (whose ranks exchange tokens), the second twice the others' rows; otherwise, as DDP and FSDP2
    # train on uneven batches, the first replica's second and the others' third (each compiled alone).
    resized: bool = False
    frozen: bool = False  # two parameters frozen before `prepare` on both sides (`train_and_compare`)
    # The first step's gradients accumulated into the second's without synchronization (`piper_fx.no_sync`).
    # Drawn with SGD alone: a sum of two steps' gradients has components near zero, whose rounding
    # AdamW's normalisation turns into steps of 1e-5 relative (pp4 interleaved 1F1B, one replica, where
    # a window changes nothing: 4.5e-5 with AdamW, 3e-7 with SGD, against one process accumulating the same).
    unsynced: bool = False
    # The window set on a part of the model alone (its middle child with parameters: the GPT's blocks),
    # whose gradients it holds while the others are reduced at every call (`piper_fx.no_sync`).
    window_part: bool = False
    # The model copied (`copy.deepcopy`, as an EMA copy is made) after every backward, holding its gradients.
    deep_copy: bool = False

    @property
    def world(self) -> int:
        return self.pp * self.dp

    def options(self) -> dict:
        options = {"mesh": {"pp": self.pp, "dp": self.dp, **({"ep": self.ep} if self.ep != 1 else {})},
                   "zero": self.zero, "bucket_mb": self.bucket_mb, "overlap": self.overlap,
                   "prefetch": self.prefetch, "codegen": self.codegen,
                   "activation_checkpointing": {"mode": self.checkpointing}}
        if self.schedule is not None:
            pipeline = {"schedule": self.schedule}
            if self.microbatches is not None:
                pipeline["microbatches"] = self.microbatches
            if self.stages_per_rank is not None:
                pipeline["stages_per_rank"] = self.stages_per_rank
            options["pipeline"] = pipeline
        return options

    def default_stages_per_rank(self) -> int:
        return 2 if self.schedule in ("interleaved_1f1b", "zbv", "dualpipev") else 1

    def stages(self) -> int:
        """Pipeline stages of one copy of the model: the PP regions the model is built with."""
        return self.pp * (self.stages_per_rank or self.default_stages_per_rank())

    def num_microbatches(self) -> int:
        if self.schedule is None:
            return 1
        return self.microbatches if self.microbatches is not None else self.pp

    def label(self) -> str:
        schedule = f"{self.schedule}(m={self.microbatches},v={self.stages_per_rank})" if self.schedule else "no-pp"
        return (f"{self.model} pp{self.pp} dp{self.dp} ep{self.ep} zero{self.zero} {schedule} "
                f"bucket={self.bucket_mb} overlap={self.overlap} prefetch={self.prefetch} {self.codegen} "
                f"ac={self.checkpointing} {self.optimizer}{' on-meta' if self.on_meta else ''}"
                f"{' resized' if self.resized else ''}{' frozen' if self.frozen else ''}"
                f"{' unsynced' if self.unsynced else ''}{' (part)' if self.window_part else ''}"
                f"{' copied' if self.deep_copy else ''}")


def expected_errors(case: Case) -> set[str]:
    """The option keys `case` violates by the README's rules (empty: it is legal); a
    `PiperConfigError` must name one of them (which one depends on the order of checks)."""
    violated = set()
    if case.ep > 1 and (case.dp % case.ep or case.model != "moe"):  # the latter: no EP region to shard
        violated.add("mesh.ep")
    if case.schedule is None:
        return violated
    v = case.stages_per_rank or case.default_stages_per_rank()
    m = case.num_microbatches()
    if case.schedule == "dualpipe" and case.pp % 2:
        violated.add("mesh.pp")
    if case.schedule in ("zbv", "dualpipev") and v != 2:
        violated.add("pipeline.stages_per_rank")
    if case.schedule == "interleaved_1f1b" and v < 2:
        violated.add("pipeline.stages_per_rank")
    if case.schedule not in ("interleaved_1f1b", "zbv", "dualpipev") and v != 1:
        violated.add("pipeline.stages_per_rank")
    least = {"gpipe": 1, "dualpipe": 2 * case.pp, "dualpipev": 2 * case.pp}.get(case.schedule, case.pp)
    if m < least or (case.schedule == "dualpipe" and m % 2) or (case.schedule == "interleaved_1f1b" and m % case.pp):
        violated.add("pipeline.microbatches")
    return violated


def _mostly(value, otherwise, draw, odds: int = 6):
    """`value`, or `otherwise` once in `odds` draws (an illegal choice, to test its error)."""
    return otherwise if draw(st.integers(1, odds)) == 1 else value


@st.composite
def cases(draw) -> Case:
    """A strategy over at most 4 ranks and a model to train with it; about a third are illegal."""
    model = draw(st.sampled_from(MODELS))
    pp = draw(st.sampled_from((1, 2, 4)))
    dp = draw(st.sampled_from((1, 2))) if pp < 4 else 1
    if model == "moe" and dp == 2:
        ep = draw(st.sampled_from((1, 2)))
    else:
        ep = _mostly(1, 2, draw, odds=8)  # ep = 2 without experts, or over one dp rank: illegal
    schedule = microbatches = stages_per_rank = None
    if pp > 1 or draw(st.booleans()):  # without a pipeline: gradient accumulation over microbatches, or none
        schedule = draw(st.sampled_from(SCHEDULES)) if pp > 1 else draw(st.sampled_from(("gpipe", "1f1b")))
        default = Case(model, pp, dp, schedule=schedule).default_stages_per_rank()
        least = {"gpipe": 1, "dualpipe": 2 * pp, "dualpipev": 2 * pp}.get(schedule, pp)
        step = 2 if schedule == "dualpipe" else pp if schedule == "interleaved_1f1b" else 1
        microbatches = _mostly(draw(st.sampled_from((least, least + step))), max(1, least - 1), draw)
        stages_per_rank = _mostly(draw(st.sampled_from((None, default))), 2 if default == 1 else 1, draw)
    optimizer = draw(st.sampled_from(("sgd", "adamw_eps")))
    return Case(model=model, pp=pp, dp=dp, ep=ep, zero=draw(st.sampled_from((0, 1, 2, 3))), schedule=schedule,
                microbatches=microbatches, stages_per_rank=stages_per_rank,
                bucket_mb=draw(st.sampled_from((25.0, 0.001))), overlap=draw(st.booleans()),
                prefetch=draw(st.sampled_from((0, 1, 2))), optimizer=optimizer,
                checkpointing=draw(st.sampled_from(("none", "full", "selective"))), on_meta=draw(st.booleans()),
                resized=draw(st.booleans()), frozen=draw(st.booleans()),
                unsynced=(unsynced := optimizer == "sgd" and draw(st.booleans())),
                window_part=unsynced and draw(st.booleans()), deep_copy=draw(st.booleans()))


def train_case(rank: int, world: int, case: Case) -> dict:
    """Train `case` for 3 steps against single-process training (inside a rank):
    the worst loss and parameter errors, or the `PiperConfigError`'s key and message."""
    from training import train_and_compare

    stages = max(2, case.stages())  # PP regions: one per stage (at least two, for a model worth the name)
    if case.model == "mlp":
        model = {"model": "cross", "model_kwargs": {"regions": stages}}
    else:
        model = {"n_layer": stages, "tied": True, "pp_regions": case.pp > 1,
                 "experts": EXPERTS if case.model == "moe" else 0}
    try:
        rows = case.num_microbatches()
        resized = None
        if case.resized:
            together, apart = [rows, 2 * rows, rows], [[rows] * case.dp, [2 * rows] + [rows] * (case.dp - 1),
                                                        [rows] + [2 * rows] * (case.dp - 1)]
            resized = together if case.dp == 1 or case.ep > 1 else apart
        result = train_and_compare(rank, world, case.options(), case.optimizer, steps=3, per_rank_batch=rows,
                                   per_rank_batches=resized, on_meta=case.on_meta, frozen=case.frozen,
                                   unsynced_steps=(0,) if case.unsynced else (), window_part=case.window_part,
                                   deep_copy=case.deep_copy,
                                   **model)
    except PiperConfigError as e:
        return {"config_error": (e.key, str(e))}
    return {"loss_error": max(result["loss_errors"]), "param_error": max(result["param_errors"].values()),
            "worst_param": max(result["param_errors"], key=result["param_errors"].get),
            "copy_mismatches": result["copy_mismatches"]}


def check_outcomes(case: Case, outcomes: list[dict], rtol: float = 1e-5) -> None:
    """A legal case trains like single-process training on every rank; an illegal
    one is a `PiperConfigError` naming the expected key on every rank."""
    errors = [o["error"] for o in outcomes if "error" in o]
    assert not errors, f"{case.label()}: a rank failed:\n{errors[0]}"
    results = [o["value"] for o in outcomes]
    violated = expected_errors(case)
    for rank, result in enumerate(results):
        if not violated:
            assert "config_error" not in result, (case.label(), rank, result)
            assert result["loss_error"] < rtol and result["param_error"] < rtol, (case.label(), rank, result)
            assert not result["copy_mismatches"], (case.label(), rank, "deep copy differs", result)
        else:
            assert "config_error" in result, (case.label(), rank, f"expected a PiperConfigError on {violated}", result)
            assert result["config_error"][0] in violated, (case.label(), rank, violated, result["config_error"])
