"""DTensor sharding rules for the custom ops of libraries whose models piper_fx compiles and
that ship none, registered with DTensor's own `register_sharding` (so eager DTensor code has
them too) the first time placement asks DTensor about one (`register_for`).

Each rule lists placements under which the op computes exactly what it computes on whole
tensors, and nothing else:

- transformers' `grouped_mm_fallback` (Mixtral's, Qwen2-MoE's and every other
  mixture-of-experts layer of transformers 5, where `torch._grouped_mm` does not serve: in
  fp32, on a CPU), the matmul of each expert's weights with the rows of the tokens routed to
  it, `offs` the cumulative count of those rows: a function of replicated inputs is
  replicated. Its backward (`grouped_mm_fallback_backward`, its own op) is linear in the
  output's gradient: a `Partial()` one (a sum over ranks, as gradients are under data
  parallelism) gives `Partial()` gradients of the input and the weights. DTensor's rules for
  the routing (a sort of the tokens by expert) already replicate the tokens they feed it.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch.distributed.tensor import Partial, Replicate
from torch.distributed.tensor.experimental import register_sharding

R, P = Replicate(), Partial()


def _grouped_mm_fallback(input, weight, offs) -> list:
    return [([R], [R, R, R])]


def _grouped_mm_fallback_backward(input, weight, offs, grad_output) -> list:
    return [([R, R], [R, R, R, R]), ([P, P], [R, R, R, P])]


# By the op's qualified name (`OpOverload.name()`): the acceptable placements, as `register_sharding` takes them.
RULES: dict[str, Callable[..., list]] = {
    "transformers::grouped_mm_fallback": _grouped_mm_fallback,
    "transformers::grouped_mm_fallback_backward": _grouped_mm_fallback_backward,
}
_registered: set[str] = set()


def register_for(op: Any) -> None:
    """Register `op`'s rule with DTensor, if it is one of `RULES` and not registered yet."""
    if not isinstance(op, torch._ops.OpOverload):
        return
    name = op.name()
    if name in RULES and name not in _registered:
        register_sharding(op)(RULES[name])
        _registered.add(name)
