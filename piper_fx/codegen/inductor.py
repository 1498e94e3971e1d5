"""Inductor code generation: `compile_fx_inner` on each task graph.

The graphs are post-AOTAutograd ATen graphs (captured with Inductor's
decomposition table) with `val` metadata on every node, as Inductor expects.
The FX graph cache (TORCHINDUCTOR_CACHE_DIR) is shared across ranks and runs.
"""
from __future__ import annotations

import hashlib
import os
import platform
import sys
import threading
from pathlib import Path

import torch
import torch.fx as fx

from ..compat import (CustomGraphPass, OrderedSet, TracingContext, check_vec_isa, compile_fx_inner,
                      get_hash_for_files, inductor_cache_dir, inductor_config, preserve_node_ordering,
                      supported_vec_isa_list, tracing, valid_vec_isa_list, x86_isa_checker)
from ..ir import Task, is_dense
from ..ops import WAIT, collective_kind
from ..runtime.layouts import laid_out
from ..runtime.timing import WaitTimer


class WarmUp:
    """Inductor's once-per-process work that needs nothing of the tasks, started in a thread
    while the step is planned (or its plan loaded): on a CPU, probing which vector ISA its
    C++ code can be built for, by compiling and loading a test program per ISA feature, each
    in a subprocess (1.4 s on this project's machine with Inductor's cache warm, 9 s cold,
    one after the other). Each ISA's check is independent of the others' (its own
    flags, build and lock) and cached per ISA, so they run side by side, one thread each
    (0.8 s warm, 5 s cold on 2 cores), and `valid_vec_isa_list` then reads their answers.
    Each check ends in a subprocess loading the ISA's test library, which a later process on
    the same machine skips (`LoadedLibraries`): warm, the probe takes about 0.1 s.
    `wait()` before compiling: a compile that started before the probe ended would probe again."""

    def __init__(self, device: torch.device | None):
        self.thread = None
        if device is not None and device.type == "cpu":
            self.thread = threading.Thread(target=_probe_cpu, name="piper_fx inductor warm-up", daemon=True)
            self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None


class LoadedLibraries:
    """The vector ISAs' test libraries that a process on this machine has seen load (the end
    of Inductor's check of each ISA, `compat.check_vec_isa`), as marker files under
    Inductor's cache directory. A marker's name hashes the library's path, size and
    modification time and the machine (host, Python, torch, C library, the features the
    CPU claims): a library built again, or a cache directory shared with another machine,
    is probed afresh. Only loads that succeeded are kept, so a failed check is repeated."""

    def __init__(self, root: Path):
        self.root = root
        self.machine = "\0".join((platform.node(), sys.executable, torch.__file__, torch.__version__,
                                  " ".join(platform.libc_ver()), " ".join(sorted(x86_isa_checker()))))

    def _marker(self, library: str) -> Path:
        status = os.stat(library)
        key = "\0".join((self.machine, library, str(status.st_size), str(status.st_mtime_ns)))
        return self.root / hashlib.sha256(key.encode()).hexdigest()

    def loads(self, library: str) -> bool:
        try:
            return self._marker(library).exists()
        except OSError:
            return False

    def loaded(self, library: str) -> None:
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._marker(library).touch()
        except OSError:  # not kept: the next process probes, as Inductor alone does
            pass


def _probe_cpu() -> None:
    try:
        record = LoadedLibraries(Path(inductor_cache_dir()) / "piper_vec_isa")
        checks = [threading.Thread(target=check_vec_isa, args=(isa, record.loads, record.loaded),
                                   name=f"piper_fx probe {isa}", daemon=True)
                  for isa in _x86_candidates()]
        for check in checks:
            check.start()
        for check in checks:
            check.join()
        valid_vec_isa_list()
    except Exception:  # noqa: BLE001 - not cached then: the first kernel's compile probes again and reports
        pass


def _x86_candidates() -> list:
    """The ISAs `valid_vec_isa_list` checks on this machine: on x86 (Linux or Windows), those
    whose features the CPU claims; elsewhere none to check side by side (one ISA at most)."""
    if sys.platform not in ("linux", "win32") or platform.machine() not in ("x86_64", "AMD64"):
        return []
    claimed = x86_isa_checker()
    return [isa for isa in supported_vec_isa_list if all(feature in claimed for feature in str(isa).split())]


def _fake_inputs(task: Task) -> list:
    return [n.meta["val"] for n in task.graph.graph.nodes if n.op == "placeholder"]


