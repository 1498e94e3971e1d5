"""Pipelines (GPipe, 1F1B, interleaved 1F1B), alone and with DP/ZeRO, equal single-process training."""

import math
import os
import re

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import piper_fx

from piper_fx.ir import memory_order
from ranks import run_ranks
from models import ONE_F_ONE_B_DIRECTIVES, reversed_gpipe
from training import activation_memory_worker, fixed_batch_pipeline_worker, pipeline_worker, second_model_worker

RTOL = 1e-5


def _check(results, configs):
    for rank, runs in enumerate(results):
        for config, run in zip(configs, runs):
            assert max(run["loss_errors"]) < RTOL, (rank, config, run["loss_errors"])
            worst = max(run["param_errors"], key=run["param_errors"].get)
            assert run["param_errors"][worst] < RTOL, (rank, config, worst, run["param_errors"][worst])
            # Every parameter reads: another stage's, released, as zeros (it crashed the process).
            assert run["released_read_as_zeros"] and run["stored_read_as_values"], (rank, config)


def _pp(pp, schedule, microbatches, **pipeline):
    return {"mesh": {"pp": pp}, "pipeline": {"schedule": schedule, "microbatches": microbatches, **pipeline}}


def _check_each_parameter_trained_on_exactly_one_pipeline_rank(results, config_index=0):
    runs = [runs[config_index] for runs in results]
    owned = [set(run["params_with_state"]) for run in runs]
    assert all(owned) and set().union(*owned) == set(runs[0]["all_params"])
    assert sum(len(o) for o in owned) == len(runs[0]["all_params"])  # no parameter on two ranks


def test_two_stage_schedules_and_model_shapes():
    configs = [
        {"options": _pp(2, "gpipe", 4), "pp_regions": True, "per_rank_batch": 4},
        {"options": _pp(2, "1f1b", 4), "pp_regions": True, "per_rank_batch": 4},
        {"options": _pp(2, "1f1b", 2), "pp_regions": False, "per_rank_batch": 4},  # automatic split
        {"options": _pp(2, "interleaved_1f1b", 4, stages_per_rank=2), "pp_regions": True, "n_layer": 4,
         "per_rank_batch": 4},
        {"options": _pp(2, "1f1b", 2), "model": "skip", "per_rank_batch": 4},
        {"options": _pp(2, "gpipe", 2), "model": "two_streams", "per_rank_batch": 4},
        {"options": _pp(2, "1f1b", 2), "model": "buffers", "per_rank_batch": 4},
        # The batch given as keyword arguments (as Hugging Face models are called), whose size
        # the GPT's views read: it must reach the compiler symbolic as positional arguments do.
        {"options": _pp(2, "1f1b", 2), "pp_regions": True, "per_rank_batch": 4, "keywords": True},
        {"options": _pp(2, "zb1p", 4), "pp_regions": True, "per_rank_batch": 4},
        {"options": _pp(2, "zb1p", 2), "model": "skip", "per_rank_batch": 4},
        {"options": _pp(2, "zbv", 4), "pp_regions": True, "n_layer": 4, "per_rank_batch": 4},
        # 3 layers over 4 stages: stages split inside attention, whose values there are laid out
        # as transposes (`memory_order`), and the receiving stage reads them with those strides.
        {"options": _pp(2, "zbv", 4), "n_layer": 3, "per_rank_batch": 8,
         "model_kwargs": {"block_size": 32, "n_embd": 64}},
        {"options": {"mesh": {"pp": 2}, "pipeline": {"schedule": reversed_gpipe}}, "pp_regions": True,
         "per_rank_batch": 4},
        {"options": {"mesh": {"pp": 2}, "directives": ONE_F_ONE_B_DIRECTIVES}, "pp_regions": True,
         "per_rank_batch": 4},
    ]
    results = run_ranks(pipeline_worker, 2, configs, deadline_s=400)
    _check(results, configs)
    _check_each_parameter_trained_on_exactly_one_pipeline_rank(results)


def test_a_second_model_of_the_same_class_gets_a_step_of_its_own():
    """Dynamo runs the frame it compiled for one GPT for another of the class (it guards the
    parameters' shapes, not which they are). The second model's parameters were then never
    laid out: each rank kept every stage's, and `full_state_dict` read another stage's from
    this rank's stale copy (relative parameter errors of 1.0). Each model now has its
    own step, compiled at its first call (`DeferredStep`)."""
    results = run_ranks(second_model_worker, 2, {"codegen": "eager", **_pp(2, "1f1b", 2)}, deadline_s=300)
    _check(results, [{"second model": i} for i in range(2)])
    for index in range(2):
        _check_each_parameter_trained_on_exactly_one_pipeline_rank(results, index)


