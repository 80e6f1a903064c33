"""A decoder layer's chains of small IR nodes as single nodes.

Around its products, a decoder layer lowers to chains of views and small
ops: q, k and v are each a slice of the fused projection, a reshape, a
transpose (and a rotation); a cache write is a transpose, an added axis and
a scatter; attention reads slices of the caches and its output is transposed
and reshaped back; a gated MLP slices its fused product in two. Each node
costs the runtime an MLX array per call and, on a CPU, a scheduled task: on
the ~104M Llama of benchmarks/bench_llm.py, 315 nodes a decode step, each a
few microseconds of the graph builder's and of the stream thread's time.
This pass rewrites, on the lowered graph:

    [slice of the last axis] -> reshape [B, L, H, D] [-> rms norm] -> transpose (1, 2) [-> rope]
        => HeadsNode
    transpose (2, 0, 1, 3) -> expand_dims 3 -> scatter on axis 2 (one index)
        => CacheWriteNode
    HeadsNode -> CacheWriteNode (float32)
        => HeadsNode with cache
    prefix slices [:n] of k and v (and the mask) -> attention
        => ScaledDotProductAttentionNode with keys n
    attention -> transpose (1, 2) -> reshape [B, L, H * Dv]
        => ScaledDotProductAttentionNode with merge_heads
    two halves of one last axis -> silu(a, b)
        => SiluNode with halves
    experts' rows [T, k, N] * weights [T, k, 1] -> sum over k
        => GatherLinearNode / GatherQuantizedLinearNode with weights
    expand_dims -> expand_dims
        => one ExpandDimsNode
    rms norm (float32) -> linear layer
        => LinearNode / QuantizedLinearNode with norm
    int32 ids cast to int64 -> experts
        => the experts node reading the int32 ids

A fused node takes over the slot of its chain's last node, so what reads that
value is unchanged; a chain's inner values must have no other reader (else
the chain is left alone, computed once), except the slices of the caches
attention reads, which stay for their other readers. The nodes left unread
are then dropped (common_nodes.drop_dead_nodes). Every fused node computes
the same values as its chain: the same arithmetic on the same elements.
"""

from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from ..serialization import ir
from .common_nodes import drop_dead_nodes, reads
from .sizes import same_size


class _Graph:
    """The graph's producers, readers per slot, and the builder's shapes."""

    def __init__(self, graph: ir.Graph, shapes: dict[int, tuple], dtypes: dict[int, torch.dtype]):
        self.shapes, self.dtypes = shapes, dtypes
        self.producer = {n.op.out.idx: n.op for n in graph.nodes}
        self.readers = Counter(slot for n in graph.nodes for slot in reads(n.op))
        self.readers.update(io.slot for io in graph.outputs)
        self.readers.update(b.update for b in graph.mutable_buffers)

    def made_by(self, tid: ir.Tid | None, kind, *, only_reader: bool = True):
        """The node of type `kind` that makes `tid`, if `tid` has no other
        reader than the one asking (when `only_reader`)."""
        if tid is None:
            return None
        op = self.producer.get(tid.idx)
        if not isinstance(op, kind) or (only_reader and self.readers[tid.idx] != 1):
            return None
        return op

    def shape(self, tid: ir.Tid) -> tuple | None:
        return self.shapes.get(tid.idx)


def _static(d: ir.IntOrSlot) -> int | None:
    return d.value if d.slot < 0 else None


def _slice_bounds(op) -> tuple[list, list, list] | None:
    """(start, stop, strides) of a Slice or DynSlice node, entries int or IntOrSlot."""
    if isinstance(op, ir.SliceNode):
        return list(op.start), list(op.stop), list(op.strides)
    if isinstance(op, ir.DynSliceNode):
        to_int = lambda d: d if d.slot >= 0 else d.value  # noqa: E731
        return [to_int(d) for d in op.start], [to_int(d) for d in op.stop], list(op.strides)
    return None


