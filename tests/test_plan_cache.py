"""The plan cache's key (`piper_fx.plan_cache.plan_key`): what planning reads is in it, what it
does not read is not, and a graph whose text is not the same in every process is not cached.
That a plan from the cache trains as the planned one, in the same process and a fresh one, is
`test_compile_stats.py`'s."""
from __future__ import annotations

import torch
from torch import nn

import piper_fx
from piper_fx.options import parse_options
from piper_fx.plan_cache import plan_key

GROUPS = (None, None, None, None)


class Net(nn.Module):
    def __init__(self, width: int = 8, annotate: bool = False):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, 1)
        self.annotate = annotate

    def forward(self, x):
        if self.annotate:
            with piper_fx.annotate("PP"):
                x = self.a(x)
        else:
            x = self.a(x)
        return self.b(torch.relu(x)).sum()


def _graph(model: nn.Module, x: torch.Tensor):
    """The Dynamo graph and example inputs `torch.compile` would hand a backend."""
    seen = []

    def record(gm, example_inputs):
        seen.append((gm, example_inputs))
        return gm.forward

    torch._dynamo.reset()
    torch.compile(model, backend=record, fullgraph=True)(x)
    return seen[0]


def _key(model=None, x=None, options=None, groups=GROUPS, grad: bool = True):
    torch.manual_seed(0)
    with torch.set_grad_enabled(grad):
        gm, inputs = _graph(model or Net(), torch.randn(4, 8) if x is None else x)
        return plan_key(gm, inputs, parse_options(options or {"codegen": "eager"}), groups)


def test_the_key_is_the_same_for_the_same_graph_inputs_and_strategy():
    first = _key()
    assert first is not None and _key() == first
    # piper_fx's region ids count up over the process: the key has their order alone.
    annotated = _key(model=Net(annotate=True))
    assert annotated is not None and _key(model=Net(annotate=True)) == annotated
    # Options planning does not read: where dumps go, and timing.
    assert _key(options={"codegen": "eager", "debug_dir": "/somewhere", "profile": True}) == first


def test_the_key_changes_with_what_planning_reads():
    first = _key()
    changed = {
        "an option": _key(options={"codegen": "eager", "bucket_mb": 1.0}),
        "another codegen": _key(options={"codegen": "inductor"}),
        "the batch shape": _key(x=torch.randn(6, 8)),
        "a dtype": _key(model=Net().double(), x=torch.randn(4, 8, dtype=torch.float64)),
        "parameters frozen": _key(model=Net().requires_grad_(False)),
        "an annotation": _key(model=Net(annotate=True)),
        "the process groups": _key(groups=("3", None, None, None)),
        "no gradients (inference)": _key(grad=False),
    }
    assert all(key is not None for key in changed.values())
    assert len({first, *changed.values()}) == 1 + len(changed), changed


def test_the_key_has_the_backends_of_the_process_groups(monkeypatch):
    # Planning reads a group's backend (under gloo, one all-gather in flight per group).
    from piper_fx import plan_cache

    keys = set()
    for backend in ("gloo", "nccl"):
        monkeypatch.setattr(plan_cache, "_group_backend", lambda name, backend=backend: name and backend)
        keys.add(_key(groups=("3", None, None, None)))
    assert len(keys) == 2 and None not in keys


def test_a_graph_calling_a_function_defined_in_a_function_is_not_cached():
    @torch._dynamo.allow_in_graph
    def local_scale(x):
        return x * 2

    class Scaled(Net):
        def forward(self, x):
            return super().forward(local_scale(x))

    assert _key(model=Scaled()) is None
