"""Every private `torch._*` API piper_fx uses, imported here and nowhere else.

Each comes with what piper_fx uses it for and the public API that would
replace it, where one exists. A torch release that moves one of them breaks
this module alone, and its fix lives here. Checked on torch 2.11 (GPU images)
through 2.13 (the CPU venv's pin).
"""
from __future__ import annotations

import functools
import mmap
import warnings
import weakref
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

# The torch releases piper_fx runs on (major, minor), as setup.py declares them.
OLDEST_TORCH, NEWEST_TORCH = (2, 11), (2, 13)
TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_VERSION < OLDEST_TORCH:
    raise ImportError(f"piper_fx needs torch {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]} or newer (it uses "
                      f"aot_export_joint_with_descriptors and Inductor's collective bucketing); this is torch "
                      f"{torch.__version__}")
if TORCH_VERSION > NEWEST_TORCH:
    warnings.warn(f"piper_fx is tested on torch {OLDEST_TORCH[0]}.{OLDEST_TORCH[1]} through "
                  f"{NEWEST_TORCH[0]}.{NEWEST_TORCH[1]}; torch {torch.__version__} may have moved a private "
                  "API it uses (piper_fx/compat.py lists them)", stacklevel=2)
# Joint forward + backward capture with a descriptor for every input and output (which is
# a parameter, a tangent, a gradient of what): no public equivalent; `torch.export` gives
# the forward only.
from torch._functorch._aot_autograd import descriptors as aot_descriptors  # noqa: F401
from torch._functorch.aot_autograd import aot_export_joint_with_descriptors  # noqa: F401
# Dynamo's backend registry: registering `backend="piper"` on import without registering it
# twice when the `torch_dynamo_backends` entry point already did (public: the entry point).
from torch._dynamo.backends.registry import _BACKENDS, _COMPILER_FNS, register_backend  # noqa: F401
# Marks a dimension dynamic unless Dynamo must specialize it (no public form in torch.compiler).
from torch._dynamo import maybe_mark_dynamic  # noqa: F401
from torch._dynamo import config as dynamo_config  # noqa: F401
# The one exception family Dynamo lets out of a backend unwrapped (else BackendCompilerFailed).
from torch._dynamo.exc import ShortenTraceback  # noqa: F401
# Tracing contexts: capture and Inductor's bucketing run outside Dynamo's context (in our own
# fake mode); `compile_fx_inner` needs one naming the task's fake mode.
from torch._guards import TracingContext, tracing  # noqa: F401
# A fake mode of our own for capture, with a shape environment: static shapes add no symbols,
# and Inductor's FX graph cache bypasses graphs whose fake mode has none ("No shape env").
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: F401
from torch.fx.experimental.symbolic_shapes import ShapeEnv  # noqa: F401
# FX's lazy graph modules, as Dynamo and Inductor make theirs: `recompile()` only marks the
# module, and its Python code is generated when it is first called or its `code` read. A
# compile's graphs are rebuilt by every pass and copied into each task and region, and are
# never run as Python but under eager codegen; generating their code each time took a
# quarter of a 24-block model's planning. No public form.
from torch.fx._lazy_graph_module import _LazyGraphModule, _use_lazy_graph_module as lazy_graph_modules  # noqa: F401
# Dynamo's and Inductor's event counters (FX graph cache hits and misses); no public accessor.
from torch._dynamo.utils import counters as dynamo_counters  # noqa: F401
# The id of the frame Dynamo is compiling, which names the debug dump's folder as TORCH_LOGS and
# tlparse name it (`graph0`, `graph0_1` for a recompile); no public accessor.
from torch._guards import CompileContext  # noqa: F401
# Dynamo's own timings of its phases, per process (`dynamo_trace_seconds`); no public accessor.
from torch._dynamo.utils import compilation_time_metrics as _dynamo_timings
# Inductor, compiling one task graph at a time with its decompositions, its config (to keep
# the planned order of collectives), and its collective bucketing passes.
from torch._inductor import config as inductor_config  # noqa: F401
from torch._inductor.compile_fx import compile_fx_inner  # noqa: F401
# Inductor on a whole Dynamo graph, as `torch.compile`'s default backend compiles it.
from torch._inductor.compile_fx import compile_fx  # noqa: F401
# Which vector ISA Inductor's C++ code builds for, probed once per process (cached), and
# each ISA's own check (`bool(isa)`, cached per ISA), with the ISAs this x86 CPU claims.
from torch._inductor.cpu_vec_isa import supported_vec_isa_list, valid_vec_isa_list, x86_isa_checker  # noqa: F401
from torch._inductor.decomposition import select_decomp_table  # noqa: F401
from torch._inductor import inductor_prims  # noqa: F401  (registers the prims its decompositions write)
from torch._inductor.fx_passes import bucketing  # noqa: F401
# What Inductor's `bucketing.process_collective_bucket` does around its trace, which
# `passes.bucket_collectives` runs itself to trace each bucket layout once: make_fx of a
# bucket's function in its values' fake mode, the fake mode of a list of values, whether a
# gather's input is a cast the bucket takes over, and the sort of the bucket's region (from
# torch 2.13; where Inductor lacks it, the pass's closing stable sort orders the graph).
from torch._guards import detect_fake_mode  # noqa: F401
trace_bucket = bucketing._trace
takes_cast = bucketing.has_mergeable_all_gather_convert_dtype
sort_bucket_region = getattr(bucketing, "_sort_bucket_region", lambda graph, new_nodes, inputs: None)
from torch._inductor.pattern_matcher import stable_topological_sort  # noqa: F401
# A post-grad pass of ours inside Inductor (its FX graph cache keyed by the pass's `uuid`), and
# Inductor's way to keep an order its scheduler would change: `control_deps` on each node after
# the one it must follow, as Inductor chains random ops under `fallback_random`.
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files  # noqa: F401
from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering  # noqa: F401
from torch.utils._ordered_set import OrderedSet  # noqa: F401
# DTensor's sharding propagation on one op (placements of an FX node from its inputs').
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta  # noqa: F401
from torch.distributed.tensor._op_schema import OpSchema  # noqa: F401
# Dispatch modes (memory and wait timing around tasks) and pytree leaves: stable in practice,
# public in name only under torch.utils._python_dispatch / _pytree.
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: F401
from torch.utils._pytree import tree_leaves, tree_map_only  # noqa: F401
# The flat copy of a list of tensors in one C++ call, as DDP and FSDP1 make their flat buffers.
from torch._utils import _flatten_dense_tensors as flatten_dense_tensors  # noqa: F401


