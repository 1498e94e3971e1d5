"""Errors raised by piper_fx.

`PiperConfigError` is raised before anything runs, for a strategy that cannot
be honoured; it always names the option key, the value given and what would be
valid. `PiperError` is for a model or call that piper_fx cannot compile.

Both derive from Dynamo's `ShortenTraceback`, the one exception family Dynamo
lets out of a backend unwrapped, so `step(x, y)` raises them as themselves
rather than as a generic `BackendCompilerFailed`.
"""
from torch._dynamo.exc import ShortenTraceback


class PiperError(ShortenTraceback):
    """A model, graph or call that piper_fx cannot handle."""

    def __init__(self, message: str):
        super().__init__(message, first_useful_frame=None)


class PiperConfigError(PiperError, ValueError):
    """A bad `options` value, raised before any rank runs anything."""

    def __init__(self, key: str, value, valid: str):
        self.key, self.value, self.valid = key, value, valid
        super().__init__(f"options[{key!r}] = {value!r} is invalid: {valid}")
