"""A small built-in language model for the demo and tests (random weights).

Tokens [B, S] -> logits [B, S, vocab]: embedding, causal-free MLP mixing of
positions, and an output projection. Small enough to export in seconds.
"""

from __future__ import annotations

import torch


class TinyLM(torch.nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, window: int = 8, seed: int = 0):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(window, dim, generator=gen) * 0.1)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.out = torch.nn.Linear(dim, vocab)
        with torch.no_grad():
            for p in self.parameters():
                if p is not self.pos:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
        self.window = window

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens) + self.pos
        h = h + self.mlp(h)
        return self.out(torch.nn.functional.silu(h)) * 4.0
