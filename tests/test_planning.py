"""Which collectives each ZeRO level plans, on a fake process group of 4 ranks, in one process.

Counted from the dumped per-rank program: what the runtime runs is what is dumped.
"""
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ranks import processes
from training import SMALL, global_batch


def _plan_one_step(zero: int, world: int, debug_dir: str, bucket_mb: float = 1e-9) -> str:
    """This rank's dumped program after one step (by default with buckets too small to merge anything)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import piper_fx
    from examples.gpt import GPT, GPTConfig

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**SMALL))
    options = {"zero": zero, "codegen": "eager", "debug_dir": debug_dir, "bucket_mb": bucket_mb}
    piper_fx.prepare(model, options)
    x, y = global_batch(0, 2, model.cfg)
    torch.compile(model, backend="piper", options=options)(x, y).backward()
    dist.destroy_process_group()
    return next((__import__("pathlib").Path(debug_dir) / "rank0").iterdir()).joinpath("program.txt").read_text()


def _collectives_by_task(program: str) -> dict[str, list[str]]:
    tasks: dict[str, list[str]] = {}
    current = None
    for line in program.splitlines():
        task = re.match(r"\s+(\w+)\s+stage=\d+ lane=", line)
        if task:
            current = tasks.setdefault(task.group(1), [])
        found = re.search(r"collective \w+: (?:_c10d_functional|piper)\.(\w+)\.default", line)
        if found:  # a bucket's all-gather is one op of ours, which gathers in place
            current.append({"gather_bucket": "all_gather_into_tensor"}.get(found.group(1), found.group(1)))
    return tasks


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    """Per ZeRO level: collectives of each task, one per parameter (no bucketing)."""
    ctx = processes()
    with ctx.Pool(1) as pool:  # a fresh process: the fake process group must not leak into other tests
        return {zero: _collectives_by_task(pool.apply(_plan_one_step, (zero, 4, str(tmp_path_factory.mktemp(f"z{zero}")))))
                for zero in (0, 1, 2, 3)}


def _counts(ops):
    return {kind: ops.count(kind) for kind in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")}


NONE = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "all_reduce": 0}
PARAMS, USES = 28, 29  # wte (tied with lm_head: used by two modules), wpe, 12 per block, ln_f


def test_ddp_all_reduces_each_gradient_once_per_step_in_the_backward(plans):
    # One microbatch: as DDP, each gradient is reduced in the backward, overlapping the rest of it.
    assert set(plans[0]) == {"F0", "B0"}
    assert _counts(plans[0]["F0"]) == NONE
    assert _counts(plans[0]["B0"]) == {**NONE, "all_reduce": PARAMS}


def test_zero1_gathers_once_per_step_and_all_reduces_once_per_step(plans):
    assert _counts(plans[1]["P0"]) == {**NONE, "all_gather_into_tensor": PARAMS}
    assert _counts(plans[1]["F0"]) == NONE
    # The tied weight's two reads' gradients are summed, then reduced once: one reduction per parameter.
    assert _counts(plans[1]["B0"]) == {**NONE, "all_reduce": PARAMS}


def test_zero2_gathers_once_per_step_and_reduce_scatters_in_backward(plans):
    assert _counts(plans[2]["P0"]) == {**NONE, "all_gather_into_tensor": PARAMS}
    assert _counts(plans[2]["F0"]) == NONE
    assert _counts(plans[2]["B0"]) == {**NONE, "reduce_scatter_tensor": PARAMS}
    assert "E0" not in plans[2]


def test_zero3_gathers_per_use_in_forward_and_again_in_backward(plans):
    assert set(plans[3]) == {"F0", "B0"}
    assert _counts(plans[3]["F0"]) == {**NONE, "all_gather_into_tensor": USES}
    backward = _counts(plans[3]["B0"])
    # Every use whose backward reads the weight gathers it again (embeddings and
    # layer-norm/bias parameters feed their backward without needing the full value).
    assert 0 < backward["all_gather_into_tensor"] < USES
    assert backward["reduce_scatter_tensor"] == PARAMS and backward["all_reduce"] == 0


@pytest.mark.parametrize("world", [2, 4])
def test_bucket_size_sets_the_number_of_collectives(tmp_path, world):
    ctx = processes()
    counts = {}
    with ctx.Pool(1) as pool:
        for bucket_mb in (1e-9, 0.002, 25):
            program = pool.apply(_plan_one_step, (3, world, str(tmp_path / str(bucket_mb)), bucket_mb))
            counts[bucket_mb] = {task: _counts(ops) for task, ops in _collectives_by_task(program).items()}
            # Every all-gather gathers in place: one grouped with no other is a bucket of one.
            assert "_c10d_functional.all_gather_into_tensor" not in program, bucket_mb
    gathers = {mb: c["F0"]["all_gather_into_tensor"] + c["B0"]["all_gather_into_tensor"] for mb, c in counts.items()}
    scatters = {mb: c["B0"]["reduce_scatter_tensor"] for mb, c in counts.items()}
    assert gathers[1e-9] > gathers[0.002] > gathers[25], gathers
    assert scatters[1e-9] > scatters[0.002] > scatters[25] == 1, scatters
    # ZeRO-3 buckets never span two layers: at 25 MB, one forward gather per layer
    # (wte, wpe, two blocks, ln_f, and lm_head reading the tied wte again).
    assert counts[25]["F0"]["all_gather_into_tensor"] == 6


def _reduction_bucket_bytes(kind: str, numels: list[int], bucket_mb: float, small_first: bool,
                            trace_stats: bool = False):
    """The bytes each `kind` collective counts against its bucket's cap (its input's, the
    larger side), in issue order, after bucketing one reduction per gradient of `numels`
    floats, issued in order; with `trace_stats`, how many buckets and traces the pass made and
    whether each bucket has values of its own. Runs on a fake process group of 2, made once
    per process."""
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from piper_fx.compat import tracing
    from piper_fx.collectives.buckets import FLAT_BUCKET
    from piper_fx.collectives.emit import KeptTraces
    from piper_fx.passes.bucket_collectives import _bucket_reductions

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    c10d = torch.ops._c10d_functional
    group = dist.group.WORLD.group_name
    op = c10d.all_reduce.default if kind == "all_reduce" else c10d.reduce_scatter_tensor.default

    def backward(*grads):
        if kind == "all_reduce":
            return [c10d.wait_tensor(c10d.all_reduce(g * 2, "avg", group)) for g in grads]
        return [c10d.wait_tensor(c10d.reduce_scatter_tensor(g * 2, "avg", 2, group)) for g in grads]

    with FakeTensorMode():
        grads = [torch.randn(2, numel // 2) for numel in numels]
    gm = make_fx(backward)(*grads)
    traces = KeptTraces()
    with tracing(None):
        _bucket_reductions(gm, bucket_mb, small_first, traces)
    buckets = [n for n in gm.graph.nodes if n.target is op]
    if trace_stats:
        # Each bucket's values are its own: no storage of one bucket's collective is another's.
        storages = {n.meta["val"].untyped_storage()._cdata for n in buckets}
        # Each bucket's flat input is one op over its gradients (not a copy per gradient).
        flat = [n.all_input_nodes[0] for n in buckets]
        return {"buckets": len(buckets), "traces": len(traces), "own_storages": len(storages) == len(buckets),
                "flat_inputs": [len(f.args[0]) if f.target is FLAT_BUCKET else f.format_node() for f in flat]}
    return [n.all_input_nodes[0].meta["val"].numel() * 4 for n in buckets]


def _ddp_buckets(nbytes: list[int], bucket_mb: float, small_first: bool) -> list[int]:
    """The policy, written plainly: in issue order, a bucket takes the next reduction unless that
    would take it over its cap (so it holds at least one); the first bucket's cap is DDP's 1 MiB
    (`bucket_mb` if smaller, or without `small_first`), the others' `bucket_mb`."""
    first = min(bucket_mb, 1.0) if small_first else bucket_mb
    buckets = [nbytes[0]]
    for size in nbytes[1:]:
        cap = first if len(buckets) == 1 else bucket_mb
        if buckets[-1] + size > cap * 2**20:
            buckets.append(size)
        else:
            buckets[-1] += size
    return buckets


