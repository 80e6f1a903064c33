"""Rotary embeddings that a family writes with complex numbers (Llama 4,
DeepSeek-V2: `torch.polar`, `view_as_complex`), in real arithmetic while the model is
traced: neither ExecuTorch's edge dialect nor MLX's graph takes complex
tensors. The rotary module then returns each position's factors as
[..., D/2, 2] (cos, sin, times its attention scaling), and the rotation of
each (even, odd) pair of a query or key is the complex product written out:
(a + ib)(c + is) = (ac - bs) + i(as + bc). The same numbers, real."""

from __future__ import annotations

import contextlib

import torch

from .module_globals import swapped

# The modeling modules whose rotary embedding is complex, and the axis of the heads in the queries and keys they
# rotate (Llama 4's are [B, L, H, D], DeepSeek-V2's [B, H, L, D]).
MODULES = {"transformers.models.llama4.modeling_llama4": 2, "transformers.models.deepseek_v2.modeling_deepseek_v2": 1}


def _factors(self, x, position_ids):
    """The rotary module's forward: [B, L, D/2, 2] real factors instead of complex ones."""
    freqs = position_ids[..., None].float() * self.inv_freq.float()
    return torch.stack([freqs.cos(), freqs.sin()], dim=-1) * self.attention_scaling


def rotation(heads_axis: int):
    """The family's apply_rotary_emb: queries and keys rotated by `factors`
    [B, L, D/2, 2], with their heads on `heads_axis`."""

    def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, factors: torch.Tensor):
        cos, sin = factors[..., 0].unsqueeze(heads_axis), factors[..., 1].unsqueeze(heads_axis)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            pairs = x.float().reshape(*x.shape[:-1], -1, 2)
            a, b = pairs[..., 0], pairs[..., 1]
            return torch.stack([a * cos - b * sin, a * sin + b * cos], dim=-1).flatten(3).type_as(x)

        return rotate(xq), rotate(xk)

    return apply_rotary_emb


@contextlib.contextmanager
def real_rotary(model: torch.nn.Module):
    """Within the block, the model's complex rotary embeddings (if any) compute in reals."""
    classes = {type(m) for m in model.modules()
               if type(m).__module__ in MODULES and type(m).__name__.endswith("RotaryEmbedding")}
    saved = [(cls, cls.forward) for cls in classes]
    for cls in classes:
        cls.forward = _factors
    try:
        with contextlib.ExitStack() as stack:
            for module, heads_axis in MODULES.items():
                stack.enter_context(swapped(model, {"apply_rotary_emb": rotation(heads_axis)}, (module,)))
            yield
    finally:
        for cls, forward in saved:
            cls.forward = forward
