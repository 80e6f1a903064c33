"""Rotary embeddings that a family writes with complex numbers (Llama 4:
`torch.polar`, `view_as_complex`), in real arithmetic while the model is
traced: neither ExecuTorch's edge dialect nor MLX's graph takes complex
tensors. The rotary module then returns each position's factors as
[..., D/2, 2] (cos, sin, times its attention scaling), and the rotation of
each (even, odd) pair of a query or key is the complex product written out:
(a + ib)(c + is) = (ac - bs) + i(as + bc). The same numbers, real."""

from __future__ import annotations

import contextlib

import torch

from .module_globals import swapped

# The modeling modules whose rotary embedding is complex.
MODULES = ("transformers.models.llama4.modeling_llama4",)


def _factors(self, x, position_ids):
    """The rotary module's forward: [B, L, D/2, 2] real factors instead of complex ones."""
    freqs = position_ids[..., None].float() * self.inv_freq.float()
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, factors: torch.Tensor):
    """Queries and keys [B, L, H, D] rotated by `factors` [B, L, D/2, 2]."""
    cos, sin = factors[:, :, None, :, 0], factors[:, :, None, :, 1]

    def rotate(x: torch.Tensor) -> torch.Tensor:
        pairs = x.float().reshape(*x.shape[:-1], -1, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)

    return rotate(xq), rotate(xk)


@contextlib.contextmanager
def real_rotary(model: torch.nn.Module):
    """Within the block, the model's complex rotary embeddings (if any) compute in reals."""
    classes = {type(m) for m in model.modules()
               if type(m).__module__ in MODULES and type(m).__name__.endswith("RotaryEmbedding")}
    saved = [(cls, cls.forward) for cls in classes]
    for cls in classes:
        cls.forward = _factors
    try:
        with swapped(model, {"apply_rotary_emb": apply_rotary_emb}, MODULES):
            yield
    finally:
        for cls, forward in saved:
            cls.forward = forward