def test_gradient_buckets_are_ddps_a_small_first_one_then_bucket_mb():
    ctx = processes()
    with ctx.Pool(1) as pool:
        sizes = {mb: pool.apply(_reduction_bucket_bytes, ("all_reduce", [65536] * 12, mb, True))
                 for mb in (25, 1.5, 0.5)}
        epilogue = pool.apply(_reduction_bucket_bytes, ("all_reduce", [65536] * 12, 25, False))
        scatters = pool.apply(_reduction_bucket_bytes, ("reduce_scatter", [65536] * 12, 25, True))
    kib = 1024
    # Twelve gradients of 256 KiB. As DDP's reducer: the first bucket (the last layer's gradients)
    # holds at most 1 MiB, so its reduction starts early in the backward; the next ones up to bucket_mb.
    assert sizes[25] == [1024 * kib, 2048 * kib], sizes
    assert sizes[1.5] == [1024 * kib, 1536 * kib, 512 * kib], sizes
    assert sizes[0.5] == [512 * kib] * 6, sizes
    # An epilogue's reductions (once per step, after the last backward) have nothing to hide behind.
    assert epilogue == [3072 * kib], epilogue
    # ZeRO-2/3's reduce-scatters bucket by size alone, in a backward task too.
    assert scatters == [3072 * kib], scatters