def test_a_pipeline_traced_at_a_fixed_batch_size_says_how_to_make_it_symbolic():
    for message in run_ranks(fixed_batch_pipeline_worker, 2):
        assert "at the size of one microbatch" in message and "torch._dynamo.mark_dynamic(x, 0)" in message, message


def _stateless_worker(rank: int, world: int, codegen: str) -> list:
    """What a function that reads no parameter or buffer returns on this pipeline rank."""
    options = {"mesh": {"pp": world}, "pipeline": {"schedule": "1f1b", "microbatches": 2}, "codegen": codegen}
    ids = torch.arange(8).view(2, 4)
    shifted = torch.compile(lambda ids: (ids.roll(1, -1) * 2, (ids > 0).all()), backend="piper", options=options)
    return [None if value is None else value.tolist() for value in shifted(ids)]


def test_a_graph_that_reads_no_parameter_runs_whole_on_every_pipeline_rank():
    """Batch preprocessing a graph break cut off the model (ProphetNet's decoder inputs, shifted
    and asserted on with `.item()`) has nothing to pipeline. Its ops were split into stages
    all the same: under eager code rank 0 returned the shifted ids and rank 1 the assert's
    value, each None for the other, and Dynamo's code then read `.item()` of None; under
    Inductor the value's conversion was refused as an output without rows. Every rank now
    runs it whole, as the code around torch.distributed.pipelining's stages runs."""
    expected = [[[6, 0, 2, 4], [14, 8, 10, 12]], False]
    for codegen in ("eager", "inductor"):
        assert run_ranks(_stateless_worker, 2, codegen) == [expected, expected], codegen


def test_four_rank_gpipe_1f1b_zb1p_and_zbv():
    configs = [{"options": _pp(4, s, 4), "pp_regions": True, "n_layer": 4, "per_rank_batch": 4}
               for s in ("gpipe", "1f1b", "zb1p")]
    configs.append({"options": _pp(4, "zbv", 8), "pp_regions": True, "n_layer": 8, "per_rank_batch": 8})
    _check(run_ranks(pipeline_worker, 4, configs, deadline_s=400), configs)


def test_pipeline_with_data_parallel_zero():
    # Every ZeRO level in one set of rank processes: starting four ranks costs more than a case.
    configs = [{"options": {"mesh": {"pp": 2, "dp": 2}, "zero": zero,
                            "pipeline": {"schedule": "1f1b", "microbatches": 2}},
                "pp_regions": True, "per_rank_batch": 2} for zero in (0, 1, 2, 3)]
    results = run_ranks(pipeline_worker, 4, configs, deadline_s=600)
    _check(results, configs)
    for index, zero in enumerate((0, 1, 2, 3)):
        for rank, runs in enumerate(results):
            placements = set(runs[index]["placements"].values())
            assert placements == {"dp:Shard(dim=0)" if zero else "dp:Replicate()"}, (zero, rank, placements)
        # Ranks 0 and 2 (and 1 and 3) are one pipeline: each keeps parameters and optimizer state only for
        # its stage's parameters, none for the other stage's (whose storage it released when compiling).
        full = results[0][index]["full_param_bytes"]
        for first, second in ((0, 2), (1, 3)):
            owned = [set(results[r][index]["params_with_state"]) for r in (first, second)]
            assert owned[0] and owned[1] and not owned[0] & owned[1], (zero, owned)
            assert owned[0] | owned[1] == set(results[first][index]["all_params"]), zero
            stored = [results[r][index]["stored_param_bytes"] for r in (first, second)]
            if zero == 0:  # whole parameters: the two stages' make up the model, once
                assert sum(stored) == full and max(stored) < 0.8 * full, (zero, stored, full)
        if zero:  # rows over dp2 (padded to equal shards): the four ranks' make up the model, once
            stored = [runs[index]["stored_param_bytes"] for runs in results]
            assert full <= sum(stored) <= 1.1 * full and max(stored) < 0.4 * full, (zero, stored, full)