def _last_axis_slice(g: _Graph, op) -> tuple[ir.Tid, int, int] | None:
    """(source, c0, c1) when `op` is x[..., c0:c1] of a source x, every other
    axis whole."""
    bounds = _slice_bounds(op)
    src, out = (g.shape(op.a), g.shape(op.out)) if bounds else (None, None)
    if src is None or out is None or len(src) != len(out) or not src:
        return None
    start, stop, strides = bounds
    c0, c1 = start[-1], stop[-1]
    if any(s != 1 for s in strides) or not all(isinstance(c, int) for c in (c0, c1, src[-1])):
        return None
    if not 0 <= c0 <= c1 <= src[-1] or any(s != 0 for s in start[:-1]):
        return None
    if not all(same_size(a, b) for a, b in zip(src[:-1], out[:-1])):
        return None
    return op.a, c0, c1


def _heads(g: _Graph, op) -> ir.HeadsNode | None:
    """A rotation of, or a transpose (1, 2) of, heads viewed out of x [B, L, C]
    (each head normalized before the transpose: a q/k norm)."""
    rotation, t = (None, op) if isinstance(op, ir.TransposeNode) else ((op.cos, op.sin), g.made_by(op.x, ir.TransposeNode))
    if t is None or list(t.axes) != [0, 2, 1, 3]:
        return None
    norm = g.made_by(t.a, ir.RmsNormNode)
    if norm is not None and norm.weight is None:
        return None
    r = g.made_by(norm.a if norm else t.a, ir.ReshapeNode)
    if r is None or len(r.shape) != 4 or None in (_static(r.shape[2]), _static(r.shape[3])):
        return None
    heads, head_dim = _static(r.shape[2]), _static(r.shape[3])
    split = _last_axis_slice(g, g.made_by(r.a, (ir.SliceNode, ir.DynSliceNode)))
    x, start = (split[0], split[1]) if split else (r.a, 0)
    x_shape, viewed = g.shape(x), g.shape(r.out)
    if x_shape is None or viewed is None or len(x_shape) != 3 or not isinstance(x_shape[2], int):
        return None
    if not (same_size(x_shape[0], viewed[0]) and same_size(x_shape[1], viewed[1])):
        return None
    width = (split[2] - split[1]) if split else x_shape[2]
    if width != heads * head_dim:
        return None
    cos, sin = rotation or (None, None)
    fused = ir.HeadsNode(x=x, start=start, heads=heads, head_dim=head_dim, cos=cos, sin=sin, out=op.out)
    if norm is not None:
        fused.norm, fused.eps = norm.weight, norm.eps
    return fused


def _cache_write(g: _Graph, op: ir.ScatterNode) -> ir.CacheWriteNode | None:
    """cache[:, :, slots] = update, as a scatter takes it."""
    cache = g.shape(op.a)
    if cache is None or len(cache) != 4 or len(op.indices) != 1 or list(op.axes) not in ([2], [-2]):
        return None
    e = g.made_by(op.updates, ir.ExpandDimsNode)
    t = e and list(e.axes) == [3] and g.made_by(e.a, ir.TransposeNode)
    if not t or list(t.axes) != [2, 0, 1, 3]:
        return None
    slots, update = g.shape(op.indices[0]), g.shape(t.a)
    if slots is None or len(slots) != 1 or update is None or len(update) != 4:
        return None
    if not all(same_size(update[d], cache[d]) for d in (0, 1, 3)):
        return None  # (a scatter may write a smaller block; a cache write writes whole rows)
    return ir.CacheWriteNode(cache=op.a, slots=op.indices[0], update=t.a, out=op.out)


def _heads_into_cache(g: _Graph, op: ir.CacheWriteNode) -> ir.HeadsNode | None:
    """A cache write of heads (float32) as the HeadsNode that writes them."""
    h = g.made_by(op.update, ir.HeadsNode)
    if h is None or h.cache is not None:
        return None
    if not all(g.dtypes.get(t.idx) == torch.float32 for t in (op.cache, op.update)):
        return None  # (a cache of another type takes the heads rounded: CacheWriteNode's cast)
    return dataclasses.replace(h, cache=op.cache, slots=op.slots, out=op.out)


