"""Units: the repeated layers of a model (FSDP's wrapping units), found in the captured graph.

ZeRO-3 gathers the parameters of a unit together (one bucket) and holds at
most `prefetch + 1` units at once; activation checkpointing is to recompute by
the same units. A unit is a module, found for each parameter *read*: a forward
node that reads a parameter (a ZeRO marker, or the op itself for a replicated
parameter), in the modules whose forward runs it (Dynamo's `nn_module_stack`):

- By default, the unit is the outermost of those modules that is a child of a
  module list, i.e. whose name ends in an index: `blocks.3`, `model.layers.3`
  (Hugging Face), `transformer.h.0` (GPT-2), at any depth. Lists inside a unit
  (experts in a block) are part of it.
- With the option `units`, the unit is the outermost of those modules that a
  pattern names, by class (`"LlamaDecoderLayer"`) or by an fnmatch pattern on
  its name (`"model.layers.*"`), as FSDP2 users wrap `model.layers[i]`. A
  pattern naming no module that reads parameters is a `PiperConfigError`.

A read in no unit (embeddings, final norm, head) is *outside units* and is
gathered with the other reads of the module that reads it (`wte`, `model.norm`,
`lm_head`). Units follow reads, not parameters: a tied weight read by two
modules (a GPT's token embedding and its output head) is read, and gathered,
in each.

Module names are those of `named_modules()` of the compiled model (the module
given to `torch.compile`, or the one a compiled function calls); the model
itself is never a unit. A sharded parameter is read by the module that holds
it (its read runs in that module: `read_through.read_through`); the modules
of a user's own parametrization do not count.
"""
from __future__ import annotations

import fnmatch
import functools
import re
from dataclasses import dataclass
from typing import Callable

import torch.fx as fx

from ..errors import PiperConfigError
from ..ir import GraphInput, InputRole, TrainingDAG, forward_nodes

# Dynamo names a module by its source: `L['self'].model.layers.0`, where the
# first part is the compiled model itself (`L[...]` a local, `G[...]` a global).
_ROOT = re.compile(r"^[A-Z]\[(['\"]).*?\1\]\.?")
_INDEX = re.compile(r"(?<![^.])\d+(?![^.])")  # a whole name component that is an index


@dataclass(frozen=True)
class ParameterRead:
    """A forward node that reads a parameter, and where in the model it does."""

    node: fx.Node
    parameter: GraphInput
    module: str        # the innermost module whose forward reads it ("" for the model itself)
    unit: str | None   # the unit it is read in; None outside units
    numel: int         # of the full (unsharded) parameter
    nbytes: int

    @property
    def group(self) -> str:
        """What a gather for this read shares a bucket with: its unit, or outside units its module."""
        return self.module if self.unit is None else self.unit


@dataclass(frozen=True)
class Units:
    """The parameter reads of a captured graph, each with its unit."""

    reads: tuple[ParameterRead, ...]
    found_by: str  # how: the option's patterns, or the module lists found

    @functools.cached_property
    def _by_node(self) -> dict[fx.Node, ParameterRead]:
        return {read.node: read for read in self.reads}

    def group(self, node: fx.Node) -> str:
        """`ParameterRead.group` of the read at `node` (a node reading a parameter)."""
        return self._by_node[node].group

    def units(self) -> dict[str, list[ParameterRead]]:
        """Each unit, in order of first read, with one read of each parameter it reads."""
        return _distinct_parameters(r for r in self.reads if r.unit is not None)

    def outside(self) -> dict[str, list[ParameterRead]]:
        """Each module reading parameters outside units, with one read of each."""
        return _distinct_parameters(r for r in self.reads if r.unit is None)

    def render(self) -> str:
        """`units.txt`: each unit, then each module reading parameters outside units, with the
        count, elements and bytes of the parameters it reads."""
        units, outside = self.units(), self.outside()
        lines = [f"# units: {self.found_by}",
                 "# ZeRO-3 gathers each unit's parameters together and holds at most prefetch + 1 units at once,",
                 "# besides the parameters outside units (each gathered with the module reading it).",
                 "# parameters: count, elements and bytes of the full (unsharded) tensors"]
        if units:
            largest = max(units, key=lambda name: _bytes(units[name]))
            lines.append(f"{len(units)} units, largest {largest} ({_bytes(units[largest])} bytes)")
        else:
            lines.append("no units: every module is gathered on its own (name the units with the option 'units')")
        lines += _table("unit", units, relative=True)
        parameters = {r.parameter.name: r for reads in outside.values() for r in reads}
        lines.append(f"outside units: {len(parameters)} parameters, {_bytes(parameters.values())} bytes")
        lines += _table("module", outside, relative=False)
        return "\n".join(lines) + "\n"


