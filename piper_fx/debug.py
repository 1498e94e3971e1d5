"""Debug dumps: what was compiled, written by the code path that runs it.

Layout under `debug_dir` (option, or env PIPER_DEBUG_DIR):
  rank{r}/graph{g}/00_dynamo_graph.py      the graph Dynamo handed the backend
  rank{r}/graph{g}/01_joint_graph.py       AOTAutograd's joint forward/backward graph
  rank{r}/graph{g}/passes/NN_<pass>.py     the joint graph (or tasks) after each pass
  rank{r}/graph{g}/placement_table.txt     DTensor-style spec of every node
  rank{r}/graph{g}/units.txt               the units (repeated layers) ZeRO-3 gathers one at a time
  rank{r}/graph{g}/program.txt             this rank's program: tasks, values, collectives
  rank{r}/graph{g}/codegen/<task>.py       the code each task runs (Inductor output or FX)
  rank{r}/graph{g}/trace.json              a step as a Chrome / Perfetto trace (the second
                                           step run, or the first if only one ran)
`g` is the id Dynamo gives the compiled frame, as in TORCH_LOGS and tlparse
(`graph0` for frame 0; a recompile of it is `graph0_1`), so it says which
graph it is whatever else the process compiled. A graph planned outside
torch.compile goes to `graph`.
"""
from __future__ import annotations

import os
from pathlib import Path

from .compat import CompileContext


def graph_dir_name() -> str:
    """The dump folder of the graph Dynamo is compiling now (`graph` outside a compile)."""
    compile_id = CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_id is None:
        return "graph"
    frame, recompile = compile_id.frame_id, compile_id.frame_compile_id
    return f"graph{frame}" if not recompile else f"graph{frame}_{recompile}"


class DebugDump:
    """Writes dump files for one compiled graph on one rank; does nothing without a directory."""

    def __init__(self, debug_dir: str | None, rank: int, graph: str | None = None):
        self.root: Path | None = None
        if debug_dir is not None:
            self.root = Path(debug_dir) / f"rank{rank}" / (graph or graph_dir_name())
            self.root.mkdir(parents=True, exist_ok=True)
        # While not None, every file written is also kept here (the plan cache keeps planning's dumps).
        self.recorded: dict[str, str] | None = None

    @property
    def enabled(self) -> bool:
        return self.root is not None

    def beside(self, suffix: str) -> DebugDump:
        """The dump of another compile of the same graph (a step for other batch sizes): a
        folder beside this one, its name with `_suffix`."""
        dump = DebugDump(None, 0)
        if self.root is not None:
            dump.root = self.root.with_name(f"{self.root.name}_{suffix}")
            dump.root.mkdir(parents=True, exist_ok=True)
        return dump

    def write(self, relative_path: str, text: str) -> None:
        if self.root is None:
            return
        if self.recorded is not None:
            self.recorded[relative_path] = text
        path = self.root / relative_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(path.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, path)
