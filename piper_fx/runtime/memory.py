"""Where a rank's memory goes, and a measure of live tensor bytes of chosen ops.

`MEMORY_PARTS` are the parts of a step's peak memory that `last_step_stats()`
reports (`memory`): the executor tracks the values it holds by part as they
come and go; `task_peak` estimates what a task holds inside itself from its
graph; `optimizer_state_bytes` is what optimizers hold for a
parameter, recorded after each optimizer step.

`LiveStorageBytes` is a dispatch mode that follows the storages produced by
the ops it is told to watch (e.g. the all-gathers that materialize full
parameters) and every tensor that later aliases them, counting a storage's
bytes from creation until the last tensor on it dies. It measures the program
as it runs, with eager codegen (Inductor's compiled kernels bypass dispatch).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Callable, Collection, Iterable

import torch
from torch import fx
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook

from ..compat import ProfilerEventType, TorchDispatchMode, local_tensor, tree_leaves
from ..ops import RECOMPUTES
from ..sharding.dtensor_params import parameter_records

# The parts of a step's peak memory, in the order they are reported:
# - parameters: the storage of the parameters and buffers the rank holds (its shards under
#   ZeRO; none for pipeline stages it does not run, released when the step was compiled);
# - optimizer_state: what optimizers hold for those parameters (`optimizer_state_bytes`);
# - gradients: the program's gradients (accumulated over microbatches) and the
#   parameters' `.grad` held from before the step;
# - activations: per-microbatch values held between tasks (saved for backward, received);
# - communication_buffers: receives in flight and per-step values made by
#   collectives, such as parameters gathered once for every microbatch (ZeRO-1/2);
# - task_temporaries: what the running task holds inside itself (`task_peak`).
MEMORY_PARTS = ("parameters", "optimizer_state", "gradients", "activations", "communication_buffers",
                "task_temporaries")


def storage_key(tensor: torch.Tensor) -> int:
    """The identity of `tensor`'s storage, shared by its views. Not the storage's
    address: on a device without memory (`meta`) every storage has address 0."""
    return tensor.untyped_storage()._cdata


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return local_tensor(tensor) if isinstance(tensor, DTensor) else tensor


def storage_bytes(tensors: Iterable[object]) -> int:
    """Bytes of the distinct storages of `tensors` (a DTensor's: its local tensor's);
    anything that is not a tensor counts nothing."""
    storages = {}
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            local = _local(tensor)
            storages[storage_key(local)] = local.untyped_storage().nbytes()
    return sum(storages.values())


# Parameter -> (bytes of the optimizer state kept for it, the state's values they were
# counted from), as of its optimizer's last step. Kept by parameter, not by step: the
# optimizer belongs to the user, and a step only knows its parameters. Recorded by a
# hook on every optimizer's step, installed when piper_fx compiles its first step
# (`record_optimizer_state`).
_OPTIMIZER_STATE_BYTES = parameter_records()
_RECORDING: list = []  # the hook's handle, once installed
_STATE_CHANGES = [0]  # how many times a parameter's count changed: a version, for sums kept of them
# Optimizer -> the outline of its state (`_state_outline`) when its parameters' were last counted.
_COUNTED_OUTLINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _state_outline(optimizer: torch.optim.Optimizer) -> tuple[int, int, int]:
    """What changes when an optimizer's state is made, loaded or emptied, but not when a step
    updates it in place: its state dict (`load_state_dict` makes a new one), how many
    parameters have state, and how many values they have in all."""
    state = optimizer.state
    return id(state), len(state), sum(map(len, state.values()))


def _record(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Count the state of each parameter whose state values are not those counted last
    (the first step, a loaded state dict, a parameter's state emptied): a step updates them
    in place. The hook runs after every step of every optimizer in the process, so what it
    does when the state's outline is unchanged is constant work, not per parameter (which
    cost 45 microseconds a step for 28 parameters, 0.8 ms for 500)."""
    outline = _state_outline(optimizer)
    if _COUNTED_OUTLINES.get(optimizer) == outline:
        return
    _COUNTED_OUTLINES[optimizer] = outline
    for group in optimizer.param_groups:
        for parameter in group["params"]:
            state = optimizer.state.get(parameter)
            if state:
                values = tuple(map(id, state.values()))
                recorded = _OPTIMIZER_STATE_BYTES.get(parameter)
                if recorded is None or recorded[1] != values:
                    _OPTIMIZER_STATE_BYTES[parameter] = (storage_bytes(state.values()), values)
                    _STATE_CHANGES[0] += 1
            elif state is not None and _OPTIMIZER_STATE_BYTES.pop(parameter, None) is not None:
                _STATE_CHANGES[0] += 1  # emptied (a parameter released under a pipeline)