def name_by_position(gm: fx.GraphModule) -> None:
    """Name every value of `gm` by its place (inputs `in0`, `in1`, ..., the rest `v0`, `v1`,
    ...), in place. Tasks that compute the same on other values (a layer of one stage and the
    same layer of another, on this rank or another) then have the same code, hence the same
    key in Inductor's FX graph cache: each distinct task is compiled once, and loaded for
    the others. Nothing to do for a graph named so already."""
    graph = gm.graph
    placeholders = graph.find_nodes(op="placeholder")
    others = [n for n in graph.nodes if n.op not in ("placeholder", "output")]
    if all(n.name == f"in{i}" for i, n in enumerate(placeholders)) and \
            all(n.name == f"v{i}" for i, n in enumerate(others)):
        return
    for index, node in enumerate(placeholders):
        node._rename(f"in{index}")
        node.target = node.name
    for index, node in enumerate(others):
        node._rename(f"v{index}")
    gm.recompile()


class KeepCollectiveOrder(CustomGraphPass):
    """Inductor's last post-grad pass on a task with collectives: each collective depends on
    the one issued before it (`control_deps`), so that the compiled code issues them in the
    task graph's order. The ranks of a group must issue their collectives in one order (gloo
    and NCCL match them by it), and Inductor's scheduler moves one where a fusion pulls it
    (after fusing it sorts the nodes again, from each fused node's inputs): which fusions it
    makes depends on the sizes, so replicas called with batches of different sizes (each
    padded to its own longest row, as DDP allows) issued a ZeRO-3 model's gathers in different
    orders, and stopped. Waits are left where the overlap policy put them. `then`: the
    post-grad passes the user set (`inductor_config.post_grad_custom_post_pass`), run first."""

    def __init__(self, then=None):
        self.then = tuple(then) if isinstance(then, (list, tuple)) else (then,) if then is not None else ()

    def __call__(self, graph: fx.Graph) -> None:
        for theirs in self.then:
            theirs(graph)
        issued = [node for node in graph.nodes if collective_kind(node) is not None]
        preserve_node_ordering(graph, {after: OrderedSet([before]) for before, after in zip(issued, issued[1:])})

    def uuid(self):
        theirs = [p.uuid() if isinstance(p, CustomGraphPass) else None for p in self.then]
        if None in theirs:  # a pass without a uuid: Inductor does not cache the task, as without ours
            return None
        return (get_hash_for_files((__file__,)), *theirs)


def compile_task(task: Task, time_waits: bool = False):
    name_by_position(task.graph)
    example_inputs = _fake_inputs(task)
    fake_mode = next((v.fake_mode for v in example_inputs if hasattr(v, "fake_mode")), None)
    # The task's order is the overlap policy (`reorder_for_overlap`, `fuse_overlapped_pairs`):
    # Inductor's reorder for peak memory does not know collectives run asynchronously and
    # would move each wait right after its collective, undoing the overlap.
    has_collectives = any(collective_kind(n) is not None for n in task.graph.graph.nodes)
    # Each task computes its values in the layouts planning gave them, which the tasks that read
    # them were compiled for: Inductor's layout optimization would make a convolution's output
    # channels-last in the task that computes it and not in the one that reads it, compiled apart
    # (torch.compile compiles a backward after its forward, for the strides the forward made).
    ordered = {"post_grad_custom_post_pass": KeepCollectiveOrder(inductor_config.post_grad_custom_post_pass)} \
        if has_collectives else {}
    with tracing(TracingContext(fake_mode)), inductor_config.patch(reorder_for_peak_memory=not has_collectives,
                                                                   layout_optimization=False, **ordered):
        # Inductor's passes rewrite the graph they compile in place (ours above wraps each
        # collective in a `control_deps`): what the runtime reads of a task's graph is read before.
        compiled = compile_fx_inner(task.graph, example_inputs)
    source = getattr(compiled, "source_code", None) or task.graph.code
    compiled = _laying_out_inputs(compiled, example_inputs)
    if time_waits and has_waits(task):
        return timing_waits(compiled), source
    return compiled, source


def _laying_out_inputs(compiled, example_inputs: list):
    """`compiled`, given each of its inputs that is neither dense nor contiguous as traced
    (broadcast along a dim, or with gaps) in the strides it was compiled for (`laid_out`): a
    task computes its outputs dense, so another task's broadcast view (Falcon's keys expanded
    over the heads, kept for the backward) reaches it as a copy, which its input check
    refuses. The inputs traced dense come as traced (Inductor keeps their order in memory)."""
    layouts = [(index, tuple(value.shape), tuple(value.stride())) for index, value in enumerate(example_inputs)
               if isinstance(value, torch.Tensor) and not is_dense(value.shape, value.stride())]
    if not layouts:
        return compiled

    def run(args: list):
        for index, shape, stride in layouts:
            args[index] = laid_out(args[index], shape, stride)
        return compiled(args)
    return run


def has_waits(task: Task) -> bool:
    """Whether `task` waits for a collective."""
    return bool(task.graph.graph.find_nodes(op="call_function", target=WAIT))


def timing_waits(compiled):
    """`compiled`, run under a dispatch mode that times its collective waits. The
    mode sees every op the compiled code dispatches (extern kernels), which
    costs a Python call each: hence opt-in (option `profile`)."""
    def run(args: list):
        with WaitTimer():
            return compiled(args)
    return run