def test_buckets_of_one_layout_share_one_trace_each_with_values_of_its_own():
    ctx = processes()
    with ctx.Pool(1) as pool:
        stats = {kind: pool.apply(_reduction_bucket_bytes, (kind, [65536] * 12, 0.5, True, True))
                 for kind in ("all_reduce", "reduce_scatter")}
    # Six buckets of two 256 KiB gradients each (the first one too: 0.5 MiB is below DDP's
    # 1 MiB): one layout, traced once, each bucket's values computed from its own inputs, and
    # its flat input made by one op over its two gradients.
    for kind, got in stats.items():
        assert got == {"buckets": 6, "traces": 1, "own_storages": True, "flat_inputs": [2] * 6}, (kind, got)


def test_a_buckets_flat_buffer_holds_each_tensors_rows_in_turn():
    """`piper::flat_bucket`, against the layout Inductor's merge functions trace with `torch.cat`:
    with one row (all-reduce), every tensor flattened in turn; with a row per rank
    (reduce-scatter), rank r's part holds row r of every tensor in turn. Views, 0-d tensors
    and casts included; its result is a new tensor even for a bucket of one."""
    from piper_fx.collectives.buckets import FLAT_BUCKET

    torch.manual_seed(0)
    tensors = [torch.randn(4, 3), torch.randn(2), torch.randn(6, 2).t(), torch.randn(())]
    assert torch.equal(FLAT_BUCKET(tensors, 1, torch.float32), torch.cat([t.reshape(-1) for t in tensors]))
    assert torch.equal(FLAT_BUCKET(tensors, 1, torch.bfloat16),
                       torch.cat([t.reshape(-1) for t in tensors]).bfloat16())
    rows = [torch.randn(4, 3), torch.randn(2, 5), torch.randn(6, 2).t()]
    flat = FLAT_BUCKET(rows, 2, torch.float32).reshape(2, -1)
    for rank in range(2):
        assert torch.equal(flat[rank], torch.cat([t.reshape(2, -1)[rank] for t in rows]))
    alone = torch.randn(3, 3)
    out = FLAT_BUCKET([alone], 1, torch.float32)
    assert torch.equal(out, alone.reshape(-1)) and out.untyped_storage().data_ptr() != alone.untyped_storage().data_ptr()


