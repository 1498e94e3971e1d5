"""Inductor code generation: `compile_fx_inner` on each task graph.

The graphs are post-AOTAutograd ATen graphs (captured with Inductor's
decomposition table) with `val` metadata on every node, as Inductor expects.
The FX graph cache (TORCHINDUCTOR_CACHE_DIR) is shared across ranks and runs.
"""
from __future__ import annotations


from ..compat import TracingContext, compile_fx_inner, inductor_config, tracing
from ..ir import Task
from ..ops import WAIT, collective_kind
from ..runtime.timing import WaitTimer


def _fake_inputs(task: Task) -> list:
    return [n.meta["val"] for n in task.graph.graph.nodes if n.op == "placeholder"]


def compile_task(task: Task, time_waits: bool = False):
    example_inputs = _fake_inputs(task)
    fake_mode = next((v.fake_mode for v in example_inputs if hasattr(v, "fake_mode")), None)
    # The task's order is the overlap policy (`reorder_for_overlap`, `fuse_overlapped_pairs`):
    # Inductor's reorder for peak memory does not know collectives run asynchronously and
    # would move each wait right after its collective, undoing the overlap.
    has_collectives = any(collective_kind(n) is not None for n in task.graph.graph.nodes)
    with tracing(TracingContext(fake_mode)), inductor_config.patch(reorder_for_peak_memory=not has_collectives):
        compiled = compile_fx_inner(task.graph, example_inputs)
    source = getattr(compiled, "source_code", None) or task.graph.code
    if time_waits and task.graph.graph.find_nodes(op="call_function", target=WAIT):
        return _timing_waits(compiled), source
    return compiled, source


def _timing_waits(compiled):
    """`compiled`, run under a dispatch mode that times its collective waits. The
    mode sees every op the compiled code dispatches (extern kernels), which
    costs a Python call each: hence opt-in (option `profile`)."""
    def run(args: list):
        with WaitTimer():
            return compiled(args)
    return run