def _prefix(g: _Graph, tid: ir.Tid | None, axis: int) -> tuple[ir.Tid, int] | None:
    """(source, slot of n) when `tid` is source[:n] along `axis` (n a
    run-time value), every other axis whole."""
    op = g.made_by(tid, ir.DynSliceNode, only_reader=False)
    src, out = (g.shape(op.a), g.shape(op.out)) if op else (None, None)
    if src is None or out is None or len(src) != len(out):
        return None
    axis %= len(src)
    n = op.stop[axis]
    if n.slot < 0 or any(s != 1 for s in op.strides) or any(d.slot >= 0 or d.value != 0 for d in op.start):
        return None
    if not all(same_size(a, b) for i, (a, b) in enumerate(zip(src, out)) if i != axis):
        return None
    return op.a, n.slot


def _attended_prefix(g: _Graph, op: ir.ScaledDotProductAttentionNode) -> ir.ScaledDotProductAttentionNode | None:
    """Attention over prefixes k[:, :, :n] and v[:, :, :n] of whole caches
    (and the mask's first n columns) as attention over the first n keys."""
    k, v = _prefix(g, op.k, 2), _prefix(g, op.v, 2)
    if op.causal or op.keys is not None or not k or not v or k[1] != v[1]:
        return None
    mask = op.mask
    if mask is not None:
        m, shape = _prefix(g, mask, -1), g.shape(mask)
        if m and m[1] == k[1] and same_size(g.shape(m[0])[-1], g.shape(k[0])[2]):
            mask = m[0]
        elif shape is None or not shape or shape[-1] != 1:
            return None  # a mask cut to n columns some other way
    return dataclasses.replace(op, k=k[0], v=v[0], mask=mask, keys=ir.Tid(k[1]))


def _merged_heads(g: _Graph, op: ir.ReshapeNode) -> ir.ScaledDotProductAttentionNode | None:
    """Attention's output transposed (1, 2) and reshaped to [B, L, H * Dv]."""
    t = g.made_by(op.a, ir.TransposeNode)
    a = t and list(t.axes) == [0, 2, 1, 3] and g.made_by(t.a, ir.ScaledDotProductAttentionNode)
    if not a or a.merge_heads:
        return None
    out, merged = g.shape(a.out), g.shape(op.out)
    if out is None or merged is None or len(out) != 4 or len(merged) != 3:
        return None
    if not (isinstance(out[1], int) and isinstance(out[3], int) and same_size(merged[2], out[1] * out[3])
            and same_size(merged[0], out[0]) and same_size(merged[1], out[2])):
        return None
    return dataclasses.replace(a, merge_heads=True, out=op.out)


def _silu_halves(g: _Graph, op: ir.SiluNode) -> ir.SiluNode | None:
    """silu(x[..., :N]) * x[..., N:] of one x [..., 2N]."""
    if op.b is None or op.halves:
        return None
    gate = _last_axis_slice(g, g.made_by(op.a, (ir.SliceNode, ir.DynSliceNode)))
    up = _last_axis_slice(g, g.made_by(op.b, (ir.SliceNode, ir.DynSliceNode)))
    if not gate or not up or gate[0] != up[0]:
        return None
    n = gate[2]
    if (gate[1], up[1], up[2]) != (0, n, 2 * n) or g.shape(gate[0])[-1] != 2 * n:
        return None
    return ir.SiluNode(a=gate[0], out=op.out, halves=True)