def make_graph_module(root, graph) -> torch.fx.GraphModule:
    """`fx.GraphModule(root, graph)`, lazy (its code generated when needed, `_LazyGraphModule`)."""
    return _LazyGraphModule(root, graph)


def code_now(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """`gm` with its Python code generated now, so its `forward` is the code itself and not
    the lazy module's first-call shim (which would stay in every call of a bound `forward`)."""
    gm.recompile()
    _LazyGraphModule.force_recompile(gm)
    return gm


def dynamo_trace_seconds() -> float | None:
    """Seconds Dynamo spent tracing the frame whose backend it is calling now (the last of its
    `bytecode_tracing` timings, appended when a trace ends, before the backend runs; a graph
    broken mid-frame is compiled during the frame's retrace, and reads the attempt before it);
    None outside a Dynamo compile, or if it kept none. From Dynamo's per-process timings, which
    have no public accessor."""
    timings = _dynamo_timings.get("bytecode_tracing")
    return timings[-1] if timings and CompileContext.current_compile_id() is not None else None


def graph_break_of(gm: torch.fx.GraphModule) -> tuple[object | None, bool]:
    """Why Dynamo broke the model's graph, for an error about a graph that is not a whole step:
    (a `GraphCompileReason`, whether it ended `gm` itself). `gm`'s own reason where a break ended
    it (set on the graph Dynamo hands its backend); else the latest break Dynamo recorded since
    its last reset, which made it compile the frames the broken code calls (a module's forward)
    as graphs of their own; (None, False) if there was none. Public form: none
    (`torch._dynamo.explain` retraces the model)."""
    own = getattr(gm, "compile_subgraph_reason", None)
    if own is not None and getattr(own, "graph_break", False):
        return own, True
    from torch._dynamo.utils import graph_break_reasons

    return (graph_break_reasons[-1] if graph_break_reasons else None), False


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """`mesh`'s dimensions as one named `name` on its root mesh (torchtitan's dp from
    dp_replicate x dp_shard); DeviceMesh has no public spelling of it yet."""
    return mesh._flatten(name)


# DTensor's constructor without its `__init__` (which does nothing but passes Dynamo's
# disable wrapper, 1.5 of its 2.5 microseconds); torch 2.11 may lack it.
_NEW_DTENSOR = getattr(torch.Tensor, "_dtensor__new__", None)


def init_optim_state(optimizer: torch.optim.Optimizer) -> None:
    """Give `optimizer` its state (a zero-gradient step at lr 0) before a checkpoint is loaded
    into it, as `set_optimizer_state_dict` does internally. Public only inside that function.
    Imported when called, as `checkpoint` imports DCP (`checkpoint._dcp`)."""
    from torch.distributed.checkpoint.state_dict import _init_optim_state
    _init_optim_state(optimizer)


def dtensor_like(local: torch.Tensor, like: DTensor) -> DTensor:
    """A DTensor with `like`'s mesh, placements, global shape and stride (its spec) holding
    `local`, this rank's piece of `like.to_local()`'s shape and dtype. Public would be
    `DTensor.from_local(local, mesh, placements, shape=..., stride=...)`, an autograd
    Function costing ten times more, paid per parameter and step."""
    if _NEW_DTENSOR is not None:
        return _NEW_DTENSOR(DTensor, local, like._spec, requires_grad=False)
    return DTensor(local, like._spec, requires_grad=False)


def local_tensor(dtensor: DTensor) -> torch.Tensor:
    """`dtensor`'s local tensor, itself (not a view or an autograd alias). Public would be
    `dtensor.to_local()`, which under grad mode is an autograd Function and otherwise
    still passes Dynamo's disable wrapper: a few microseconds per parameter and step."""
    return dtensor._local_tensor


def dtensor_op_handlers() -> dict:
    """DTensor's per-op handlers, `{op: handler(op, args, kwargs)}`, which its dispatch calls
    in place of its own for those ops (torch's loss parallelism installs its losses' there).
    Public: none."""
    return DTensor._op_dispatcher._custom_op_handlers


def dtensor_dispatch(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> object:
    """`op` run through DTensor's own dispatch, from within a handler of it: the handler is out
    of the table for the call (in another thread meanwhile, the op goes through DTensor's own
    dispatch too, which computes the same). Public: none."""
    handlers = dtensor_op_handlers()
    handler = handlers.pop(op, None)
    try:
        return op(*args, **kwargs)
    finally:
        if handler is not None:
            handlers[op] = handler


def leaf_use(node: torch.autograd.graph.Node | None) -> str | None:
    """How the backward now running uses `node`, where it is a leaf's AccumulateGrad:
    "accumulated" (its gradient is added into `.grad`: `backward()`, or a leaf that
    `backward(inputs=...)` names), "left out" (a leaf `backward(inputs=...)` or
    `torch.autograd.grad` does not name), or "captured" (a leaf `torch.autograd.grad`
    hands the gradient of back, for which torch raises here); None for any other node.
    Public: none."""
    if type(node).__name__ != "AccumulateGrad":
        return None
    try:
        return "accumulated" if torch._C._will_engine_execute_node(node) else "left out"
    except RuntimeError:
        return "captured"


def read_as_zeros(storage: torch.UntypedStorage) -> None:
    """Free a CPU `storage`'s memory, keeping its size and every view of it: its data becomes
    a private anonymous mapping of its bytes, which read as zeros from the kernel's zero page
    (nothing resident) and take memory only where written. `resize_(0)` frees as much, but
    a read of a view then dereferences a null pointer (a crash, not an error), and is what a
    torch without the swap below gets. Private: `UntypedStorage._swap_data_ptr_` (the data and
    size of two storages exchanged in place); no public form."""
    nbytes = storage.nbytes()
    if nbytes == 0:
        return
    if not hasattr(storage, "_swap_data_ptr_"):
        storage.resize_(0)
        return
    zeros = torch.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS), dtype=torch.uint8)
    storage._swap_data_ptr_(zeros.untyped_storage())  # the old memory goes with `zeros`


