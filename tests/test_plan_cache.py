"""The plan cache's key (`piper_fx.plan_cache.plan_key`): what planning reads is in it, what it
does not read is not, and a graph whose text is not the same in every process is not cached;
a plan's fake values come back from its pickle as they went in.
That a plan from the cache trains as the planned one, in the same process and a fresh one, is
`test_compile_stats.py`'s."""
from __future__ import annotations

import torch
from torch import nn

import piper_fx
from piper_fx.options import parse_options
from piper_fx.capture import keep_input_sources
from piper_fx.compat import tree_leaves
from piper_fx.plan_cache import plan_key

GROUPS = (None, None, None, None)


class Net(nn.Module):
    def __init__(self, width: int = 8, annotate: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, 1)
        self.annotate = annotate

    def forward(self, x):
        if self.annotate:
            with piper_fx.annotate("PP"):
                x = self.a(x)
        else:
            x = self.a(x)
        return self.b(torch.relu(x)).sum()


def _graph(model: nn.Module, x: torch.Tensor):
    """The Dynamo graph and example inputs `torch.compile` would hand a backend."""
    seen = []

    def record(gm, example_inputs):
        keep_input_sources(gm)  # as the backend does: Dynamo deletes them once the frame is compiled
        seen.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=record, fullgraph=True)(x)
    return seen[0]


def _key(model=None, x=None, options=None, groups=GROUPS, grad: bool = True):
    torch.manual_seed(0)
    with torch.set_grad_enabled(grad):
        gm, inputs = _graph(model or Net(), torch.randn(4, 8) if x is None else x)
        return plan_key(gm, inputs, parse_options(options or {"codegen": "eager"}), groups)


def test_the_key_is_the_same_for_the_same_graph_inputs_and_strategy():
    first = _key()
    assert first is not None and _key() == first
    # piper_fx's region ids count up over the process: the key has their order alone.
    annotated = _key(model=Net(annotate=True))
    assert annotated is not None and _key(model=Net(annotate=True)) == annotated
    # Options planning does not read: where dumps go, and timing.
    assert _key(options={"codegen": "eager", "debug_dir": "/somewhere", "profile": True}) == first


def test_the_key_changes_with_what_planning_reads():
    first = _key()
    changed = {
        "an option": _key(options={"codegen": "eager", "bucket_mb": 1.0}),
        "another codegen": _key(options={"codegen": "inductor"}),
        "the batch shape": _key(x=torch.randn(6, 8)),
        "a dtype": _key(model=Net().double(), x=torch.randn(4, 8, dtype=torch.float64)),
        "parameters frozen": _key(model=Net().requires_grad_(False)),
        "an annotation": _key(model=Net(annotate=True)),
        "the process groups": _key(groups=("3", None, None, None)),
        "no gradients (inference)": _key(grad=False),
    }
    assert all(key is not None for key in changed.values())
    assert len({first, *changed.values()}) == 1 + len(changed), changed


def test_the_key_has_the_backends_of_the_process_groups(monkeypatch):
    # Planning reads a group's backend (under gloo, one all-gather in flight per group).
    from piper_fx import plan_cache

    keys = set()
    for backend in ("gloo", "nccl"):
        monkeypatch.setattr(plan_cache, "_group_backend", lambda name, backend=backend: name and backend)
        keys.add(_key(groups=("3", None, None, None)))
    assert len(keys) == 2 and None not in keys


def test_a_graph_calling_a_function_defined_in_a_function_is_not_cached():
    @torch._dynamo.allow_in_graph
    def local_scale(x):
        return x * 2

    class Scaled(Net):
        def forward(self, x):
            return super().forward(local_scale(x))

    assert _key(model=Scaled()) is None


def _graph_with_values(values: dict[str, object]) -> torch.fx.GraphModule:
    """A graph returning its inputs, one per entry of `values`, each input's `val` the entry."""
    graph = torch.fx.Graph()
    nodes = [graph.placeholder(name) for name in values]
    graph.output(tuple(nodes))
    for node, value in zip(nodes, values.values()):
        node.meta["val"] = value
    return torch.fx.GraphModule(nn.Module(), graph)


def _layout(fake) -> tuple:
    return (type(fake), tuple(fake.shape), fake.stride(), fake.storage_offset(), fake.untyped_storage().nbytes(),
            fake.dtype, fake.device, fake.requires_grad, fake._is_view())


def _round_trip(values: dict[str, object], *, plain: bool) -> dict[str, object]:
    """`values` as a plan's graph pickles and loads them; `plain`: whether the pickle kept
    each as its layout (`compat._fake_from_layout`) rather than as FX describes it."""
    from piper_fx.compat import FakeTensorMode, ShapeEnv, load_graphs, pickle_graphs
    data = pickle_graphs([_graph_with_values(values)], lambda key: key == "val")
    assert (b"_fake_from_layout" in data) == plain
    loaded = load_graphs(data, FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True))[0]
    return {node.name: node.meta["val"] for node in loaded.graph.find_nodes(op="placeholder")}


