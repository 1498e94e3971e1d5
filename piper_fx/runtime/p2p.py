"""A rank program's point-to-point messages: the sends and receives it issues back to back
go out as one batch (`P2PBatch`), each receive fills a buffer of its own (`Receiving`),
each send is held until complete (`Sending`), and each message's work is waited for once
(`Issued`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..ir import Recv, Send, wire_shape
from .layouts import laid_out
from .timing import COMM_WAIT, StepTimeline


class Receiving:
    """A receive: the buffer it fills, and once its batch is issued the work to wait for."""

    def __init__(self, instruction: Recv):
        self.instruction = instruction
        order = instruction.order
        wire = wire_shape(instruction.shape, instruction.broadcast)
        wire = wire if order is None else tuple(wire[dim] for dim in order)
        self.received = torch.empty(wire, dtype=instruction.dtype, device=instruction.device)
        self.issued: tuple[Issued, int] | None = None  # its batch and place in it, once issued
        # The received rows read in `order`: the buffer the message fills, as its readers read it.
        self.buffer = self.received if order is None else self.received.permute(_inverse(order))

    def wait(self, timeline: StepTimeline) -> torch.Tensor:
        """The value as its readers were compiled for it, once it has arrived: the buffer,
        copied into the strides of a value with gaps (`Recv.stride`), expanded along the dims
        it is broadcast along (`Recv.broadcast`)."""
        with timeline.span(f"recv {self.instruction.value}", COMM_WAIT, "recv"):
            batch, message = self.issued
            batch.wait(message)
        value, instruction = self.buffer, self.instruction
        if instruction.stride is not None:
            value = laid_out(value, value.shape, instruction.stride)
        return value.expand(instruction.shape) if instruction.broadcast else value


class Issued:
    """The works of an issued batch of messages, each waited for once (a gloo work waited for
    twice waits for a second completion) and let go of once complete (a send's work holds the
    tensor it sends). With a work per message (backends without coalescing) a message waits
    for its own; with fewer (NCCL's one group), for all."""

    def __init__(self, works: list[dist.Work], messages: int):
        self.works: list[dist.Work | None] = list(works)
        self.per_message = len(works) == messages

    def _works_of(self, message: int) -> range:
        return range(message, message + 1) if self.per_message else range(len(self.works))

    def wait(self, message: int) -> None:
        for index in self._works_of(message):
            if self.works[index] is not None:
                self.works[index].wait()
                self.works[index] = None

    def completed(self, message: int) -> bool:
        for index in self._works_of(message):
            if self.works[index] is not None and not self.works[index].is_completed():
                return False
        for index in self._works_of(message):
            self.works[index] = None
        return True


class P2PBatch:
    """The sends and receives a program issues back to back (one step of its schedule), issued
    together as one `dist.batch_isend_irecv`: under NCCL one group, in which a send and a
    receive between the same two ranks cannot wait for each other (issued one by one on the
    pair's stream, each side's send would wait for a receive queued behind the other's send).
    Backends without coalescing (gloo) issue them one by one, in the same order.

    Issuing is communication time on the `timeline` (kind "p2p issue"), not the runtime's
    own: gloo writes a message's bytes to its transport in the issuing thread (0.15-0.2 ms
    per 128 KB activation on this project's 2-core machine, most of what a pipeline step
    spends outside tasks and waits); under NCCL it is a kernel launch."""

    def __init__(self, timeline: StepTimeline):
        self.timeline = timeline
        self.ops: list[tuple] = []  # each message's `dist.P2POp` arguments (op, tensor, peer, tag)
        self.sends: list[tuple[int, torch.Tensor, int, int]] = []  # (place in the batch, tensor sent, peer, tag)
        self.receives: list[tuple[int, Receiving]] = []
        self.issued = 0  # batches issued this step

    def send(self, wire: torch.Tensor, instruction: Send) -> None:
        self.sends.append((len(self.ops), wire, instruction.peer, instruction.tag))
        self.ops.append((dist.isend, wire, instruction.peer, instruction.tag))

    def receive(self, posted: Receiving) -> None:
        self.receives.append((len(self.ops), posted))
        self.ops.append((dist.irecv, posted.received, posted.instruction.peer, posted.instruction.tag))

    def issue(self) -> list[Sending]:
        """Issue the batch, if any; returns its sends."""
        if not self.ops:
            return []
        with self.timeline.span(f"issue {len(self.ops)} p2p", COMM_WAIT, "p2p issue"):
            ops = [dist.P2POp(op, tensor, peer, tag=tag) for op, tensor, peer, tag in self.ops]
            issued = Issued(dist.batch_isend_irecv(ops), len(ops))
        for message, posted in self.receives:
            posted.issued = (issued, message)
        sends = [Sending(issued, message, wire, peer, tag) for message, wire, peer, tag in self.sends]
        self.ops, self.sends, self.receives = [], [], []
        self.issued += 1
        return sends


@dataclass(frozen=True)
class Sending:
    """A send in flight: its batch, its place in it, the tensor it sends, its peer and its tag."""

    batch: Issued
    message: int
    wire: torch.Tensor
    peer: int
    tag: int


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return tuple(inverse)


def wire_tensor(tensor: torch.Tensor, send: Send) -> torch.Tensor:
    """What a send puts on the wire: `tensor`'s first element along each dim it is broadcast
    along (`Send.broadcast`), in its memory order (`Send.order`), contiguous."""
    for dim in send.broadcast:
        tensor = tensor.narrow(dim, 0, 1)
    return (tensor if send.order is None else tensor.permute(send.order)).contiguous()