def has_grad_hooks(tensor: torch.Tensor) -> bool:
    """Whether autograd calls hooks of `tensor` with its gradient (`register_hook`) or after
    accumulating it (`register_post_accumulate_grad_hook`). Public: none."""
    return bool(tensor._backward_hooks) or bool(getattr(tensor, "_post_accumulate_grad_hooks", None))


def check_vec_isa(isa, loads: Callable[[str], bool], loaded: Callable[[str], None]) -> bool:
    """`bool(isa)`: whether Inductor's C++ code can be built for the vector ISA `isa` (cached
    per ISA for the process), with its load probe answered by `loads(library)` where that
    says the built test library is known to load, and `loaded(library)` told of each that
    loaded when probed. Inductor builds a test library per ISA (cached on disk) and then, in
    every process, starts a Python subprocess to `dlopen` it: about 0.17 s each, 6 of them
    on an AVX-512 machine. A torch whose check has no separate load probe checks as always.
    Public would be a persistent form of Inductor's own check; there is none."""
    probe = getattr(type(isa), "_probe_load", None)
    if probe is None:
        return bool(isa)

    def probe_load(library: str) -> bool:
        if loads(library):
            return True
        if probe(isa, library):
            loaded(library)
            return True
        return False

    isa._probe_load = probe_load  # this ISA's checks alone (an ISA is checked on one thread)
    try:
        return bool(isa)
    finally:
        del isa._probe_load


