"""Regions: a task compiled as the layers it runs, each distinct layer once.

A task of a model of N identical layers holds N copies of one layer's forward
(or backward) code, and Inductor's cost is per node: compiling the task whole
costs N layers' code generation where PyTorch, compiling each block with
`Module.compile()` (torchtitan), pays one. So under Inductor a task's graph is
cut, in its own order (the overlap policy's: `reorder_for_overlap`), into one
region per unit it computes (`ops.LAYER`), and regions with the same code and
input layouts (`shared.span_key`) are compiled once and their code run for each;
only the first region of each is made a graph.

Where a cut goes: between the last heavy node (a matmul or an attention) of one
unit and the first heavy node of the next, at the first node of the next unit
(its first prefetched gather, say); what lies between and belongs to no unit
stays with the first. So every layer's region runs what the layer's compute
needs issued alongside it, and the middle layers' regions are the same code.

A task is cut only where that pays: when at least two of its regions are the
same code, and where the option `regions` has it cut (by default every such task
on a CPU, and on an accelerator only a deep one: `codegen.fewest_regions`).
Values cross regions through the runner's slots, each dropped after the last
region that reads it, and a region's inputs are handed over boxed, so the
region frees them at their last use inside it, as the whole task's code would.
A cut that would carry anything but a tensor across (a multi-output op's tuple)
is not made: the task is compiled whole.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx

from ..compat import make_graph_module
from ..ops import LAYER, is_heavy
from .inductor import name_by_position
from .shared import span_key


@dataclass(frozen=True)
class Region:
    """A span of a task's nodes as a graph of its own: it reads the slots `inputs` and writes
    its outputs into the slots `outputs`. The slots `last_read` (read by no later region) are
    emptied before it runs, so its boxed code frees them at their last use inside it. `key`:
    its `shared.span_key`, the same for regions that run the same code, which share one
    `graph` (the first's)."""

    graph: fx.GraphModule
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    last_read: tuple[int, ...]
    key: str


@dataclass(frozen=True)
class Regions:
    """A task cut into regions: the task's inputs are slots 0..len-1; `result` the slots of
    its outputs, in order."""

    regions: tuple[Region, ...]
    slots: int
    result: tuple[int, ...]

    def runner(self, compiled: Sequence[Callable[[list], Sequence[torch.Tensor]]]) -> Callable:
        """The task as one boxed callable, given each region's compiled code (in order)."""
        steps = [(code, region.inputs, region.outputs, region.last_read)
                 for code, region in zip(compiled, self.regions)]
        extra = self.slots
        result = self.result

        def run(args: list) -> list:
            slots = args + [None] * (extra - len(args))
            args.clear()
            for code, inputs, outputs, last_read in steps:
                boxed = [slots[i] for i in inputs]
                for i in last_read:  # the region's code frees them at their last use
                    slots[i] = None
                for i, value in zip(outputs, code(boxed)):
                    slots[i] = value
            return [slots[i] for i in result]
        return run


def spans(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """`gm`'s computing nodes in order, cut between units as the module docstring says."""
    nodes = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]
    heavy = [i for i, n in enumerate(nodes) if is_heavy(n)]
    cuts = []
    for before, after in zip(heavy, heavy[1:]):
        unit, next_unit = nodes[before].meta.get(LAYER), nodes[after].meta.get(LAYER)
        if unit == next_unit or next_unit is None:
            continue
        cut = next((i for i in range(before + 1, after) if nodes[i].meta.get(LAYER) == next_unit), after)
        cuts.append(cut)
    bounds = [0, *cuts, len(nodes)]
    return [nodes[start:end] for start, end in zip(bounds, bounds[1:]) if end > start]


FEWEST = 3  # a repeat needs two regions beside the rest


def cut(gm: fx.GraphModule, fewest: int = FEWEST) -> Regions | None:
    """`gm` as regions, or None where it has fewer than `fewest` (at least `FEWEST`), where
    cutting does not pay (no two regions the same code) or where it would carry a value
    that is not a tensor across a cut."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    if not all(isinstance(n, fx.Node) for n in output.args[0]):
        return None
    parts = spans(gm)
    if len(parts) < max(fewest, FEWEST):
        return None
    placeholders = gm.graph.find_nodes(op="placeholder")
    slot: dict[fx.Node, int] = {node: i for i, node in enumerate(placeholders)}
    part_of = {node: index for index, part in enumerate(parts) for node in part}
    # The last region reading each value (len(parts): the task's output).
    last: dict[fx.Node, int] = {}
    for index, part in enumerate(parts):
        for node in part:
            for source in node.all_input_nodes:
                last[source] = index
    for source in output.all_input_nodes:
        last[source] = len(parts)
    crossing = [n for n, reader in last.items() if n.op != "placeholder" and reader > part_of[n]]
    if not all(isinstance(n.meta.get("val"), torch.Tensor) for n in crossing):
        return None
    for node in crossing:
        slot[node] = len(slot)
    spanned = []  # (inputs, outputs, key) of each part
    for part in parts:
        inside = set(part)
        inputs = list(dict.fromkeys(s for n in part for s in n.all_input_nodes if s not in inside))
        outputs = [n for n in part if n in slot]
        spanned.append((inputs, outputs, span_key(inputs, part, tuple(outputs))))
    if len({key for _, _, key in spanned}) == len(spanned):
        return None
    regions = []
    graphs: dict[str, fx.GraphModule] = {}  # the first region of each key's: a repeat runs its code
    for index, (part, (inputs, outputs, key)) in enumerate(zip(parts, spanned)):
        if key not in graphs:
            graphs[key] = _region_graph(gm, part, inputs, outputs)
        last_read = tuple(slot[s] for s in inputs if last[s] == index)
        regions.append(Region(graphs[key], tuple(slot[s] for s in inputs), tuple(slot[n] for n in outputs),
                              last_read, key))
    result = tuple(slot[n] for n in output.args[0])
    return Regions(tuple(regions), len(slot), result)


def _region_graph(gm: fx.GraphModule, part: list[fx.Node], inputs: list[fx.Node],
                  outputs: list[fx.Node]) -> fx.GraphModule:
    """The nodes `part` of `gm` as a graph taking `inputs` and returning `outputs`, its values
    named by position as `inductor.name_by_position` names them (in a fresh graph: a
    graph's namespace keeps every name it gave, so renaming the copies would add suffixes)."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for index, source in enumerate(inputs):
        env[source] = graph.placeholder(f"in{index}")
        env[source].meta = dict(source.meta)
    for index, node in enumerate(part):
        env[node] = graph.create_node(node.op, node.target, fx.map_arg(node.args, env.__getitem__),
                                      fx.map_arg(node.kwargs, env.__getitem__), f"v{index}", node.type)
        env[node].meta = dict(node.meta)
    graph.output(tuple(env[n] for n in outputs))
    region = make_graph_module(gm, graph)
    name_by_position(region)  # named so already: checks it
    return region


__all__ = ["Region", "Regions", "cut", "spans"]