def test_1f1b_holds_p_microbatches_activations_on_the_first_stage_whatever_their_number():
    # GPipe's first stage holds every microbatch's activations; 1F1B's the pp in flight, at
    # any number of microbatches: no sent tensor outlives its peer's answer (under gloo,
    # whose sends report completion only once waited for, every microbatch's sent
    # activation was held to the step's end).
    pp = 2
    eight, sixteen = (run_ranks(activation_memory_worker, pp, microbatches)[0] for microbatches in (8, 16))
    assert sixteen["gpipe"] == 2 * eight["gpipe"], (eight, sixteen)
    assert sixteen["1f1b"] == eight["1f1b"] == eight["gpipe"] * pp / 8, (eight, sixteen)


def test_sends_and_receives_of_one_schedule_step_go_out_in_one_batch():
    """The runtime issues each run of back-to-back sends and receives as one `batch_isend_irecv`
    (one NCCL group, where a send and a receive between two ranks cannot wait for each other):
    every message of the program, in its order, and in 1F1B's steady state (and DualPipeV's
    two directions) a send and a receive to the same peer in one call."""
    from training import message_batches_worker

    schedules = ["1f1b", "dualpipev"]
    results = run_ranks(message_batches_worker, 2, schedules, deadline_s=300)
    for schedule in schedules:
        both_ways = []
        for rank, runs in enumerate(results):
            run = runs[schedule]
            assert [message for call in run["calls"] for message in call] == run["messages"], (rank, schedule)
            assert all(run["calls"]) and len(run["calls"]) == run["p2p_batches"], (rank, schedule, run)
            peer = 1 - rank
            both_ways += [call for call in run["calls"] if {("send", peer), ("recv", peer)} <= set(call)]
        assert both_ways, (schedule, [runs[schedule]["calls"] for runs in results])


def test_bad_pipeline_setups_are_precise_errors():
    from training import pipeline_errors_worker
    for errors in run_ranks(pipeline_errors_worker, 2, deadline_s=300):
        assert errors["few_microbatches"].startswith("PiperConfigError: options['pipeline.microbatches'] = 1")
        assert "PiperConfigError" in errors["regions"] and "3 PP regions" in errors["regions"]
        assert "multiple of the number of stages" in errors["regions"]
        assert "PiperError" in errors["batch"] and "split into 2 microbatches" in errors["batch"]


def test_a_batch_that_does_not_split_into_the_microbatches_is_a_clear_error():
    """Another batch size compiles a step of its own (above), unless the batch does not split."""
    from training import batch_shape_change_worker
    for message in run_ranks(batch_shape_change_worker, 2, deadline_s=120):
        assert "a batch of 5 does not split into 2 microbatches (options['pipeline']['microbatches'])" in message


@st.composite
def _laid_out(draw) -> torch.Tensor:
    """A tensor laid out as a stage's output may be: a transpose (dims in any order in memory),
    a slice of a larger tensor (gaps), broadcast along dims (an `expand`'s stride 0)."""
    ndim = draw(st.integers(1, 4))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    order = draw(st.permutations(range(ndim)))  # outermost first in memory
    wider = [size + draw(st.sampled_from((0, 0, 2))) for size in shape]  # a slice of a wider tensor
    base = torch.arange(math.prod(wider[d] for d in order), dtype=torch.float32)
    value = base.view([wider[d] for d in order]).permute([order.index(d) for d in range(ndim)])
    value = value[tuple(slice(0, size) for size in shape)]
    for dim in range(ndim):
        if value.shape[dim] == 1 and draw(st.booleans()):
            shape[dim] = 3
    return value.expand(shape)


@given(_laid_out())
@settings(max_examples=300, deadline=None)
def test_a_value_arrives_as_its_readers_were_compiled_for_it(value):
    """A value sent to another stage arrives with the values and the strides its readers
    were compiled for, which Inductor's code asserts (Falcon's keys expanded over the heads,
    and Qwen3-Next's slices of one projection, crossed stages contiguous and failed it)."""
    from piper_fx.ir import Recv, Send, message_layout
    from piper_fx.runtime.p2p import Receiving, wire_tensor
    from piper_fx.runtime.timing import StepTimeline

    broadcast, order, stride = message_layout(value.shape, value.stride())
    wire = wire_tensor(value, Send("v", None, 1, 0, 0, order, broadcast))
    assert wire.is_contiguous() and wire.numel() <= value.numel()
    receiving = Receiving(Recv("v", None, 0, 0, tuple(value.shape), value.dtype, order=order, broadcast=broadcast,
                               stride=stride))
    assert receiving.received.is_contiguous() and receiving.received.shape == wire.shape
    receiving.received.copy_(wire)  # what the transport does

    class Arrived:
        def wait(self, message):
            pass

    receiving.issued = (Arrived(), 0)
    arrived = receiving.wait(StepTimeline(rank=1))
    assert torch.equal(arrived, value)
    assert all(a == b for a, b, size in zip(arrived.stride(), value.stride(), value.shape) if size > 1), \
        (arrived.stride(), value.stride(), value.shape)