def resolve_process_group(group_name: str) -> dist.ProcessGroup:
    """The process group a functional collective names (`group_name`). Public would be
    `torch.distributed.distributed_c10d` exposing the registry; there is none."""
    return dist.distributed_c10d._resolve_process_group(group_name)


def default_store() -> dist.Store:
    """The key-value store the default process group was set up with (`codegen.shared` claims
    tasks in it with `Store.add`); public would be an accessor on the group; there is none."""
    return dist.distributed_c10d._get_default_store()


# The profiler's events as a tree, with each allocation's size and time, for
# `runtime.memory.peak_allocated_bytes` (public: the profiler's memory timeline, which needs
# shapes and stacks recorded, and reports by category rather than one running total).
from torch._C._profiler import _EventType as ProfilerEventType  # noqa: F401,E402



# The plan cache (`plan_cache`): where Inductor keeps its caches (TORCHINDUCTOR_CACHE_DIR or
# its default), and FX's pickler of graphs with their fake values (Inductor's own, for graphs
# it compiles in a subprocess); no public form of either.
from torch._inductor.runtime.cache_dir_utils import cache_dir as inductor_cache_dir  # noqa: F401,E402
# A function's importable name (`torch.nn.functional.layer_norm`), as FX's code names it.
from torch.fx.node import _get_qualified_name as qualified_name  # noqa: F401,E402


def pickle_graphs(obj: object, kept_meta: Callable[[str], bool]) -> bytes:
    """`obj` pickled with every FX graph module in it, the node metadata whose keys `kept_meta`
    accepts alone (fake values as their shapes, strides, dtypes and devices), and ops of any
    namespace; a node in a kept entry (such as the original a recomputation copies) as None.

    A pickle whose fake values are all plain (`_plain_fake`: dense, not views, static
    shapes) keeps each as its layout and storage (`_fake_from_layout`), which loads in
    about 15 us a value; else every value is described whole by FX's pickler (its
    `MetaConverter` rebuilds views, subclasses and symbolic shapes, at about 120 us a value,
    most of loading a plan)."""
    from torch.fx._graph_pickler import Options
    options = Options(ops_filter=None, node_metadata_key_filter=kept_meta)
    try:
        return _graph_pickler(plain_fakes=True).dumps(obj, options)
    except _NotPlainFake:
        return _graph_pickler(plain_fakes=False).dumps(obj, options)


