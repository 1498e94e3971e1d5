"""Per-rank checks of `collectives.redistribute` (run inside `run_ranks`)."""
from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from piper_fx.collectives.redistribute import LOWERINGS, REDISTRIBUTE, Redistribution, placement_name
from piper_fx.passes import dump_path, lower_redistributions, position, reduce_gradients
from piper_fx.sharding.row_shard import RowShardLayout

ROWS, COLS = 5, 3  # 5 rows do not divide by 2 ranks: the last shard is padded


def _ours(x: torch.Tensor, src, dst, global_shape, rank: int, world: int) -> torch.Tensor:
    return REDISTRIBUTE(x, placement_name(src), placement_name(dst), dist.group.WORLD.group_name, world, rank,
                        list(global_shape))


def against_dtensor(rank: int, world: int) -> dict:
    """Each row of the table, run eagerly, against DTensor's `redistribute` of the same placements.
    Returns, per change, the max difference (ZeRO's padding rows cut)."""
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    full = torch.randn(ROWS, COLS, generator=g)                       # the same on every rank
    partial = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(10 + rank))  # this rank's addend
    layout = RowShardLayout((ROWS, COLS), world)
    valid = DTensor.from_local(layout.shard_of(full, rank), mesh, [Shard(0)], run_check=False,
                               shape=torch.Size((ROWS, COLS)), stride=(COLS, 1)).to_local().shape[0]
    differences = {}

    def compare(name, ours, theirs):
        differences[name] = (ours[: theirs.shape[0]] - theirs).abs().max().item() if theirs.numel() else 0.0

    ours = _ours(layout.shard_of(full, rank), Shard(0), Replicate(), (ROWS, COLS), rank, world)
    compare("Shard(0)->Replicate()", ours, distribute_tensor(full, mesh, [Shard(0)]).redistribute(
        mesh, [Replicate()]).to_local())
    theirs = DTensor.from_local(partial, mesh, [Partial("avg")]).redistribute(mesh, [Shard(0)]).to_local()
    ours = _ours(partial, Partial("avg"), Shard(0), (ROWS, COLS), rank, world)
    assert ours.shape[0] == layout.shard_rows and theirs.shape[0] <= valid + layout.shard_rows
    compare("Partial(avg)->Shard(0)", ours, theirs)
    compare("Partial(avg)->Replicate()", _ours(partial, Partial("avg"), Replicate(), (ROWS, COLS), rank, world),
            DTensor.from_local(partial, mesh, [Partial("avg")]).redistribute(mesh, [Replicate()]).to_local())
    compare("Replicate()->Shard(0)", _ours(full, Replicate(), Shard(0), (ROWS, COLS), rank, world),
            distribute_tensor(full, mesh, [Replicate()]).redistribute(mesh, [Shard(0)]).to_local())
    # The block matrix B[source][destination] of 2-row blocks: this rank sends its row, gets its column.
    blocks = torch.randn(world, world * 2, COLS, generator=g)       # the same global value on every rank
    theirs = DTensor.from_local(blocks[rank: rank + 1], mesh, [Shard(0)], run_check=False,
                                shape=blocks.shape, stride=blocks.stride()).redistribute(mesh, [Shard(1)]).to_local()
    ours = _ours(blocks[rank], Shard(0), Shard(1), blocks.shape, rank, world)
    compare("Shard(0)->Shard(1)", ours, theirs.reshape(ours.shape))
    return differences


def collectives_of_each_row(rank: int, world: int) -> dict:
    """Each row's code traced on fake tensors: the collective kinds it issues."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from piper_fx.ops import collective_kind

    kinds = {}
    for (src, dst), lowering in LOWERINGS.items():
        shape = (world, world * 2, COLS) if dst == Shard(1) else (ROWS, COLS)
        change = Redistribution(src, dst, dist.group.WORLD.group_name, world, rank, shape)
        with FakeTensorMode():
            x = torch.empty(change.local_shape(src))
            traced = make_fx(lowering.code(change))(x)
            out = next(n for n in traced.graph.nodes if n.op == "output").args[0]
            assert tuple(out.meta["val"].shape) == change.local_shape(dst), (src, dst)
        found = [collective_kind(n) for n in traced.graph.nodes if collective_kind(n)]
        kinds[f"{placement_name(src)}->{placement_name(dst)}"] = (lowering.kind, found)
    return kinds


MARKER = re.compile(r"piper\.redistribute\.default\(\w+, '([^']+)', '([^']+)'")
COLLECTIVE = re.compile(r"_c10d_functional\.(all_gather_into_tensor|reduce_scatter_tensor|all_reduce|"
                        r"all_to_all_single)\.default")


def stated_then_lowered(rank: int, world: int, debug_dir: str) -> list:
    """Train one step of the example GPT at dp2 under each ZeRO level; from the dumps, the
    placement changes stated before `lower_redistributions` and the collectives after it."""
    import piper_fx
    from examples.gpt import GPT, GPTConfig
    from training import SMALL, global_batch

    found = []
    for zero in (0, 1, 3):
        torch.manual_seed(0)
        model = GPT(GPTConfig(**SMALL))
        options = {"zero": zero, "codegen": "eager", "debug_dir": f"{debug_dir}/zero{zero}"}
        piper_fx.prepare(model, options)
        x, y = global_batch(0, 2, model.cfg)
        torch.compile(model, backend="piper", options=options)(x, y).backward()
        torch._dynamo.reset()
        (graph_dir,) = (Path(debug_dir) / f"zero{zero}" / f"rank{rank}").iterdir()
        stated = (graph_dir / dump_path(position(reduce_gradients), "reduce_gradients")).read_text()
        lowered = (graph_dir / dump_path(position(lower_redistributions), "lower_redistributions")).read_text()
        found.append({"zero": zero, "stated": MARKER.findall(stated), "collectives_before": COLLECTIVE.findall(stated),
                      "lowered": COLLECTIVE.findall(lowered), "markers_after": MARKER.findall(lowered)})
    return found