@given(_laid_out(), st.sampled_from(("contiguous", "reversed")))
@settings(max_examples=300, deadline=None)
def test_a_value_computed_in_other_strides_is_laid_out_as_its_reader_was_compiled_for(value, made):
    """`runtime.layouts.laid_out`: a task's input computed dense by another task (Inductor
    makes a returned broadcast view a copy) is given to it in the strides it was traced with."""
    from piper_fx.runtime.layouts import laid_out, same_strides

    computed = value.contiguous() if made == "contiguous" else \
        value.permute(*reversed(range(value.dim()))).contiguous().permute(*reversed(range(value.dim())))
    given_to_reader = laid_out(computed, value.shape, value.stride())
    assert torch.equal(given_to_reader, value) and same_strides(given_to_reader, value.shape, value.stride())


def test_memory_order_names_the_layout_a_value_travels_in():
    assert memory_order((2, 3, 4), (12, 4, 1)) is None  # contiguous
    transposed = torch.empty(2, 4, 3, 5).transpose(1, 2)  # attention's output before its reshape
    order = memory_order(transposed.shape, transposed.stride())
    assert order == (0, 2, 1, 3) and transposed.permute(order).is_contiguous()
    assert memory_order((4, 1, 3), (3, 99, 1)) is None  # a size-1 dim's stride does not matter
    assert memory_order((4, 3), (1, 8)) is None  # not dense: travels as a contiguous copy


def test_a_batch_of_another_size_compiles_a_step_for_it_and_training_goes_on():
    """A smaller batch (an epoch's last), then full ones again, as DDP and FSDP2 train them: the
    frame Dynamo makes dynamic in the batch's size (at once under a pipeline, whose batch
    `prepare` marks dynamic) compiles a step per batch shape, each trained like one process."""
    sizes = [4, 4, 2, 4, 2, 6]  # rows a replica, step by step
    configs = [{"options": {"zero": zero}, "per_rank_batches": sizes} for zero in (0, 3)]
    configs.append({"options": _pp(2, "1f1b", 2), "pp_regions": True, "per_rank_batches": sizes})
    _check(run_ranks(pipeline_worker, 2, configs, deadline_s=600), configs)


def test_ranks_may_call_with_batches_of_their_own_shapes():
    """As DDP and FSDP2 train on batches of uneven sizes (an epoch's uneven last batches, each
    rank's batch padded to its own longest sequence): each rank compiles a step for its shapes,
    alone where its peers already have one for theirs and run it. Before, a rank compiling
    alone called collectives (the options' agreement in a recompile, the shared compile's
    exchange) that met its peers' step collectives: every rank waited until the process group's
    timeout. A step's collectives move parameters and gradients, whose shapes the batch does not
    change, and a later compile exchanges nothing. Replica 1 compiles its 2-row step alone at
    step 1 (a Dynamo recompile without microbatches), replica 0 its own at step 2 (its peer has
    one), replica 1 a 6-row one alone at step 3; under Inductor the second finds the first's
    code claimed and marked done. The ranks of one pipeline (one replica) share their batch."""
    rows = [[4, 4], [4, 2], [2, 2], [4, 6]]  # by step, each replica's rows
    configs = [{"options": {"zero": 0}, "per_rank_batches": rows},
               {"options": {"zero": 3, "codegen": "inductor"}, "per_rank_batches": rows}]
    _check(run_ranks(pipeline_worker, 2, configs, deadline_s=600), configs)
    configs = [{"options": {"zero": 1, **_pp(2, "1f1b", 2), "mesh": {"pp": 2, "dp": 2}}, "pp_regions": True,
                "per_rank_batches": rows}]
    _check(run_ranks(pipeline_worker, 4, configs, deadline_s=600), configs)