def record_optimizer_state() -> None:
    """From now on, record the optimizer state bytes of every parameter after each
    optimizer step (`torch.optim.Optimizer` step post hook, installed once)."""
    if not _RECORDING:
        _RECORDING.append(register_optimizer_step_post_hook(_record))


def peak_allocated_bytes(fn: Callable[[], object], *, other_threads: bool = True) -> tuple[object, int]:
    """Run `fn` and measure the most bytes it had allocated at once through the CPU
    allocator (every tensor, inside compiled kernels too, and op and collective
    workspaces), over what was allocated before it: `fn`'s result and that peak.
    A measurement for tests and benchmarks (it runs `fn` under the profiler).

    With `other_threads=False`, only what the calling thread allocates counts (freed on
    any thread): not the buffers collective libraries make on their own worker threads,
    such as gloo's staging copies. Whether those are alive at the step's peak depends on
    when gloo's threads run, so they make the full peak vary from run to run of the
    same step (on a GPU, NCCL's buffers are outside the allocator altogether)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        with record_function(_MEASURED):
            result = fn()

    def events(nodes):
        for node in nodes:
            yield node
            yield from events(node.children)

    every = list(events(profiler.profiler.kineto_results.experimental_event_tree()))
    caller = next(event.start_tid for event in every if event.name == _MEASURED)
    allocations = [(event.start_time_ns, event.extra_fields.alloc_size, event.start_tid, event.extra_fields.ptr)
                   for event in every if event.tag == ProfilerEventType.Allocation]
    return result, peak_of(allocations, caller if not other_threads else None)


_MEASURED = "piper_fx.peak_allocated_bytes"


def peak_of(allocations: Iterable[tuple[int, int, int, int]], thread: int | None = None) -> int:
    """The most bytes allocated at once over the start, from the allocator's events: (time,
    bytes, thread, address) each, bytes negative for a free; counting the blocks `thread`
    allocates (freed by any thread), or every block if None. Not the allocator's own
    running total, which counts only while profiling and so drifts across runs. A free
    of a block allocated before the events lowers the total."""
    counted: dict[int, int] = {}  # address -> bytes of a block allocated there that counts
    uncounted: dict[int, int] = {}  # the same for the blocks that do not
    late: dict[int, list[int]] = {}  # address -> bytes of blocks freed there whose free is yet to be seen
    current = peak = 0
    for _, size, by, address in sorted(allocations):
        if size > 0:
            # One thread's free may be stamped after another's allocation of the same
            # address (gloo's worker thread drops a collective's input, the step's thread
            # allocates there): the allocator had freed the block already.
            if address in counted:
                late.setdefault(address, []).append(counted[address])
                current -= counted.pop(address)
            elif address in uncounted:
                late.setdefault(address, []).append(uncounted.pop(address))
            if thread is None or by == thread:
                counted[address] = size
                current += size
                peak = max(peak, current)
            else:
                uncounted[address] = size
        elif -size in late.get(address, ()):
            late[address].remove(-size)
        elif address in uncounted:
            del uncounted[address]
        else:  # a counted block, or one allocated before the events
            counted.pop(address, None)
            current += size
    return peak


def optimizer_state_bytes(parameters: Iterable[torch.Tensor]) -> int:
    """Bytes of optimizer state held for `parameters` as of their optimizers' last steps
    (0 before the first step, or for a parameter no optimizer steps)."""
    return sum(_OPTIMIZER_STATE_BYTES.get(parameter, (0,))[0] for parameter in parameters)


def optimizer_state_version() -> int:
    """Changes whenever `optimizer_state_bytes` may give another sum for the same parameters
    (an optimizer's step counted a parameter's state anew, or dropped it)."""
    return _STATE_CHANGES[0]


@dataclass(frozen=True)
class TaskPeak:
    """The moment a task run holds the most: `made` bytes of tensors it made and still
    holds (its outputs included), once it has freed the inputs at `released` (their
    positions among the task's inputs; all of those on a storage it has freed)."""

    made: int
    released: tuple[int, ...]


def task_peak(graph: fx.Graph, releasable: Collection[int] = ()) -> TaskPeak:
    """Where a task run holds the most, running its graph node by node as eager codegen
    does (each value freed after its last use): an estimate from the graph's fake
    values, whose views share their base's storage, so a view or an in-place result
    costs nothing. For Inductor's code it is an estimate only: fusion removes some of
    these tensors, and its own buffers and the collectives' workspaces add others.
    The inputs at the positions `releasable` are the runtime's to free: it drops
    them before the run, so each is freed at its last use inside the task, and a
    storage several inputs view (q, k and v split from one projection) once all of
    them are, unless an input it does not free views it too. Inputs, and views of
    them, are counted where the inputs are. A recomputation copy
    (`ops.RECOMPUTES`) carries its original's fake value: its storage, and views
    of it, count apart from the original's."""
    tagged: dict[fx.Node, list[tuple[tuple[int, bool], int]]] = {}

    def storages(node: fx.Node) -> list[tuple[tuple[int, bool], int]]:
        """(storage, whether a recomputation made it) and bytes of each tensor `node` gives."""
        if node not in tagged:
            inherited = {key[0]: key[1] for arg in node.all_input_nodes for key, _ in storages(arg)}
            own = RECOMPUTES in node.meta
            tagged[node] = [((storage_key(t), inherited.get(storage_key(t), own)), t.untyped_storage().nbytes())
                            for t in tree_leaves(node.meta.get("val"))
                            if isinstance(t, torch.Tensor) and not isinstance(t, DTensor)]
        return tagged[node]

    nodes = list(graph.nodes)
    last_use: dict[tuple, int] = {}  # storage -> index of the last node that is or reads a value on it
    sizes: dict[tuple, int] = {}
    made_at: dict[tuple, int] = {}  # storage the task makes -> index of the node making it
    # Storage of inputs -> their positions (several where inputs are views of one tensor:
    # a q, k and v split from one projection), and the storages an input not releasable holds.
    input_at: dict[tuple, list[int]] = {}
    pinned: set[tuple] = set()
    inputs: set[tuple] = set()
    outputs: set[tuple] = set()
    placeholders = 0
    for index, node in enumerate(nodes):
        if node.op == "output":
            outputs.update(key for arg in node.all_input_nodes for key, _ in storages(arg))
            continue
        for key, nbytes in storages(node):
            if node.op == "placeholder":
                inputs.add(key)
                input_at.setdefault(key, []).append(placeholders)
                sizes[key] = nbytes
                if placeholders not in releasable:
                    pinned.add(key)
            elif key not in inputs and key not in made_at:
                made_at[key], sizes[key] = index, nbytes
            last_use[key] = index
        placeholders += node.op == "placeholder"
        for arg in node.all_input_nodes:
            for key, _ in storages(arg):
                last_use[key] = index
    made = [0] * len(nodes)  # bytes of the storages each node makes
    freed = [0] * len(nodes)  # bytes freed once each node has run
    released: list[list[tuple]] = [[] for _ in nodes]  # input storages freed once each node has run
    for key, index in made_at.items():
        made[index] += sizes[key]
        if key not in outputs:
            freed[last_use[key]] += sizes[key]
    for key in input_at:
        if key not in outputs and key not in pinned:  # every input on it is the runtime's to free
            released[last_use[key]].append(key)
    holding = net = best_net = 0  # bytes of made storages held; that less the released inputs' bytes
    best, gone = TaskPeak(0, ()), []
    for index in range(len(nodes)):
        holding += made[index]
        net += made[index]
        if net > best_net:
            best, best_net = TaskPeak(holding, tuple(gone)), net
        holding -= freed[index]
        net -= freed[index]
        for key in released[index]:
            gone.extend(input_at[key])
            net -= sizes[key]
    return best


class LiveStorageBytes(TorchDispatchMode):
    def __init__(self, watch: Callable[[object], bool]):
        super().__init__()
        self.watch = watch
        self._live: dict[int, list[int]] = {}  # storage (`storage_key`) -> [bytes, live tensors]
        self.current = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self._observe(func, value)
        return out

    def _observe(self, func, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        key = storage_key(tensor)
        if key not in self._live:
            if not self.watch(func) or storage.nbytes() == 0:
                return
            self._live[key] = [storage.nbytes(), 0]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._live[key][1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self._live[key]