def test_a_bucket_gather_holds_every_ranks_shards_flattened_in_rank_order():
    """`piper::gather_bucket` at world 2, against each rank's shards flattened in turn, rank
    after rank (the layout Inductor's all-gather merge traces): views, 0-d shards and a cast
    included; the result is a new tensor, and its `wait_tensor` waits for the gather."""
    from ranks import run_ranks
    from training import gather_bucket_worker

    for rank, checks in enumerate(run_ranks(gather_bucket_worker, 2)):
        assert checks == {"float32": True, "bfloat16": True, "aliases_a_shard": False}, (rank, checks)


def test_every_parameter_a_bucket_gathers_is_contiguous():
    """A shard of one row a rank gathered as a view of the bucket's rank-major rows is strided
    (its rows one rank's part apart); where the plan's value of it said contiguous, a task that
    Inductor compiled for it refused it at run time (Hugging Face's Qwen3-Next, whose (2,)
    parameters ZeRO-2 shards over dp 2, under pp2 ZBV: "expected size 2==2, stride 2226==1").
    Each is its own tensor, as when the rows are more (a reshape that copies)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from piper_fx.passes.bucket_collectives import _gather_bucket

    with FakeTensorMode():
        parts = _gather_bucket([torch.empty(1, 3), torch.empty(1), torch.empty(2, 3)], "0", 2, torch.float32)
    assert [tuple(p.shape) for p in parts] == [(2, 3), (2,), (4, 3)]
    assert all(p.is_contiguous() for p in parts), [p.stride() for p in parts]


def test_a_gathered_bucket_unpacks_into_its_tensors_whole_new_and_contiguous():
    """`piper::unpack_bucket` on a bucket gathered at world 2 (each rank's shards flattened in
    turn, rank after rank): each tensor holds every rank's rows in rank order, in a storage
    of its own, contiguous, whatever its rows (one row a rank included) and dimensions."""
    from piper_fx.collectives.buckets import UNPACK_BUCKET

    shards = [[torch.arange(6.0).reshape(2, 3) + 100 * r, torch.arange(2.0) + 10 * r,
               torch.arange(3.0).reshape(1, 3) + 1000 * r] for r in range(2)]
    gathered = torch.cat([t.reshape(-1) for rank in shards for t in rank])
    shapes = [(4, 3), (4,), (2, 3)]
    parts = UNPACK_BUCKET(gathered, 2, [len(shape) for shape in shapes], [n for shape in shapes for n in shape])
    assert len(parts) == 3
    for index, part in enumerate(parts):
        assert torch.equal(part, torch.cat([rank[index] for rank in shards])), index
        assert part.is_contiguous() and part.untyped_storage().data_ptr() != gathered.untyped_storage().data_ptr()


def _views_off_their_input(options: dict) -> list[str]:
    """Each view (or item) in a planned task whose value is not on the storage of the value it
    reads (`runtime.memory.task_peak` counts a task's memory by storage)."""
    from piper_fx.ops import is_alias
    from piper_fx.runtime.memory import storage_key
    from training import plan_all_ranks

    def storages(value) -> set[int]:
        values = value if isinstance(value, (list, tuple)) else [value]
        return {storage_key(v) for v in values if isinstance(v, torch.Tensor)}

    programs, _ = plan_all_ranks(options, world=2, n_layer=2, batch_rows=4)
    return [f"{rank} {name} {node.name}" for rank, program in programs.items()
            for name, task in program.tasks.items() for node in task.graph.graph.nodes
            if is_alias(node) and node.all_input_nodes
            and not storages(node.meta.get("val")) <= storages(node.all_input_nodes[0].meta.get("val"))]


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_every_view_a_planned_task_makes_is_on_the_storage_it_reads(zero):
    """A bucket's merge gives the readers of its outputs new values where their layout changed
    (`collectives.emit.repair_values`); a view's value must also follow its input's storage,
    which the bucket made anew: one left on the storage of the value it read before counted that
    storage again in the task's memory (2.9% over the allocator's peak at ZeRO-3 once a gathered
    bucket was copied out by one op; over 200 views off their storage before, on two ranks).
    So must the readers of a lowered collective (ZeRO-1/2's parameters, gathered in the
    prologue, reached the forward's and backward's tasks with 36 views of them on other
    storages) and the views inside a lowering (ZeRO-1's slice of its padded gradient was on a
    storage of its own, 6 of them)."""
    with processes().Pool(1) as pool:  # the fake group must not leak into other tests
        assert pool.apply(_views_off_their_input, ({"zero": zero, "codegen": "eager"},)) == []


@st.composite
def _reductions(draw):
    numels = draw(st.lists(st.integers(1, 160).map(lambda k: 2048 * k), min_size=1, max_size=10))
    return (draw(st.sampled_from(["all_reduce", "reduce_scatter"])), numels,
            draw(st.sampled_from([0.25, 0.5, 0.75, 1.0, 1.5, 25.0])), draw(st.booleans()))


def test_gradient_buckets_follow_the_policy_for_any_sizes_and_caps():
    # Inductor groups and merges; the pass carves out each run's first bucket of all-reduces (with
    # `small_first`; reduce-scatters bucket by size alone): together they must make exactly the
    # buckets the plain policy makes, for either reduction kind.
    ctx = processes()
    with ctx.Pool(1) as pool:
        @settings(max_examples=30, deadline=None, derandomize=True, database=None)
        @given(case=_reductions())
        def check(case):
            kind, numels, bucket_mb, small_first = case
            got = pool.apply(_reduction_bucket_bytes, case)
            expected = _ddp_buckets([4 * n for n in numels], bucket_mb, small_first and kind == "all_reduce")
            assert got == expected, (case, got)
        check()


def _plan_world_64() -> dict:
    """pp=8 x dp=8 on a fake process group: every rank's program, built in this one process."""
    from piper_fx.ir import Recv, Send
    from training import plan_all_ranks

    options = {"mesh": {"pp": 8, "dp": 8}, "zero": 3, "codegen": "eager",
               "pipeline": {"schedule": "1f1b", "microbatches": 16}}
    programs, seconds = plan_all_ranks(options, world=64, n_layer=8, batch_rows=16)
    sends = {(r, i.peer, i.tag) for r, p in programs.items() for i in p.instructions if isinstance(i, Send)}
    recvs = {(i.peer, r, i.tag) for r, p in programs.items() for i in p.instructions if isinstance(i, Recv)}
    return {"ranks": sorted(programs), "seconds": seconds, "sends": len(sends), "unmatched": len(sends ^ recvs),
            "runs": sum(1 for p in programs.values() for i in p.instructions if type(i).__name__ == "Run")}


def test_planning_all_64_ranks_of_pp8_x_dp8_in_one_process():
    ctx = processes()
    with ctx.Pool(1) as pool:
        result = pool.apply(_plan_world_64)
    assert result["ranks"] == list(range(64))
    assert result["runs"] == 64 * 16 * 2  # each rank: F and B of its stage for every microbatch
    assert result["sends"] > 0 and result["unmatched"] == 0  # every send has its receive on the peer
    assert result["seconds"] < 60, result


def _task_graphs_given_code_while_planning() -> dict:
    """pp=2 x dp=2 ZeRO-3 1F1B on a fake process group: how many of the programs' task graphs
    had Python code generated for them while they were planned (FX's `python_code`, which a
    graph module's eager `recompile()` calls)."""
    import torch.fx as fx

    from training import plan_all_ranks

    generated = []  # the graphs themselves, so no id is reused
    python_code = fx.Graph.python_code

    def counted(graph, *args, **kwargs):
        generated.append(graph)
        return python_code(graph, *args, **kwargs)

    fx.Graph.python_code = counted
    try:
        options = {"mesh": {"pp": 2, "dp": 2}, "zero": 3, "codegen": "inductor",
                   "pipeline": {"schedule": "1f1b", "microbatches": 4}}
        programs, _ = plan_all_ranks(options, world=4, n_layer=4, batch_rows=8)
    finally:
        fx.Graph.python_code = python_code
    given = {id(graph) for graph in generated}
    graphs = [task.graph.graph for program in programs.values() for task in program.tasks.values()]
    return {"tasks": len(graphs), "given code": sum(id(graph) in given for graph in graphs)}


def test_planning_generates_no_python_code_for_the_graphs_it_transforms():
    """A plan's graphs are lazy graph modules: a pass's `recompile()` only marks one, and its
    code is generated when it is run or read (eager codegen, the dumps). Generated each time,
    it took a quarter of the planning of a GPT of 24 blocks."""
    ctx = processes()
    with ctx.Pool(1) as pool:
        result = pool.apply(_task_graphs_given_code_while_planning)
    assert result["tasks"] > 0 and result["given code"] == 0, result


def _gathers_overlapping_compute(overlap: bool) -> dict:
    """Per task of ZeRO-3 at world 2: how many all-gathers have matmuls running between issue and wait."""
    from piper_fx.ops import collective_kind
    from training import plan_all_ranks

    options = {"zero": 3, "codegen": "eager", "overlap": overlap, "prefetch": 1}
    programs, _ = plan_all_ranks(options, world=2, n_layer=4, batch_rows=4)
    ops = torch.ops._c10d_functional
    counts = {}
    for task in programs[0].tasks.values():
        nodes = list(task.graph.graph.nodes)
        position = {n: i for i, n in enumerate(nodes)}
        overlapped = 0
        for node in nodes:
            if collective_kind(node) == "all_gather":
                (wait,) = [u for u in node.users if u.target is ops.wait_tensor.default]
                between = nodes[position[node] + 1:position[wait]]
                overlapped += any(n.target in (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
                                  for n in between)
        counts[task.name] = overlapped
    return counts


def test_overlap_prefetches_each_layers_gather_during_the_previous_layer():
    ctx = processes()
    with ctx.Pool(1) as pool:
        on, off = pool.map(_gathers_overlapping_compute, (True, False))
    assert off == {"F0": 0, "B0": 0}, off  # each gather waited right where it is issued
    # Forward: the 4 blocks' and the final layer norm's gathers each run during the layer before;
    # backward: the blocks' gathers, in reverse, likewise.
    assert on["F0"] >= 4 and on["B0"] >= 4, on


def _reductions_overlapping_compute(zero: int) -> dict:
    """The gradient reductions of ZeRO-`zero`'s backward at world 2, in buckets of a few
    gradients: how many are issued before the task's last matmul, and how many of those
    have a matmul between their issue and their wait."""
    from training import plan_all_ranks

    options = {"zero": zero, "codegen": "eager", "bucket_mb": 0.005}
    programs, _ = plan_all_ranks(options, world=2, n_layer=2, batch_rows=4)
    ops = torch.ops._c10d_functional
    matmuls = (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)
    nodes = list(programs[0].tasks["B0"].graph.graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    last_matmul = max(position[n] for n in nodes if n.target in matmuls)
    issued = overlapped = 0
    for node in nodes:
        if node.op == "call_function" and node.target in (ops.all_reduce.default, ops.reduce_scatter_tensor.default):
            (wait,) = [u for u in node.users if u.target is ops.wait_tensor.default]
            issued += position[node] < last_matmul
            overlapped += any(n.target in matmuls for n in nodes[position[node] + 1:position[wait]])
    return {"issued before the last matmul": issued, "overlapped": overlapped}


@pytest.mark.parametrize("zero", [0, 2])
def test_each_gradient_reduction_overlaps_the_rest_of_the_backward(zero):
    # A bucket's wait moves with its per-gradient views, which read nothing: the reductions wait
    # at the backward's end, so each runs while the backward computes the earlier layers' gradients.
    ctx = processes()
    with ctx.Pool(1) as pool:
        counts = pool.apply(_reductions_overlapping_compute, (zero,))
    assert counts["issued before the last matmul"] >= 5, counts  # buckets of 5 KB: 2 layers make several
    assert counts["overlapped"] == counts["issued before the last matmul"], counts


def _ddp_reductions_by_task(microbatches: int) -> dict:
    from training import plan_all_ranks

    options = {"codegen": "eager", "bucket_mb": 1e-9, "pipeline": {"microbatches": microbatches}}
    programs, _ = plan_all_ranks(options, world=2, n_layer=2, batch_rows=4)
    return {name: _counts(ops)["all_reduce"]
            for name, ops in _collectives_by_task(programs[0].render()).items()}


def test_ddp_with_microbatches_reduces_the_summed_gradient_once_at_the_end():
    with processes().Pool(1) as pool:
        one, two = pool.map(_ddp_reductions_by_task, (1, 2))
    untied = PARAMS + 1  # plan_all_ranks' GPT has its own lm_head weight
    assert one == {"F0": 0, "B0": untied}  # in the backward, as each gradient completes
    assert two == {"F0": 0, "B0": 0, "E0": untied}  # no_sync, then once on the sum


def _traces_of_two_compiles_of_one_model() -> dict:
    """The example GPT with experts shared over ep 2, under ZeRO-3, planned twice in one
    process (a fake group of 2; each plan from its own Dynamo trace and capture, as a
    recompile or a test's next model makes): how many lowerings and buckets each plan
    traced, whether the two plans' task graphs are the same, how many of the second's graphs
    hold values (in any metadata) of two fake modes, how many kept layouts stand for values
    in them, and how many fake tensors the kept traces hold."""
    import importlib

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from training import plan_programs

    emit = importlib.import_module("piper_fx.collectives.emit")
    bucket_collectives = importlib.import_module("piper_fx.passes.bucket_collectives")  # the module, not the pass

    traced = []
    make_fx, trace_bucket = emit.make_fx, bucket_collectives.trace_bucket

    def counting(original):
        def traced_by(*args, **kwargs):
            traced[-1] += 1
            return original(*args, **kwargs)
        return traced_by

    emit.make_fx, bucket_collectives.trace_bucket = counting(make_fx), counting(trace_bucket)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    plans = []
    try:
        for _ in range(2):
            torch._dynamo.reset()  # a compile of its own: Dynamo's trace and capture anew
            traced.append(0)
            plans.append(plan_programs({"zero": 3, "codegen": "eager", "mesh": {"dp": 2, "ep": 2}}, n_layer=2,
                                       batch_rows=4, experts=4)[0])
    finally:
        dist.destroy_process_group()
        emit.make_fx, bucket_collectives.trace_bucket = make_fx, trace_bucket

    def graphs(programs: dict) -> list:
        return [task.graph.graph for program in programs.values() for task in program.tasks.values()]

    foreign = layouts = 0
    for graph in graphs(plans[1]):
        leaves = [v for n in graph.nodes for v in torch.utils._pytree.tree_leaves(n.meta)]
        foreign += len({id(v.fake_mode) for v in leaves if isinstance(v, FakeTensor)}) > 1
        layouts += sum(isinstance(v, emit._Like) for v in leaves)
    kept = [*emit._TRACED.graphs(), *bucket_collectives._TRACES.graphs()]
    return {"traced": traced, "same graphs": [str(g) for g in graphs(plans[0])] == [str(g) for g in graphs(plans[1])],
            "graphs of two fake modes": foreign, "kept layouts in graphs": layouts,
            "kept fake tensors": sum(isinstance(v, FakeTensor) for gm in kept for n in gm.graph.nodes
                                     for v in torch.utils._pytree.tree_leaves(n.meta))}


def test_a_later_compile_of_the_same_shapes_traces_no_lowering_or_bucket_again():
    """The lowerings' and buckets' traces (make_fx, 10-40 ms each) are kept for the process
    without their values: a second compile of the same model traces none, plans the same
    graphs, and each value of its graphs is of its own fake mode; no kept trace holds a fake
    tensor (it would keep the first compile's fake mode alive)."""
    with processes().Pool(1) as pool:  # the fake group must not leak into other tests
        result = pool.apply(_traces_of_two_compiles_of_one_model)
    assert result["traced"][0] > 0 and result["traced"][1] == 0, result
    assert result["same graphs"] and result["graphs of two fake modes"] == result["kept layouts in graphs"] == 0, result
    assert result["kept fake tensors"] == 0, result