class _NotPlainFake(Exception):
    """A fake value `_plain_fake` refuses: the pickle describes every value whole instead."""


def _plain_fake(fake) -> bool:
    """Whether a fake value is what `_fake_from_layout` rebuilds exactly: a `FakeTensor` itself
    (no subclass, no parameter), dense, not a view, of static sizes, strides and offset, a
    leaf without a gradient, not an inference tensor, conjugate, negative or quantized view,
    nor a constant or a value with dynamic dimensions marked."""
    from torch._subclasses.fake_tensor import FakeTensor
    return (type(fake) is FakeTensor and fake.layout == torch.strided and not fake._is_view()
            and fake.is_leaf and fake.grad is None and not fake.is_inference() and not fake.is_conj()
            and not fake.is_neg() and not fake.is_quantized and fake.constant is None
            and not hasattr(fake, "_dynamo_dynamic_indices")
            and all(type(n) is int for n in (*fake.shape, *fake.stride(), fake.storage_offset())))


# Per load (`_UnpickleState`): the fake storages made so far, by their index in the pickle,
# so that values sharing a storage when pickled share one when loaded.
_LOADED_STORAGES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _fake_from_layout(state, storage: int, nbytes: int, shape: tuple, stride: tuple, offset: int,
                      dtype: torch.dtype, device: torch.device, requires_grad: bool):
    """A fake value in the load's fake mode with the given layout on the pickle's `storage`-th
    storage (of `nbytes`), made as FX's unpickler makes one (`FakeTensor` around a meta tensor)
    without describing it first."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._mode_utils import no_dispatch
    storages = _LOADED_STORAGES.setdefault(state, {})
    with no_dispatch():
        if storage not in storages:
            storages[storage] = torch.empty(nbytes, dtype=torch.uint8, device="meta").untyped_storage()
        meta = torch.empty(0, dtype=dtype, device="meta").set_(storages[storage], offset, shape, stride)
        fake = FakeTensor(state.fake_mode, meta, device)
    return fake.requires_grad_() if requires_grad else fake


def _unpickled_node() -> None:
    return None


def _memory_format(name: str) -> torch.memory_format:
    return getattr(torch, name)


# What a graph module's `recompile()` adds to its attributes: the code generated from its graph.
_GENERATED_CODE = ("_code", "_lineno_map", "_prologue_start")


class _GraphModuleData:
    """A graph module as a plan pickles it: its attributes but the code generated from its
    graph, and its graph (`_GraphData`). FX's pickler generates the code to pickle it with,
    and pickles its text: storing a 24-block GPT's ZeRO-3 plan took rank 0's RSS from 451 to
    495 MB with it, from 449 to 475 MB without. Loaded, the module is lazy (`make_graph_module`)."""

    def __init__(self, gm: torch.fx.GraphModule, options):
        self.attributes = {k: v for k, v in gm.__dict__.items() if k != "_graph" and k not in _GENERATED_CODE}
        self.graph = _GraphData(gm.graph, options)


class _NodeAt:
    """A node in the arguments of a pickled graph's node: its position in the graph."""
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index

    def __reduce__(self):
        return _NodeAt, (self.index,)


