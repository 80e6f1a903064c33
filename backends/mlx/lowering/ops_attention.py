"""Attention: torch's scaled_dot_product_attention onto MLX's fused kernel."""

from __future__ import annotations

import math

import torch

from ..serialization import ir
from ..custom_kernel_ops import attention as _attention_op  # noqa: F401  (defines the op)
from .builder import GraphBuilder, Value, meta_val, node_arg
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
    mask = None if mask_arg is None else b.get(mask_arg)
    b.bind(node, _attend(b, q, k, v, mask, float(scale), causal, meta_val(node)))


def _attend(b: GraphBuilder, q, k, v, mask, scale: float, causal: bool, out) -> Value:
    """One ScaledDotProductAttentionNode; `out` is the node's example output."""
    fields = dict(q=q.tid, k=b.cast(k, q.dtype).tid, v=b.cast(v, q.dtype).tid, scale=scale, causal=causal)
    if mask is not None:
        fields["mask"] = (mask if mask.dtype == torch.bool else b.cast(mask, q.dtype)).tid
    return b.emit(ir.ScaledDotProductAttentionNode, out.dtype, out.shape, **fields)


def _prefix(b: GraphBuilder, x: Value, axis: int, n: Value) -> Value:
    """x[..., :n, ...] along `axis`, n a run-time 0-d size."""
    stops = b.dims(x.shape)
    stops[axis] = ir.IntOrSlot(value=0, slot=n.tid.idx)
    return b.emit(ir.DynSliceNode, x.dtype, x.shape, a=x.tid, start=b.dims((0,) * len(x.shape)), stop=stops,
                  strides=[1] * len(x.shape))


@handles(torch.ops.mlx.written_attention.default)
def written_attention(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Slices keys, values and mask to the first n = max(written) + 1 slots
    (clamped into [1, T]; custom_kernel_ops/attention.py), then attends."""
    q_arg, k_arg, v_arg, mask_arg, written_arg, scale = node.args
    q, mask, written = b.get(q_arg), b.get(mask_arg), b.get(written_arg)
    k, v = (b.get(unrepeated_kv(b, a)) for a in (k_arg, v_arg))
    if len(q.shape) != 4 or len(k.shape) != 4 or len(v.shape) != 4 or len(written.shape) != 1:
        raise Unsupported("written_attention on tensors other than [B, H, L, D] and [N] slots")
    slots = k.shape[2]
    if any(isinstance(d, torch.SymInt) for d in (q.shape[1], k.shape[1], q.shape[-1], slots)):
        raise Unsupported("written_attention with dynamic heads, head size or cache length")
    if q.shape[1] % k.shape[1] != 0:
        raise Unsupported("query heads not a multiple of key/value heads")
    if mask.shape[-1] not in (1, slots):
        raise Unsupported("written_attention mask neither per slot nor broadcast")
    last = b.emit(ir.MaxNode, written.dtype, (), a=written.tid, axes=[0], keepdims=False)
    n = b.emit(ir.AddNode, torch.int64, (), a=b.cast(last, torch.int64).tid, b=b.literal(1, torch.int64).tid)
    n = b.emit(ir.MaximumNode, torch.int64, (), a=n.tid, b=b.literal(1, torch.int64).tid)
    n = b.emit(ir.MinimumNode, torch.int64, (), a=n.tid, b=b.literal(int(slots), torch.int64).tid)
    k, v = _prefix(b, k, 2, n), _prefix(b, v, 2, n)
    if mask.shape[-1] == slots:
        mask = _prefix(b, mask, len(mask.shape) - 1, n)
    b.bind(node, _attend(b, q, k, v, mask, float(scale), False, meta_val(node)))
