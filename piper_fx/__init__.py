"""piper_fx: a torch.compile backend for distributed training.

    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    loss = step(x, y); loss.backward(); opt.step()
    state = piper_fx.full_state_dict(model)
"""
from .backend import piper_backend, register as _register
from .errors import PiperConfigError, PiperError
from .options import Strategy, parse_options
from .prepare import prepare
from .state_dict import full_state_dict

_register()

__all__ = ["PiperConfigError", "PiperError", "Strategy", "full_state_dict", "parse_options",
           "piper_backend", "prepare"]
