"""Regions: a task cut between the layers it runs, each distinct region compiled once."""

import pytest
import torch
import torch.fx as fx

from piper_fx.codegen import regions
from piper_fx.codegen.shared import code_key
from piper_fx.ops import LAYER


def _layered(n_layers: int, head: bool = True) -> fx.GraphModule:
    """h -> relu(h @ w_i) + h per layer (each node marked with its layer), then a head
    matmul outside layers; with example values on every node, as a task's graph has."""
    graph = fx.Graph()
    h = graph.placeholder("x")
    weights = [graph.placeholder(f"w{i}") for i in range(n_layers)]
    for i, w in enumerate(weights):
        mm = graph.call_function(torch.ops.aten.mm.default, (h, w))
        relu = graph.call_function(torch.ops.aten.relu.default, (mm,))
        h = graph.call_function(torch.ops.aten.add.Tensor, (relu, h))
        for node in (mm, relu, h):
            node.meta[LAYER] = f"layers.{i}"
    if head:
        h = graph.call_function(torch.ops.aten.mm.default, (h, weights[0]))
    graph.output((h,))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            node.meta["val"] = torch.empty(4, 4)
        elif node.op == "call_function":
            node.meta["val"] = node.target(*[a.meta["val"] for a in node.args])
    return gm


def _boxed(gm: fx.GraphModule):
    def run(args: list):
        values = list(args)
        args.clear()
        return gm(*values)
    return run


def test_a_task_is_cut_between_its_layers_and_runs_as_the_whole_does():
    gm = _layered(4)
    cut = regions.cut(gm)
    assert cut is not None
    assert [len(region.graph.graph.find_nodes(op="call_function", target=torch.ops.aten.mm.default))
            for region in cut.regions] == [1, 1, 1, 2]  # the head stays with the last layer
    keys = [region.key for region in cut.regions]
    assert keys[0] == keys[1] == keys[2] != keys[3], keys
    # Each key, read off the task's nodes, is the key of the region's graph; only the first
    # region of a key is made a graph, which its repeats run.
    assert [code_key(region.graph) for region in cut.regions] == keys
    assert cut.regions[0].graph is cut.regions[1].graph is cut.regions[2].graph is not cut.regions[3].graph
    inputs = [torch.randn(4, 4, generator=torch.Generator().manual_seed(i)) for i in range(5)]
    runner = cut.runner([_boxed(region.graph) for region in cut.regions])
    args = list(inputs)
    (out,) = runner(args)
    assert args == []  # handed over, as a boxed task's inputs are
    torch.testing.assert_close(out, gm(*inputs)[0], rtol=0, atol=0)


def test_each_value_crossing_regions_is_dropped_after_the_last_region_that_reads_it():
    cut = regions.cut(_layered(4))
    written = [slot for region in cut.regions for slot in region.outputs]
    dropped = [slot for region in cut.regions for slot in region.last_read]
    # Every layer's output is read by the next region alone, the last one's is the result.
    assert sorted(dropped) == sorted(set(dropped)), dropped
    assert set(written) - set(dropped) == set(cut.result)
    # The input x is read by layer 0 alone (its mm and its add): dropped after region 0.
    assert 0 in cut.regions[0].last_read


def test_a_task_of_fewer_regions_than_asked_is_compiled_whole():
    assert regions.cut(_layered(4), fewest=5) is None
    assert len(regions.cut(_layered(5), fewest=5).regions) == 5
    assert regions.cut(_layered(2, head=False), fewest=0) is None  # never fewer than FEWEST


def test_a_task_whose_regions_all_differ_is_compiled_whole():
    gm = _layered(2, head=True)  # two regions, one with the head: nothing repeats
    assert regions.cut(gm) is None
    gm = _layered(3, head=False)
    gm.graph.find_nodes(op="placeholder")[2].meta["val"] = torch.empty(4, 4).t()  # another layout
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["val"] = node.target(*[a.meta["val"] for a in node.args])
    keys = [r.key for r in regions.cut(gm).regions]  # layers 0 and 2 alike, layer 1's weight laid out apart
    assert keys[0] == keys[2] != keys[1]


@pytest.mark.parametrize("setting, cut", [(True, True), (False, False), ("auto", True)])  # "auto": a CPU cuts
def test_the_option_regions_decides_whether_a_task_compiles_as_its_layers(setting, cut, monkeypatch):
    """Code generation under Inductor, each unit's compile swapped for eager code generation
    (what is tested is which units there are, not Inductor's C++): with regions, a 4-layer
    GPT's tasks are cut and their middle layers' code repeats; without, every task is one
    unit. The step trains as the model does either way."""
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, global_batch

    import piper_fx
    from piper_fx.codegen import eager, inductor

    monkeypatch.setattr(inductor, "compile_task", lambda unit: eager.compile_task(unit))
    cfg = GPTConfig(**{**SMALL, "n_layer": 4})
    torch.manual_seed(0)
    model, reference = GPT(cfg), GPT(cfg)
    reference.load_state_dict(model.state_dict())
    step = torch.compile(model, backend="piper", options={"regions": setting})
    x, y = global_batch(0, 4, cfg)
    loss = step(x, y)
    loss.backward()
    expected = reference(x, y)
    expected.backward()
    stats = piper_fx.last_compile_stats()
    assert (stats["tasks"].get("repeated", 0) > 0) == cut, stats["tasks"]
    torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