def find_units(dag: TrainingDAG) -> Units:
    """The unit of every forward read of a parameter in `dag`'s joint graph, per `dag.strategy.units`.

    Raises `PiperConfigError` (key `units`) for a pattern that names no module
    reading parameters: the same model on every rank raises on every rank.
    """
    patterns = dag.strategy.units
    parameters = {i.name: i for i in dag.inputs if i.role in (InputRole.PARAM, InputRole.PARAM_SHARD)}
    forward = forward_nodes(dag)
    is_unit = _unit_test(patterns)
    reads, modules = [], {}
    for node in dag.joint.graph.nodes:
        if node.op != "call_function" or node not in forward:
            continue
        for source in node.all_input_nodes:
            parameter = parameters.get(source.name)
            if parameter is None:
                continue
            path = _module_path(node)
            modules.update(path)
            unit = next((name for name, cls in path if is_unit(name, cls)), None)
            numel, nbytes = _full_size(parameter, source)
            reads.append(ParameterRead(node, parameter, path[-1][0] if path else "", unit, numel, nbytes))
    if patterns is not None:
        unmatched = [p for p in patterns if not any(_names(p, name, cls) for name, cls in modules.items())]
        if unmatched:
            names = list(dict.fromkeys(_INDEX.sub("*", name) for name in modules))
            raise PiperConfigError(
                "units", list(patterns),
                f"patterns each naming a module that reads parameters in the compiled model, by class or by an "
                f"fnmatch pattern on its name; {unmatched} name none. Its classes are "
                f"{sorted(set(modules.values()))}, its names {names[:12]}{' ...' if len(names) > 12 else ''}")
        found_by = f"options['units'] = {list(patterns)}"
    else:
        lists = list(dict.fromkeys(r.unit.rpartition(".")[0] or "(the model)" for r in reads if r.unit is not None))
        found_by = (f"found automatically, the children of the module lists {lists}" if lists
                    else "found automatically: the model has no module list")
    return Units(tuple(reads), found_by)


def unit_of(node: fx.Node, patterns: tuple[str, ...] | None, stack: str = "nn_module_stack") -> str | None:
    """The unit whose forward runs `node` (the outermost module on its `stack`, by default
    its `nn_module_stack`, that is a unit, found as `find_units` finds them), or None
    outside units."""
    is_unit = _unit_test(patterns)
    return next((name for name, cls in _module_path(node, stack) if is_unit(name, cls)), None)


def layer_of(node: fx.Node, patterns: tuple[str, ...] | None) -> str | None:
    """The unit whose forward runs `node`, or whose forward the backward node `node`
    differentiates (AOTAutograd's `fwd_nn_module_stack`), or None outside units."""
    return unit_of(node, patterns, "nn_module_stack" if node.meta.get("nn_module_stack") else "fwd_nn_module_stack")


def _unit_test(patterns: tuple[str, ...] | None) -> Callable[[str, str], bool]:
    """Whether a module (name, class name) is a unit: by default a child of a module list, else one
    that a pattern of the option `units` names."""
    return _is_list_child if patterns is None else lambda name, cls: any(_names(p, name, cls) for p in patterns)


def _is_list_child(name: str, cls: str) -> bool:
    return name.rpartition(".")[2].isdigit()


def _names(pattern: str, name: str, cls: str) -> bool:
    """Whether a `units` pattern names the module `name` of class `cls`."""
    return cls == pattern or fnmatch.fnmatchcase(name, pattern)


def _module_path(node: fx.Node, key: str = "nn_module_stack") -> list[tuple[str, str]]:
    """(name, class name) of each module whose forward runs `node` (on its `key`: the
    `nn_module_stack`), outermost first, the model itself and the modules of a
    parametrization left out."""
    path = []
    for source, cls in (node.meta.get(key) or {}).values():
        cls = cls.__name__ if isinstance(cls, type) else str(cls).rpartition(".")[2]
        if cls == "ParametrizationList":  # what follows turns a stored tensor into the parameter
            break
        name = _ROOT.sub("", source, count=1)
        if name:
            path.append((name, cls))
    return path


def _full_size(parameter: GraphInput, placeholder: fx.Node) -> tuple[int, int]:
    val = placeholder.meta["val"]
    numel = val.numel()
    if parameter.sharded is not None:
        numel = 1
        for size in parameter.sharded.layout.full_shape:
            numel *= size
    return numel, numel * val.element_size()


def _distinct_parameters(reads) -> dict[str, list[ParameterRead]]:
    groups: dict[str, dict[str, ParameterRead]] = {}
    for read in reads:
        groups.setdefault(read.group, {}).setdefault(read.parameter.name, read)
    return {group: list(by_parameter.values()) for group, by_parameter in groups.items()}


def _bytes(reads) -> int:
    return sum(r.nbytes for r in reads)


def _table(title: str, groups: dict[str, list[ParameterRead]], relative: bool) -> list[str]:
    """One row per group: its parameter count, elements and bytes, and the parameters' names
    (relative to a unit; a tied parameter by the name it has in the reading module)."""
    if not groups:
        return []
    width = max(len(title), *(len(name) for name in groups))
    rows = [f"  {title:<{width}}  {'parameters':>10}  {'elements':>10}  {'bytes':>10}  names"]
    for group, reads in groups.items():
        names = [_name_in(r, group, relative) for r in reads]
        rows.append(f"  {group or '(the model)':<{width}}  {len(reads):>10}  {sum(r.numel for r in reads):>10}  "
                    f"{_bytes(reads):>10}  {' '.join(names)}")
    return rows


def _name_in(read: ParameterRead, module: str, relative: bool) -> str:
    holders = read.parameter.sharded.fqns if read.parameter.sharded is not None else (read.parameter.fqn,)
    prefix = f"{module}." if module else ""
    name = next((n for n in holders if n and n.startswith(prefix)), None)
    if name is None:  # read by a module that does not hold it (e.g. a weight tied across modules)
        return holders[0] or read.parameter.name
    return name[len(prefix):] if relative else name
