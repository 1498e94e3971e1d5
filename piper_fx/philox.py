"""Counter-based random numbers from plain integer tensor ops (Philox-4x32-10).

A random value here is a function of a key and a counter alone (Salmon et al.,
"Parallel random numbers: as easy as 1, 2, 3", SC 2011; the generator behind
PyTorch's CUDA and Inductor's random ops), not of a generator's state. So a
value is the same whichever microbatch, replica, pipeline rank or device draws
it, and whether eager ATen, Inductor's C++ or Triton computes it: that is how
`passes.functionalize_random` makes dropout equal single-device training.

Each 32-bit word is held in an int64 tensor with a value in [0, 2**32), and
the 32x32-bit products Philox needs are split into 16-bit halves, so no
intermediate exceeds 2**49: no signed overflow (undefined in C++), no
arithmetic-versus-logical shift question, the same bits on every backend.

The per-microbatch input of a graph with random ops (`RNG_WORDS` int64 words):
the step's key (two words), the step count, and the global index of the
microbatch's first sample. A random tensor's element i of sample s has
counter (s * per_sample + i, its op's index, the step).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from .sharding.dtensor_params import parameter_records

MASK32 = 0xFFFFFFFF
_M0, _M1 = 0xD2511F53, 0xCD9E8D57   # Philox-4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85   # its key schedule (Weyl sequence)
ROUNDS = 10

KEY_LO, KEY_HI, STEP, FIRST_SAMPLE = range(4)
RNG_WORDS = 4


def _mulhilo(a, m: int):
    """(high, low) 32-bit words of a * m, for `a` a word and `m` a 32-bit constant."""
    m_hi, m_lo = m >> 16, m & 0xFFFF
    t = a * m_hi                           # < 2**48
    u = a * m_lo + (t & 0xFFFF) * 65536    # < 2**49: the low 48 bits of a * m
    return (t >> 16) + (u >> 32), u & MASK32


def philox4x32(counter: list, key: list, rounds: int = ROUNDS) -> list:
    """The four output words of Philox-4x32 for four counter and two key words
    (tensors of words, or Python ints; both broadcast)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & MASK32, (k1 + _W1) & MASK32
        hi0, lo0 = _mulhilo(c0, _M0)
        hi1, lo1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def _words(rng: torch.Tensor, op_index, shape, per_sample: int) -> list[torch.Tensor]:
    """Philox output words for every element of a random tensor of `shape` (flat), drawn by
    the op `op_index` (an int, or a 0-d int64 tensor so one trace serves every op)."""
    index = torch.arange(math.prod(shape), dtype=torch.int64, device=rng.device) + rng[FIRST_SAMPLE] * per_sample
    return philox4x32([index & MASK32, index >> 32, op_index, rng[STEP]], [rng[KEY_LO], rng[KEY_HI]])


def _unit(word: torch.Tensor) -> torch.Tensor:
    """A word as a float32 in [0, 1): its top 24 bits, which float32 holds exactly."""
    return (word >> 8).to(torch.float32) * 2.0 ** -24


def uniform(rng: torch.Tensor, op_index, *, shape, per_sample: int, dtype: torch.dtype) -> torch.Tensor:
    """Uniform values in [0, 1) (as `torch.rand`), computed in float32 and converted."""
    return _unit(_words(rng, op_index, shape, per_sample)[0]).to(dtype).reshape(shape)


def normal(rng: torch.Tensor, op_index, *, shape, per_sample: int, dtype: torch.dtype) -> torch.Tensor:
    """Standard normal values (as `torch.randn`): Box-Muller on two words of each counter.
    Exact up to the last bits of log, sqrt and cos, which backends round their own way."""
    words = _words(rng, op_index, shape, per_sample)
    radius = torch.sqrt(-2.0 * torch.log(1.0 - _unit(words[0])))  # 1 - u is in (0, 1]
    return (radius * torch.cos(2.0 * math.pi * _unit(words[1]))).to(dtype).reshape(shape)


@dataclass
class Stream:
    """A model's random stream: its seed, the same on every rank, and the steps drawn so far
    (each step draws anew). Its whole state: what a checkpoint keeps (`stream_state`,
    `restore_stream`). Every step compiled for the model (one per batch shape, and a
    recompile) draws from its one stream (`stream_of`)."""

    seed: int
    step: int = 0


@dataclass
class StepRandomness:
    """What a compiled step feeds a graph's random ops, per microbatch: the `stream`'s seed and
    step, and a microbatch's first sample, its index in the global batch (over data-parallel
    replicas and microbatches), which counters are offset by."""

    stream: Stream
    samples_per_microbatch: int
    first_sample: int  # of this replica's batch: its data-parallel index * its batch size
    device: torch.device

    def next_inputs(self, microbatches: int) -> list[torch.Tensor]:
        """The RNG input of each microbatch of the next step; counts the step."""
        seed, step = self.stream.seed, self.stream.step
        rows = [[seed & MASK32, (seed >> 32) & MASK32, step & MASK32,
                 self.first_sample + m * self.samples_per_microbatch] for m in range(microbatches)]
        self.stream.step += 1
        return list(torch.tensor(rows, dtype=torch.int64, device=self.device).unbind())


# The random stream of each compiled step, by the parameters it trains (what a checkpoint of the
# model saves), and streams loaded from a checkpoint before the step that continues them was compiled.
_STREAMS = parameter_records()
_PENDING = parameter_records()


def attach_stream(parameters: list[torch.Tensor], randomness: StepRandomness) -> None:
    """Make `randomness`'s stream the stream of the model whose `parameters` its step trains,
    continuing a stream `restore_stream` loaded for them before the step was compiled."""
    pending = next((_PENDING[p] for p in parameters if p in _PENDING), None)
    if pending is not None:
        randomness.stream.seed, randomness.stream.step = pending
    for p in parameters:
        _PENDING.pop(p, None)
        _STREAMS[p] = randomness.stream


def stream_of(parameters: list[torch.Tensor]) -> Stream | None:
    """The stream of the model whose `parameters` a step compiled with random ops trains, if
    one was: a later compile of the model (another batch shape, a recompile) continues it."""
    return next((_STREAMS[p] for p in parameters if p in _STREAMS), None)


def stream_state(parameters: list[torch.Tensor]) -> tuple[int, int] | None:
    """(seed, steps drawn) of the stream of the step training `parameters`, if it has random ops."""
    stream = stream_of(parameters)
    return (stream.seed, stream.step) if stream is not None else None


def restore_stream(parameters: list[torch.Tensor], seed: int, step: int) -> None:
    """Continue the stream (seed, steps drawn) in the step training `parameters`: now if it is
    compiled, else when it is."""
    stream = stream_of(parameters)
    if stream is not None:
        stream.seed, stream.step = seed, step
    else:
        for p in parameters:
            _PENDING[p] = (seed, step)


def draw_seed(device: torch.device) -> int:
    """A 62-bit seed from torch's default generator (so `torch.manual_seed` before
    compiling makes runs repeat), the first rank's on every rank (collective)."""
    seed = torch.randint(0, 2 ** 62, (1,), dtype=torch.int64)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        seed = seed.to(device)
        dist.broadcast(seed, src=0)
    return int(seed.item())
