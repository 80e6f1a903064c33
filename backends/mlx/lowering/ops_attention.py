"""Attention: torch's scaled_dot_product_attention onto MLX's fused kernel."""

from __future__ import annotations

import math

import torch

from ..serialization import ir
from .builder import GraphBuilder, meta_val, node_arg
from .registry import Unsupported, handles

aten = torch.ops.aten


def _target_name(node) -> str:
    return str(getattr(node, "target", ""))


def unrepeated_kv(b: GraphBuilder, arg):
    """The [B, Hkv, S, D] source of a key/value that was repeated to every
    query head (transformers' repeat_kv: unsqueeze(2), expand, clone, view),
    or `arg` itself. MLX's attention takes fewer key/value heads directly, so
    the copy of the whole cache per layer and step is never made."""
    node = arg
    if "view" not in _target_name(node):
        return arg
    node = node.args[0]
    if "clone" in _target_name(node):
        node = node.args[0]
    if "expand" not in _target_name(node):
        return arg
    node = node.args[0]
    if "unsqueeze" not in _target_name(node) or node.args[1] != 2:
        return arg
    src = node.args[0]
    src_shape, out_shape = meta_val(src).shape, meta_val(arg).shape
    if len(src_shape) != 4 or len(out_shape) != 4 or str(src_shape[2:]) != str(out_shape[2:]):
        return arg
    return src if src in b.values else arg  # a support check sees only the node's own inputs


@handles(aten.scaled_dot_product_attention.default)
def sdpa(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Kept whole by the partitioner (see ops_to_not_decompose). Grouped
    query attention (fewer key/value heads) needs no repeated K/V in MLX."""
    q = b.get(node.args[0])
    k, v = (b.get(unrepeated_kv(b, a)) for a in node.args[1:3])
    out = meta_val(node)
    mask_arg = node_arg(node, 3, "attn_mask")
    dropout = node_arg(node, 4, "dropout_p", 0.0)
    causal = bool(node_arg(node, 5, "is_causal", False))
    scale = node_arg(node, 6, "scale")
    if dropout:
        raise Unsupported("attention dropout")
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4:
        raise Unsupported("attention on tensors other than [B, H, L, D]")
    if any(isinstance(d, torch.SymInt) for d in (q.shape[1], k.shape[1], q.shape[-1])):
        raise Unsupported("attention with dynamic head counts or head size")
    if q.shape[1] % k.shape[1] != 0:
        raise Unsupported("query heads not a multiple of key/value heads")
    if causal:
        # torch's causal mask is aligned top-left, MLX's bottom-right: equal
        # only for square attention.
        if str(q.shape[2]) != str(k.shape[2]):
            raise Unsupported("is_causal attention with different query and key lengths")
        if mask_arg is not None:
            raise Unsupported("is_causal with an explicit mask")
    if scale is None:
        scale = 1.0 / math.sqrt(int(q.shape[-1]))
    fields = dict(q=q.tid, k=b.cast(k, q.dtype).tid, v=b.cast(v, q.dtype).tid, scale=float(scale), causal=causal)
    if mask_arg is not None:
        mask = b.get(mask_arg)
        fields["mask"] = (mask if mask.dtype == torch.bool else b.cast(mask, q.dtype)).tid
    b.bind(node, b.emit(ir.ScaledDotProductAttentionNode, out.dtype, out.shape, **fields))
