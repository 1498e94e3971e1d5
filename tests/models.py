"""Small models with pipeline shapes the GPT does not have."""
import torch
import torch.nn.functional as F
from torch import nn

import piper_fx

WIDTH = 8


class SkipAcrossStages(nn.Module):
    """Four PP regions; the first region's output is read again by the last (a skip across stages)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x, y):
        with piper_fx.annotate("PP"):
            first = torch.tanh(self.layers[0](x))
        h = first
        for layer in self.layers[1:3]:
            with piper_fx.annotate("PP"):
                h = torch.tanh(layer(h))
        with piper_fx.annotate("PP"):
            h = torch.tanh(self.layers[3](h)) + first
        return F.mse_loss(self.head(h), y)


class TwoStreams(nn.Module):
    """Each PP region passes two tensors to the next."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.b = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(2 * WIDTH, 1)

    def forward(self, x, y):
        a, b = x, x * 0.5
        for la, lb in zip(self.a, self.b):
            with piper_fx.annotate("PP"):
                a, b = torch.tanh(la(a) + b), torch.sigmoid(lb(b) - a)
        return F.mse_loss(self.head(torch.cat([a, b], dim=-1)), y)


MODELS = {"skip": SkipAcrossStages, "two_streams": TwoStreams}


def batch(step: int, rows: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(rows, WIDTH, generator=g), torch.randn(rows, 1, generator=g)
