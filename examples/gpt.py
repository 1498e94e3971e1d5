"""A small GPT: an ordinary single-device model that returns its scalar loss.

Nothing in it knows about piper_fx; the strategy is applied from outside.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GPTConfig:
    vocab_size: int = 65
    block_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 64
    tied_embeddings: bool = True
    # Mixture of experts: with n_expert > 0 every block's MLP is an MoE layer
    # of n_expert experts, each token routed to top_k of them.
    n_expert: int = 0
    top_k: int = 2
    aux_loss_weight: float = 0.01
    capacity_factor: float | None = None  # None: room for every token (see MoE)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        heads = lambda t: t.view(batch, seq, self.n_head, width // self.n_head).transpose(1, 2)  # noqa: E731
        y = F.scaled_dot_product_attention(heads(q), heads(k), heads(v), is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, expert_context=None) -> tuple[torch.Tensor, None]:
        return self.out(F.gelu(self.fc(x))), None


class Experts(nn.Module):
    """n_expert two-layer MLPs as batched weights: expert e maps the rows of x[e]."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        hidden = 4 * cfg.n_embd
        self.w_in = nn.Parameter(torch.randn(cfg.n_expert, cfg.n_embd, hidden) * 0.02)
        self.w_out = nn.Parameter(torch.randn(cfg.n_expert, hidden, cfg.n_embd) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (experts, capacity, width)
        return torch.bmm(F.gelu(torch.bmm(x, self.w_in)), self.w_out)


class MoE(nn.Module):
    """Top-k routed experts with a sequence-wise load-balancing loss.

    Tokens are dispatched into one fixed-size buffer per expert (so shapes
    stay static), in which every sequence has its own `capacity` slots: a
    sequence's tokens compete only with each other, so what a batch computes
    is the same whichever batch the sequence is in, and data-parallel training
    equals single-process training. With `capacity_factor` None the capacity
    is the sequence length: no token is ever dropped, however unevenly the
    router spreads them. Otherwise it is capacity_factor * seq * top_k / experts
    slots (GShard's capacity, per sequence): the choices that overflow an
    expert are dropped (their slot is a spare row whose result is not used).
    The balance loss is DeepSeek-V3's sequence-wise one: for each sequence, the
    fraction of its routed slots each expert got times the expert's mean
    router probability, so the loss of a batch is the mean over its sequences.
    """

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_expert, self.top_k, self.capacity_factor = cfg.n_expert, cfg.top_k, cfg.capacity_factor
        self.router = nn.Linear(cfg.n_embd, cfg.n_expert, bias=False)
        self.experts = Experts(cfg)

    def forward(self, x: torch.Tensor, expert_context=contextlib.nullcontext) -> tuple[torch.Tensor, torch.Tensor]:
        batch, seq, width = x.shape
        capacity = seq if self.capacity_factor is None else min(
            seq, math.ceil(self.capacity_factor * seq * self.top_k / self.n_expert))
        tokens = x.reshape(-1, width)
        probs = self.router(tokens).softmax(-1)
        top_p, expert = probs.topk(self.top_k, dim=-1)
        gates = top_p / top_p.sum(-1, keepdim=True)
        chosen = F.one_hot(expert.view(batch, seq * self.top_k), self.n_expert)  # (batch, seq * top_k, experts)
        slot = ((chosen.cumsum(1) - 1) * chosen).sum(-1)                      # place among its sequence's
        kept = slot < capacity
        spare = batch * capacity                                               # the row of dropped choices
        row = torch.where(kept, torch.arange(batch, device=x.device).unsqueeze(1) * capacity + slot, spare)
        expert, row, kept = expert.flatten(), row.flatten(), kept.flatten()
        buffer = tokens.new_zeros(self.n_expert, spare + 1, width)
        buffer = buffer.index_put((expert, row), tokens.repeat_interleave(self.top_k, 0))
        with expert_context():
            out = self.experts(buffer)
        routed = out[expert, row] * (kept.unsqueeze(-1) * gates.reshape(-1, 1))
        y = routed.view(-1, self.top_k, width).sum(1)
        load = chosen.float().mean(1) * self.n_expert
        importance = probs.view(batch, seq, self.n_expert).mean(1)
        return y.view(batch, seq, width), (load * importance).sum(-1).mean()


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MoE(cfg) if cfg.n_expert else MLP(cfg)

    def forward(self, x: torch.Tensor, expert_context=contextlib.nullcontext):
        x = x + self.attn(self.ln_1(x))
        y, aux_loss = self.mlp(self.ln_2(x), expert_context)
        return x + y, aux_loss


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tied_embeddings:
            self.lm_head.weight = self.wte.weight
        # What each block runs inside, and what the experts of an MoE block
        # run inside: a strategy may tag them as regions, e.g.
        # `model.block_context = lambda: piper_fx.annotate("PP")`.
        self.block_context = contextlib.nullcontext
        self.expert_context = contextlib.nullcontext
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(positions)
        aux_losses = []
        for block in self.blocks:
            with self.block_context():
                x, aux_loss = block(x, self.expert_context)
            if aux_loss is not None:
                aux_losses.append(aux_loss)
        logits = self.lm_head(self.ln_f(x))
        loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
        if aux_losses:
            loss = loss + self.cfg.aux_loss_weight * sum(aux_losses) / len(aux_losses)
        return loss

    def experts(self) -> list[nn.Module]:
        """The expert modules of the MoE blocks (none for a dense GPT)."""
        return [block.mlp.experts for block in self.blocks if isinstance(block.mlp, MoE)]