def test_a_pickled_plan_keeps_each_fake_value_and_which_values_share_a_storage():
    """Plain fake values (dense, not views) are pickled as their layout and storage; loaded,
    each has its shape, strides, offset, storage size, dtype, device and `requires_grad`, and
    values that shared a storage (one value in two places, or two on one storage) share one."""
    from piper_fx.compat import FakeTensorMode
    with FakeTensorMode():
        whole = torch.empty(4, 8)
        rows = torch.empty(0).set_(whole.untyped_storage(), 8, (2, 8), (8, 1))  # not a view: offset 8
        strided = torch.empty_strided((3, 5), (1, 3), dtype=torch.bfloat16)
        trained = torch.empty(6).requires_grad_()
    values = {"whole": whole, "rows": rows, "again": whole, "strided": strided, "trained": trained,
              "pair": (whole, strided)}
    loaded = _round_trip(values, plain=True)
    for name, value in values.items():
        if name == "pair":
            assert [_layout(v) for v in loaded[name]] == [_layout(v) for v in value]
        else:
            assert _layout(loaded[name]) == _layout(value), name
    storage = loaded["whole"].untyped_storage()._cdata
    assert loaded["again"] is loaded["whole"] and loaded["pair"][0] is loaded["whole"]
    assert loaded["rows"].untyped_storage()._cdata == storage
    assert loaded["strided"].untyped_storage()._cdata != storage
    assert len({v.fake_mode for v in (loaded["whole"], loaded["rows"], loaded["strided"])}) == 1


def test_a_graph_module_is_pickled_without_generating_its_code_and_loads_lazy():
    """A plan's graph modules are lazy (`compat.make_graph_module`): pickling one generates no
    code from its graph (FX's pickler would, and pickle the code's text), and the loaded one is
    lazy too, its code generated when run, the same code and the same result."""
    import torch.fx as fx

    from piper_fx.compat import FakeTensorMode, ShapeEnv, _LazyGraphModule, load_graphs, make_graph_module, \
        pickle_graphs

    traced = fx.symbolic_trace(lambda x, y: torch.relu(x) @ y + 1)
    gm = make_graph_module(traced, traced.graph)
    data = pickle_graphs([gm], lambda key: False)
    assert "_code" not in gm.__dict__ and b"def forward" not in data
    (loaded,) = load_graphs(data, FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True))
    assert isinstance(loaded, _LazyGraphModule) and "_code" not in loaded.__dict__
    x, y = torch.randn(3, 4), torch.randn(4, 2)
    assert torch.equal(loaded(x, y), torch.relu(x) @ y + 1) and loaded.code == traced.code


def test_a_plan_with_a_fake_view_is_pickled_whole_by_fx():
    """A view is not plain: the whole pickle falls back to FX's description of every value,
    which keeps the view a view of its base."""
    from piper_fx.compat import FakeTensorMode
    with FakeTensorMode():
        base = torch.empty(4, 8)
        view = base[1:]
    loaded = _round_trip({"base": base, "view": view}, plain=False)
    assert _layout(loaded["view"]) == _layout(view) and loaded["view"]._is_view()
    assert loaded["view"]._base.untyped_storage()._cdata == loaded["view"].untyped_storage()._cdata


def test_a_plan_loads_in_a_script_other_than_the_one_that_pickled_it():
    """A memory format in a graph (`clone(x, memory_format=torch.contiguous_format)`, as
    decompositions write it) is pickled by its name in torch. Its own reduction is the global
    "torch.contiguous_format", which pickle looks up in the first module that resolves it: in
    a spawned rank, often the script's `__mp_main__`, and the plan then failed to load in
    any other script ("Can't get attribute 'torch.contiguous_format' on <module
    '__mp_main__'>") and was planned again."""
    import pickletools

    from piper_fx.compat import FakeTensorMode, ShapeEnv, load_graphs, pickle_graphs
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.clone.default, (x,),
                                     {"memory_format": torch.contiguous_format}))
    data = pickle_graphs([torch.fx.GraphModule({}, graph)], lambda key: key == "val")
    strings = {arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)}
    assert "torch.contiguous_format" not in strings  # no global that pickle searches the modules for
    loaded = load_graphs(data, FakeTensorMode(shape_env=ShapeEnv(), static_shapes=True))[0]
    (clone,) = loaded.graph.find_nodes(op="call_function", target=torch.ops.aten.clone.default)
    assert clone.kwargs["memory_format"] is torch.contiguous_format


def _values_not_plain(options: dict, world: int) -> list[str]:
    """The values of every rank's program for `options` (the example GPT, planned on a fake
    process group of `world`) that the plan cache cannot pickle by layout."""
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).parent))
    from training import plan_all_ranks

    from piper_fx.compat import _plain_fake
    programs, _ = plan_all_ranks({**options, "codegen": "eager"}, world=world, n_layer=2, batch_rows=8)
    return [f"rank {rank} {name} {node.name}" for rank, program in programs.items()
            for name, task in program.tasks.items() for node in task.graph.graph.nodes
            for value in tree_leaves(node.meta.get("val")) if isinstance(value, torch.Tensor) and not _plain_fake(value)]


def test_every_value_of_a_planned_program_is_pickled_by_its_layout():
    """One value that is not plain (a view, say) sends the whole plan down FX's slower pickle
    (twice the load time of a warm compile's plan): the passes record values as make_fx does,
    detached. Every strategy's buckets, casts and stages, planned, are plain."""
    from ranks import processes
    ctx = processes()
    cases = [({"zero": 3}, 2), ({"zero": 2, "mixed_precision": {"param_dtype": "bfloat16"}}, 2),
             ({"zero": 0, "bucket_mb": 0.01}, 2),
             ({"zero": 1, "mesh": {"pp": 2, "dp": 2}, "pipeline": {"schedule": "1f1b", "microbatches": 4}}, 4)]
    with ctx.Pool(1) as pool:  # one process plans them all, each on a fake group of its own
        for options, world in cases:
            assert pool.apply(_values_not_plain, (options, world)) == [], options
