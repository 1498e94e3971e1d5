"""Errors raised by piper_fx.

`PiperConfigError` is raised before anything runs, for a strategy that cannot
be honoured; it always names the option key, the value given and what would be
valid. `PiperError` is for a model or call that piper_fx cannot compile or
run. `PeerFailedError` ends the step of every rank but the one that failed
first, naming that rank (`runtime.failures`).

All derive from Dynamo's `ShortenTraceback`, the one exception family Dynamo
lets out of a backend unwrapped, so `step(x, y)` raises them as themselves
rather than as a generic `BackendCompilerFailed`.
"""
import torch.distributed as dist
from .compat import ShortenTraceback


class PiperError(ShortenTraceback):
    """A model, graph or call that piper_fx cannot handle."""

    def __init__(self, message: str):
        super().__init__(message, first_useful_frame=None)


class PiperConfigError(PiperError, ValueError):
    """A bad `options` value, raised before any rank runs anything."""

    def __init__(self, key: str, value, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(f"options[{key!r}] = {value!r} is invalid: {valid}")


class PeerFailedError(PiperError, dist.DistError):
    """This rank's step stopped because another rank failed first.

    Raised from this rank's own error (usually the communication error of a
    receive or collective its peer never joined). `failed_rank` failed
    `failed_where` (e.g. "in task B0.2") with `failed_error` (its type and
    message, as text); this rank stopped `where`. Also a
    `torch.distributed.DistError`, as the communication failure it is here.
    """

    def __init__(self, rank: int, where: str, failed_rank: int, failed_where: str, failed_error: str):
        self.rank, self.where = rank, where
        self.failed_rank, self.failed_where, self.failed_error = failed_rank, failed_where, failed_error
        super().__init__(f"piper_fx rank {rank}: rank {failed_rank} failed {failed_where}: {failed_error} "
                         f"(rank {rank} stopped {where})")

    def __reduce__(self):  # picklable, e.g. to hand back from a worker process
        return type(self), (self.rank, self.where, self.failed_rank, self.failed_where, self.failed_error)
