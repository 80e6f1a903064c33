"""Views, layout changes, indexing and concatenation."""

from __future__ import annotations

import torch

from ..serialization import ir
from .builder import GraphBuilder, meta_val, node_arg
from .registry import Unsupported, handles

aten = torch.ops.aten


def _static(shape) -> tuple[int, ...]:
    if any(isinstance(d, torch.SymInt) for d in shape):
        raise Unsupported("dynamic dimension in a shape op")
    return tuple(int(d) for d in shape)


@handles(aten.view_copy.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def reshape(b: GraphBuilder, node: torch.fx.Node) -> None:
    b.bind(node, b.reshape(b.get(node.args[0]), _static(meta_val(node).shape)))


def _transpose(b: GraphBuilder, node: torch.fx.Node, perm) -> None:
    x = b.get(node.args[0])
    out = meta_val(node)
    b.bind(node, b.emit(ir.TransposeNode, x.dtype, out.shape, a=x.tid, axes=list(perm)))


@handles(aten.permute_copy.default, aten.permute.default)
def permute(b: GraphBuilder, node: torch.fx.Node) -> None:
    rank = len(meta_val(node).shape)
    _transpose(b, node, [d % rank for d in node.args[1]])


@handles(aten.transpose_copy.int, aten.transpose.int)
def transpose(b: GraphBuilder, node: torch.fx.Node) -> None:
    rank = len(meta_val(node).shape)
    perm = list(range(rank))
    i, j = node.args[1] % rank, node.args[2] % rank
    perm[i], perm[j] = perm[j], perm[i]
    _transpose(b, node, perm)


@handles(aten.t_copy.default, aten.t.default)
def t(b: GraphBuilder, node: torch.fx.Node) -> None:
    _transpose(b, node, list(range(len(meta_val(node).shape)))[::-1])


@handles(aten.unsqueeze_copy.default, aten.unsqueeze.default)
def unsqueeze(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x = b.get(node.args[0])
    axis = node.args[1] % len(out.shape)
    b.bind(node, b.emit(ir.ExpandDimsNode, x.dtype, out.shape, a=x.tid, axes=[axis]))


@handles(aten.squeeze_copy.dims, aten.squeeze_copy.dim, aten.squeeze_copy.default,
         aten.squeeze.dims, aten.squeeze.dim, aten.squeeze.default)
def squeeze(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x = b.get(node.args[0])
    rank = len(x.shape)
    dims = node_arg(node, 1, "dim", list(range(rank)))
    dims = [dims] if isinstance(dims, int) else dims
    # torch ignores dims whose size is not 1
    axes = sorted({d % rank for d in dims if x.shape[d % rank] == 1}) if rank else []
    if not axes:
        b.bind(node, x)
        return
    b.bind(node, b.emit(ir.SqueezeNode, x.dtype, out.shape, a=x.tid, axes=axes))


@handles(aten.expand_copy.default, aten.expand.default)
def expand(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x = b.get(node.args[0])
    shape = _static(out.shape)
    b.bind(node, b.emit(ir.BroadcastToNode, x.dtype, shape, a=x.tid, shape=b.dims(shape)))


@handles(aten.slice_copy.Tensor, aten.slice.Tensor)
def slice_(b: GraphBuilder, node: torch.fx.Node) -> None:
    x = b.get(node.args[0])
    out = meta_val(node)
    shape = _static(x.shape)
    args = list(node.args) + [None] * (5 - len(node.args))
    dim = (args[1] or 0) % len(shape)
    start, end, step = args[2], args[3], args[4] or 1
    size = shape[dim]
    start = 0 if start is None else (start + size if start < 0 else start)
    end = size if end is None else (end + size if end < 0 else end)
    start, end = max(0, min(start, size)), max(0, min(end, size))
    starts, stops, strides = [0] * len(shape), list(shape), [1] * len(shape)
    starts[dim], stops[dim], strides[dim] = start, max(start, end), step
    b.bind(node, b.emit(ir.SliceNode, x.dtype, out.shape, a=x.tid, start=starts, stop=stops, strides=strides))


@handles(aten.select_copy.int, aten.select.int)
def select(b: GraphBuilder, node: torch.fx.Node) -> None:
    x = b.get(node.args[0])
    out = meta_val(node)
    dim = node.args[1] % len(x.shape)
    index = node.args[2]
    if isinstance(index, torch.SymInt):
        raise Unsupported("select at a dynamic index")
    index = index % x.shape[dim]
    idx = b.literal(index, torch.int32)
    b.bind(node, b.emit(ir.TakeNode, x.dtype, out.shape, a=x.tid, indices=idx.tid, axis=dim))


@handles(aten.cat.default)
def cat(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    # torch skips 1-d empty tensors in cat; promote the rest to the out dtype
    parts = [b.cast(b.get(a), out.dtype) for a in node.args[0] if tuple(meta_val(a).shape) != (0,)]
    dim = node_arg(node, 1, "dim", 0)
    dim %= len(out.shape)
    if len(parts) == 1:
        b.bind(node, parts[0])
        return
    b.bind(node, b.emit(ir.ConcatenateNode, out.dtype, out.shape, inputs=[p.tid for p in parts], axis=dim))


@handles(aten.embedding.default)
def embedding(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Rows of `weight`. An out-of-range id (torch raises IndexError) gives a
    NaN row for float weights: visible downstream (a SamplingHead returns -1)
    without a host synchronisation. The runtime never reads out of bounds."""
    out = meta_val(node)
    weight, ids = b.get(node.args[0]), b.get(node.args[1])
    rows = b.emit(ir.TakeNode, weight.dtype, out.shape, a=weight.tid, indices=ids.tid, axis=0)
    if not weight.dtype.is_floating_point:
        b.bind(node, rows)
        return
    lo = b.emit(ir.GreaterEqualNode, torch.bool, ids.shape, a=ids.tid, b=b.literal(0, ids.dtype).tid)
    hi = b.emit(ir.LessNode, torch.bool, ids.shape, a=ids.tid, b=b.literal(weight.shape[0], ids.dtype).tid)
    valid = b.emit(ir.LogicalAndNode, torch.bool, ids.shape, a=lo.tid, b=hi.tid)
    valid = b.emit(ir.ExpandDimsNode, torch.bool, (*ids.shape, 1), a=valid.tid, axes=[len(ids.shape)])
    nan = b.literal(float("nan"), weight.dtype)
    b.bind(node, b.emit(ir.WhereNode, weight.dtype, out.shape, condition=valid.tid, x=rows.tid, y=nan.tid))


@handles(aten.clone.default, aten.alias_copy.default, aten.alias.default, aten.detach_copy.default,
         aten.lift_fresh_copy.default)
def identity(b: GraphBuilder, node: torch.fx.Node) -> None:
    b.bind(node, b.get(node.args[0]))