def _holders_planned_alone(model_name: str, options: dict, rows: int) -> dict[str, tuple[int, ...]]:
    """The pipeline ranks reading each parameter (by name) in a plan of `model_name` for a batch of
    `rows`, made in this process on a fake process group, as a first compile makes it."""
    import torch.distributed as dist
    from models import MODELS, batch
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from piper_fx.backend import plan
    from piper_fx.capture import keep_input_sources

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=options["mesh"]["pp"])
    try:
        torch.manual_seed(0)
        model = MODELS[model_name]()
        piper_fx.prepare(model, options)
        captured = {}

        def keep_graph(gm, example_inputs):
            keep_input_sources(gm)
            captured.update(gm=gm, example_inputs=example_inputs)
            return gm.forward

        torch.compile(model, backend=keep_graph, dynamic=False)(*batch(0, rows))
        dag = plan(captured["gm"], captured["example_inputs"], piper_fx.parse_options(options))
        return {i.fqn: dag.parameter_holders[i.name] for i in dag.inputs if i.name in dag.parameter_holders}
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()


def test_a_later_compile_keeps_each_parameter_on_the_pipeline_ranks_the_first_put_it_on():
    """Stages cut by estimated cost (no PP regions) move with the batch: the ops' cost grows with
    it, the parameters' does not, and `TableFirst`'s layers go to rank 0 at 64 rows, to rank 1
    at 2 (planned alone, below). A rank lets go of the parameters of stages it does not run, so
    a step compiled for a later batch shape read them as zeros (loss 2% off, parameters far
    off). A later compile now keeps each parameter on the ranks the first put it on, under one
    stage per rank and the V of ZBV (two stages per rank), and trains like one process. (ZBV's
    first compile at 2 rows failed before: the table outweighed a stage's share, and the cut
    by cost left stage 0 the index arithmetic alone, with no backward. Each stage now reads a
    parameter.)"""
    options = {"codegen": "eager", **_pp(2, "1f1b", 2)}
    assert _holders_planned_alone("table_first", options, 64) != _holders_planned_alone("table_first", options, 2)
    configs = [{"options": _pp(2, "1f1b", 2), "model": "table_first", "per_rank_batches": [64, 2, 64]},
               {"options": _pp(2, "1f1b", 2), "model": "table_first", "per_rank_batches": [2, 64, 2]},
               {"options": _pp(2, "zbv", 2), "model": "table_first", "per_rank_batches": [64, 2, 64]},
               {"options": _pp(2, "zbv", 2), "model": "table_first", "per_rank_batches": [2, 64, 2]}]
    _check(run_ranks(pipeline_worker, 2, configs, deadline_s=600), configs)


def _resident_kb_of_mapping(address: int) -> int:
    """The resident kB of the process's memory mapping holding `address` (`/proc/self/smaps`)."""
    with open("/proc/self/smaps") as smaps:
        mappings = re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", smaps.read())
    for mapping in mappings:
        start, end = (int(bound, 16) for bound in mapping.split()[0].split("-"))
        if start <= address < end:
            return int(re.search(r"^Rss:\s+(\d+) kB", mapping, re.MULTILINE).group(1))
    raise AssertionError(f"no mapping holds {address:#x}")


def test_a_released_parameter_holds_no_memory_and_reads_as_zeros():
    """What compiling a pipeline does to each parameter of a stage this rank does not run
    (`holdings.release`), in one process: the process holds its memory no more, and it and
    every view of its storage (what the program reads of it) keep their shapes and read as
    zeros, from memory that stays unheld (a freed storage crashed the process on a read); the
    optimizer leaves it alone."""
    from piper_fx.sharding.holdings import is_stored, release

    def resident_mb() -> float:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    parameter = torch.nn.Parameter(torch.randn(64, 2**18))  # 64 MiB
    view = parameter.detach()[1:]
    opt = torch.optim.SGD([parameter], lr=1.0)
    held = resident_mb()
    release(parameter)
    assert held - resident_mb() >= 60, (held, resident_mb())
    assert not is_stored(parameter) and parameter.shape == (64, 2**18) and view.shape == (63, 2**18)
    assert not parameter.any() and not view.any() and parameter.sum().item() == 0
    assert _resident_kb_of_mapping(parameter.data_ptr()) == 0  # read, and still none of it held
    parameter.grad = torch.ones_like(parameter)
    opt.step()
    assert parameter.grad is None and not opt.state.get(parameter) and not parameter.any()