def _combined_experts(g: _Graph, op: ir.SumNode):
    """An experts layer's rows times their weights, summed over the experts:
    the layer's node with `weights`."""
    y_shape = g.shape(op.a)
    if op.keepdims or y_shape is None or len(y_shape) != 3 or [a % 3 for a in op.axes] != [1]:
        return None
    m = g.made_by(op.a, ir.MultiplyNode)
    for y, e in ((m.a, m.b), (m.b, m.a)) if m else ():
        expand = g.made_by(e, ir.ExpandDimsNode)
        experts = g.made_by(y, (ir.GatherLinearNode, ir.GatherQuantizedLinearNode))
        if expand is None or experts is None or experts.weights is not None or [a % 3 for a in expand.axes] != [2]:
            continue
        w = g.shape(expand.a)
        if w is None or len(w) != 2 or not all(same_size(a, b) for a, b in zip(w, y_shape[:2])):
            continue
        if not all(g.dtypes.get(t.idx) == torch.float32 for t in (expand.a, y, op.out)):
            continue
        return dataclasses.replace(experts, weights=expand.a, out=op.out)
    return None


def _normed_input(g: _Graph, op):
    """A linear layer of rms_norm(x) (float32, a decoder's norm before its
    projections) as the layer with `norm`."""
    norm = g.made_by(op.x, ir.RmsNormNode)
    if op.norm is not None or norm is None or norm.weight is None:
        return None
    if not all(g.dtypes.get(t.idx) == torch.float32 for t in (norm.a, norm.weight, norm.out)):
        return None  # (the kernel normalizes float32 rows; a bfloat16 norm rounds its output)
    return dataclasses.replace(op, x=norm.a, norm=norm.weight, norm_eps=norm.eps)


def _any_integer_ids(g: _Graph, op):
    """An experts node's ids read as the router gives them: the kernels and
    MLX's gathers take any integer type (top-k's int32, cast to torch's int64)."""
    cast = g.made_by(op.indices, ir.AsTypeNode, only_reader=False)
    if cast is None or g.dtypes.get(cast.a.idx) != torch.int32 or g.dtypes.get(cast.out.idx) != torch.int64:
        return None  # (a widening cast only: the same values)
    return dataclasses.replace(op, indices=cast.a)


def _merged_expand(g: _Graph, op: ir.ExpandDimsNode) -> ir.ExpandDimsNode | None:
    """expand_dims of an expand_dims as one (a causal mask's [L] -> [1, 1, L, 1])."""
    inner = g.made_by(op.a, ir.ExpandDimsNode)
    out, mid = g.shape(op.out), g.shape(op.a)
    if inner is None or out is None or mid is None:
        return None
    added = {a % len(out) for a in op.axes}
    kept = [p for p in range(len(out)) if p not in added]  # the output's axes that were `mid`'s, in order
    added.update(kept[a % len(mid)] for a in inner.axes)
    return ir.ExpandDimsNode(a=inner.a, axes=sorted(added), out=op.out)


# In this order: a rotation takes its transpose before that transpose could
# be fused alone, and a cache write's update is a HeadsNode by then (which
# then writes the cache itself).
_PASSES = (
    (ir.RopeNode, _heads),
    (ir.TransposeNode, _heads),
    (ir.ScatterNode, _cache_write),
    (ir.CacheWriteNode, _heads_into_cache),
    (ir.ScaledDotProductAttentionNode, _attended_prefix),
    (ir.ReshapeNode, _merged_heads),
    (ir.SiluNode, _silu_halves),
    (ir.SumNode, _combined_experts),
    (ir.ExpandDimsNode, _merged_expand),
    (ir.GatherLinearNode, _any_integer_ids),
    (ir.GatherQuantizedLinearNode, _any_integer_ids),
    (ir.LinearNode, _normed_input),
    (ir.QuantizedLinearNode, _normed_input),
)


def fuse_nodes(graph: ir.Graph, shapes: dict[int, tuple], dtypes: dict[int, torch.dtype]) -> None:
    """Rewrites `graph` in place; `shapes` and `dtypes`: each slot's at
    export (sizes ints, or torch.SymInt where dynamic)."""
    for kind, fuse in _PASSES:
        g = _Graph(graph, shapes, dtypes)
        for i, node in enumerate(graph.nodes):
            if isinstance(node.op, kind) and (fused := fuse(g, node.op)) is not None:
                graph.nodes[i] = ir.Node(op=fused)
                g.producer[fused.out.idx] = fused  # (a chain of three is fused from its first link)
        drop_dead_nodes(graph)