class _GraphData:
    """A graph as a plan pickles it: per node its op, name, target (as FX's pickler pickles a
    target), arguments (each node in them `_NodeAt` its position), type and the metadata kept.
    The arguments are mapped by FX's own `map_arg` and `map_aggregate`, where FX's pickler maps
    each node's with pytree."""

    def __init__(self, graph: torch.fx.Graph, options):
        from torch.fx._graph_pickler import _OpPickleData
        self.tracer_cls, self.tracer_extras, self.codegen = graph._tracer_cls, graph._tracer_extras, graph._codegen
        kept = options.node_metadata_key_filter
        position: dict[torch.fx.Node, int] = {}
        self.nodes = []
        for node in graph.nodes:
            position[node] = len(position)
            args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: _NodeAt(position[n]))
            meta = {key: value for key, value in node.meta.items() if kept is None or kept(key)}
            self.nodes.append((node.op, node.name, _OpPickleData.pickle(node.target, options), args, kwargs,
                               node.type, meta))

    def unpickle(self, gm: torch.fx.GraphModule, state) -> torch.fx.Graph:
        from torch.fx.node import map_aggregate
        graph = torch.fx.Graph(gm, self.tracer_cls, self.tracer_extras)
        made: list[torch.fx.Node] = []

        def node_at(arg):
            return made[arg.index] if type(arg) is _NodeAt else arg
        for op, name, target, args, kwargs, type_, meta in self.nodes:
            args, kwargs = map_aggregate((args, kwargs), node_at)
            node = graph.create_node(op, target.unpickle(state), args, kwargs, name, type_)
            node.meta = meta
            made.append(node)
        graph._codegen = self.codegen
        return graph


def _graph_module_from(data: _GraphModuleData, state) -> torch.fx.GraphModule:
    gm = _LazyGraphModule.__new__(_LazyGraphModule)
    gm.__dict__ = data.attributes
    gm._graph = data.graph.unpickle(gm, state)
    gm.recompile()  # marks it: its code is generated when it is first run or read
    return gm


@functools.cache
def _graph_pickler(plain_fakes: bool) -> type:
    """FX's `GraphPickler`, but a fake view's base described without its fake mode, as the
    view itself is: torch 2.13 drops the mode of the view alone, and the base's (which the
    unpickler sets again) drags the whole fake mode into the pickle, which fails. A node
    held in metadata is pickled as None (what `Options(ignore_raw_node=True)` does from
    torch 2.13; torch 2.11 has no such option and refuses the node). A memory format is
    pickled by its name in `torch`. With `plain_fakes`, each fake value is pickled as its
    layout and storage (`_fake_from_layout`), and one that is not plain raises `_NotPlainFake`."""
    import dataclasses

    from torch._subclasses.fake_tensor import FakeTensor
    from torch.fx._graph_pickler import GraphPickler, _TensorPickleData

    class PlanPickler(GraphPickler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.storage_indices: dict[int, int] = {}  # a fake value's storage -> its index

        def reducer_override(self, obj):
            if isinstance(obj, torch.fx.Node):
                return _unpickled_node, ()
            if isinstance(obj, torch.fx.GraphModule):
                return _graph_module_from, (_GraphModuleData(obj, self.options), self._unpickle_state)
            if isinstance(obj, torch.memory_format):
                # By its name in torch: its own reduction is the global "torch.contiguous_format",
                # which pickle finds in the first module with a `torch` attribute, in a spawned
                # rank often the script's `__mp_main__`: the plan would not load in another script.
                return _memory_format, (str(obj).removeprefix("torch."),)
            if not isinstance(obj, FakeTensor):
                return super().reducer_override(obj)
            if plain_fakes:
                if not _plain_fake(obj):
                    raise _NotPlainFake()
                untyped = obj.untyped_storage()
                index = self.storage_indices.setdefault(untyped._cdata, len(self.storage_indices))
                return _fake_from_layout, (self._unpickle_state, index, untyped.nbytes(), tuple(obj.shape),
                                           obj.stride(), obj.storage_offset(), obj.dtype, obj.device,
                                           obj.requires_grad)
            unpickle, (data, state) = _TensorPickleData.reduce_helper(self, obj)
            base = data.metadata.base
            if base is not None and base.fake_mode is not None:
                data.metadata = dataclasses.replace(data.metadata, base=dataclasses.replace(base, fake_mode=None))
            return unpickle, (data, state)

    return PlanPickler


def load_graphs(data: bytes, fake_mode: FakeTensorMode) -> object:
    """What `pickle_graphs` pickled, fake values made in `fake_mode`."""
    return _graph_pickler(plain_fakes=False).loads(data, fake_mode)
