"""piper_fx: a torch.compile backend for distributed training.

    piper_fx.prepare(model, options)
    step = torch.compile(model, backend="piper", options=options)
    loss = step(x, y); loss.backward(); opt.step()
    state = piper_fx.full_state_dict(model)
    piper_fx.clip_grad_norm_(model, max_norm)         # the norm over every rank's pieces
    with piper_fx.no_sync(model): ...                  # gradient accumulation without communication
    piper_fx.save_checkpoint(path, model, opt, step=n); piper_fx.load_checkpoint(path, model, opt)
"""
from .annotate import annotate
from .backend import piper_backend, register as _register
from .checkpoint import load_checkpoint, model_state_dict, optimizer_state_dict, save_checkpoint
from .clipping import clip_grad_norm_
from .compile_stats import last_compile_stats
from .errors import PeerFailedError, PiperConfigError, PiperError
from .gradient_sync import no_sync, set_requires_gradient_sync
from .options import Strategy, parse_options
from .prepare import prepare
from .sharding.experts import mark_experts
from .runtime.step import last_step_stats, last_step_trace
from .state_dict import full_state_dict
from . import schedules

_register()

__all__ = ["annotate", "clip_grad_norm_", "PeerFailedError", "PiperConfigError", "PiperError", "Strategy",
           "full_state_dict", "load_checkpoint", "model_state_dict", "optimizer_state_dict", "parse_options",
           "last_compile_stats", "last_step_stats", "last_step_trace", "mark_experts", "no_sync", "piper_backend", "prepare",
           "save_checkpoint", "schedules", "set_requires_gradient_sync"]
