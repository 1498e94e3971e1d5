"""Checks of a compiled call's arguments, made before anything is planned: that a rank's
model and batch are on one device, and that the ranks that exchange messages sized by the
batch were called with batches of the same shapes. Each raises a `PiperError` naming what
differs."""
from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch import nn

from .errors import PiperError
from .options import Strategy
from .runtime import failures
from .sharding.mesh import rank_groups, strategy_mesh


def check_one_device(example_inputs: list) -> torch.device | None:
    """The device of the model's parameters, where this rank computes: raise a
    `PiperError` naming both devices if the parameters span several, or if a
    batch input (or buffer) is on another."""
    params = [(i, t) for i, t in enumerate(example_inputs) if isinstance(t, nn.Parameter)]
    if not params:
        return None
    first, device = params[0][0], params[0][1].device
    for index, t in params[1:]:
        if t.device != device:
            raise PiperError(f"the model's parameters are on devices {device} (compiled argument {first}) and "
                             f"{t.device} (compiled argument {index}): piper_fx runs a rank's model on one "
                             f"device; move the model there (model.to('{device}'), before piper_fx.prepare)")
    for index, t in enumerate(example_inputs):
        if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter) and t.device != device:
            unmade = ("; parameters on the meta device have no memory yet: give them memory and values "
                      "(model.to_empty(device=...) after piper_fx.prepare, then initialise or load them) "
                      "before compiling") if device.type == "meta" else ""
            raise PiperError(f"compiled argument {index} is on device {t.device}, but the model's parameters "
                             f"are on {device}: move it to the model's device (.to('{device}')){unmade}")
    return device


# Why the ranks of one group along a mesh dimension must be called with batches of the same shapes.
_BATCH_SIZED_MESSAGES = {
    "pp": "the ranks of a pipeline (mesh dimension pp) run their stages on the same microbatches, and the "
          "activations and gradients they send each other are sized by them",
    "ep": "the ranks sharing out the experts (mesh dimension ep) send each other the tokens routed to their "
          "experts, in messages sized by the batch",
}


def check_batches_agree(strategy: Strategy, shapes: dict[int, tuple[int, ...]], together: bool) -> None:
    """Raise a `PiperError` before anything is planned if the ranks of one pipeline, or of one
    expert-parallel group, were called with batches of different shapes (`shapes`: this rank's,
    `capture.batch_shapes`): the messages they exchange are sized by the batch, and one of
    another size than its receiver posted ends the process (gloo) or hangs it (NCCL). Replicas
    of data parallelism alone may differ, as under DDP: each averages its own batch.

    Collective: over every rank at a model's first compile (`together`), which they all make at
    once, so that every rank raises, those of groups that agree too; at a later one for a batch
    shape new to this rank, over its pipeline and expert groups, whose ranks compile for a new
    shape at the same call (`_later_shapes`)."""
    dims = [dim for dim, size in (("pp", strategy.pp), ("ep", strategy.ep)) if size > 1]
    if not dims:
        return
    everyone: dict[int, dict] = {}
    if together:
        gathered: list = [None] * strategy.world_size
        dist.all_gather_object(gathered, shapes)
        everyone.update(enumerate(gathered))
        groups = [(dim, ranks) for dim in dims for ranks in rank_groups(strategy, dim)]
    else:
        groups = []
        for dim in dims:
            ranks = dist.get_process_group_ranks(strategy_mesh(strategy, dim).get_group())
            everyone.update(_later_shapes(shapes, dim, ranks))
            groups.append((dim, ranks))
    for dim, ranks in groups:
        if len({batch_key(everyone[rank]) for rank in ranks}) > 1:  # ranks may index their arguments apart
            by_rank = "; ".join(f"rank {rank}: " + ", ".join(f"compiled argument {index} of shape {shape}"
                                                              for index, shape in everyone[rank].items())
                                for rank in ranks)
            raise PiperError(f"{_BATCH_SIZED_MESSAGES[dim]}, so they must be called with batches of the same "
                             f"shapes; got {by_rank}")


def _later_shapes(shapes: dict[int, tuple[int, ...]], dim: str, ranks: list[int]) -> dict[int, dict]:
    """The batch shapes of each of `ranks` (this rank's group along mesh dimension `dim`) at a
    later compile of this rank's: each writes its own to the process group's store, under the
    number of the coming step call, and waits for the others'. A peer called with shapes it has
    a step for runs that step instead, blocked on this rank: when the others' shapes are not
    there within half the store's timeout (the process group's), sooner than that peer's own
    receive gives up, this rank raises a `PiperError` saying why, recorded for the peers
    (`failures.raise_failure`), which then name it."""
    store, call, rank = dist.group.WORLD.get_group_store(), failures.upcoming_call(), dist.get_rank()
    key = f"piper_fx/later_batch_shapes/{call}/" + "{}"
    store.set(key.format(rank), json.dumps(list(shapes.items())))
    try:
        store.wait([key.format(peer) for peer in ranks], store.timeout / 2)
    except Exception as error:  # noqa: BLE001 - the store's timeout, whatever its type
        try:
            shown = ", ".join(f"compiled argument {index} of shape {shape}" for index, shape in shapes.items())
            raise PiperError(f"this rank was called with batch shapes new to it ({shown}) and compiles a step for "
                             f"them, but the other ranks of its group along mesh dimension {dim} (ranks {ranks}) did "
                             f"not compile one at this call within {store.timeout.total_seconds() / 2:.0f} s: "
                             f"{_BATCH_SIZED_MESSAGES[dim]}, "
                             f"so they must be called with batches of the same shapes; a rank called with shapes it "
                             f"has a step for runs that step, and waits for this rank") from error
        except PiperError as refused:
            failures.raise_failure(refused, rank, call, "compiling a step for a new batch shape", started=False)
    return {peer: {index: tuple(shape) for index, shape in json.loads(store.get(key.format(peer)))}
            for peer in ranks}


def batch_key(shapes: dict[int, tuple[int, ...]]) -> tuple:
    """A batch's shapes (`capture.batch_shapes`) in argument order, whatever the indices Dynamo
    gave the arguments (they differ between the ranks of expert parallelism, and may between
    compiles)."""
    return tuple(shapes.values())
