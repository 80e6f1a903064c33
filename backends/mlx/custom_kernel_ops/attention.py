"""`mlx::written_attention`: attention over the written prefix of a static KV cache.

    torch.ops.mlx.written_attention(q[B, H, L, D], k[B, Hkv, T, D], v[B, Hkv, T, Dv],
                                    mask[..., T] or [..., 1], written[N], scale) -> [B, H, L, Dv]

is scaled_dot_product_attention(q, k, v, mask, scale) restricted to the key
slots 0 .. n-1, where n = max(written) + 1 (clamped into [1, T]): `written`
holds the cache slots this call wrote. In a causal decoder every slot after
the last written one is masked anyway, so the result is the same as over the
whole cache; what changes is the cost, which follows the position instead of
the exported maximum context. The export of an LLM (llm/export/attention.py) puts
this op where transformers attends over its static cache; the lowering is in
`lowering/ops_attention.py`.
"""

from __future__ import annotations

import torch

torch.library.define(
    "mlx::written_attention",
    "(Tensor q, Tensor k, Tensor v, Tensor mask, Tensor written, float scale) -> Tensor",
)


def written_length(written: torch.Tensor, slots: int) -> int:
    """n: the key slots attended to (always at least one)."""
    last = int(written.max()) if written.numel() else 0
    return max(1, min(last + 1, slots))


@torch.library.impl("mlx::written_attention", "CompositeExplicitAutograd")
def written_attention(q, k, v, mask, written, scale):
    n = written_length(written, k.shape[2])
    if mask.shape[-1] != 1:
        mask = mask[..., :n]
    return torch.nn.functional.scaled_dot_product_attention(
        q, k[:, :, :n], v[:, :, :n], attn_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])


@torch.library.register_fake("mlx::written_attention")
def _fake(q, k, v, mask, written, scale):
    return q.new_empty((*q.shape[:-1], v.shape[-1]))
