"""GPT-Neo's local attention layers at the call's positions.

GPT-Neo masks each layer with rows of a causal mask it keeps (a band of
`window_size` keys for its local layers), taken from the end of the keys,
as if the cache held only what was written. Over a static cache longer than
the window, that masks the wrong keys; here the rows are those of the
call's positions (`cache_position`), the only change to its attention.
"""

from __future__ import annotations

import types

import torch


def _attn_at_positions(self, query, key, value, attention_mask=None):
    """GPT-Neo's `_attn`, with its mask's rows picked by position."""
    query, key = query.to(torch.float32), key.to(torch.float32)
    weights = torch.matmul(query, key.transpose(-1, -2))
    rows = self.bias[0, 0].index_select(0, self._mlx_positions)[:, :key.size(-2)]
    weights = torch.where(rows, weights, torch.tensor(torch.finfo(weights.dtype).min, dtype=weights.dtype))
    if attention_mask is not None:
        weights = weights + attention_mask
    weights = torch.nn.functional.softmax(weights, dim=-1).to(value.dtype)
    return torch.matmul(weights, value), weights


def position_local_attention(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Gives GPT-Neo's attention modules of `model` (none in other families)
    the `_attn` above; each call sets their `_mlx_positions` first."""
    modules = [m for m in model.modules() if type(m).__name__ == "GPTNeoSelfAttention"]
    for module in modules:
        module._attn = types.MethodType(_attn_at_positions, module)
    return modules
