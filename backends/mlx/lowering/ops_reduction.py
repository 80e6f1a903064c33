"""Reductions along axes, arg-reductions, top-k and (log-)softmax."""

from __future__ import annotations

import operator

import torch

from ..serialization import ir
from .builder import GraphBuilder, meta_val, node_arg
from .registry import Unsupported, handles

aten = torch.ops.aten


def norm_axes(dims, rank: int) -> list[int]:
    """Non-negative axes; None or [] means every axis (as in torch).

    A 0-d tensor has no axis: torch accepts dim 0 / -1 there and reduces
    nothing, so the answer is [] (MLX rejects axis 0 of a 0-d array)."""
    if rank == 0:
        return []
    if dims is None or (isinstance(dims, (list, tuple)) and len(dims) == 0):
        return list(range(rank))
    if isinstance(dims, int):
        dims = [dims]
    return sorted({d % rank for d in dims})


def _reduce_handler(op_cls, *ops, float_only: bool = False):
    @handles(*ops)
    def handler(b: GraphBuilder, node: torch.fx.Node) -> None:
        out = meta_val(node)
        x = b.get(node.args[0])
        axes = norm_axes(node_arg(node, 1, "dim"), len(x.shape))
        keepdim = bool(node_arg(node, 2, "keepdim", False))
        # sum of ints accumulates in int64 (torch); mean needs a float type
        compute = out.dtype if (float_only or op_cls is ir.SumNode) else x.dtype
        x = b.cast(x, compute)
        r = b.emit(op_cls, compute, out.shape, a=x.tid, axes=axes, keepdims=keepdim)
        b.bind(node, b.cast(r, out.dtype))

    return handler


_reduce_handler(ir.SumNode, aten.sum.dim_IntList, aten.sum.default)
_reduce_handler(ir.MeanNode, aten.mean.dim, aten.mean.default, float_only=True)
_reduce_handler(ir.MaxNode, aten.amax.default)
_reduce_handler(ir.MinNode, aten.amin.default)


def _bool_reduce_handler(op_cls, *ops):
    @handles(*ops)
    def handler(b: GraphBuilder, node: torch.fx.Node) -> None:
        out = meta_val(node)
        x = b.operand(node.args[0], torch.bool)
        axes = norm_axes(node_arg(node, 1, "dim"), len(x.shape))
        keepdim = bool(node_arg(node, 2, "keepdim", False))
        r = b.emit(op_cls, torch.bool, out.shape, a=x.tid, axes=axes, keepdims=keepdim)
        b.bind(node, b.cast(r, out.dtype))

    return handler


_bool_reduce_handler(ir.AnyNode, aten.any.dim, aten.any.dims, aten.any.default)
_bool_reduce_handler(ir.AllNode, aten.all.dim, aten.all.dims, aten.all.default)


@handles(aten.cumsum.default)
def cumsum(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x = b.cast(b.get(node.args[0]), out.dtype)  # torch accumulates ints (and bools) in int64
    if len(x.shape) == 0:
        b.bind(node, x)
        return
    axis = node.args[1] % len(x.shape)
    b.bind(node, b.emit(ir.CumsumNode, out.dtype, out.shape, a=x.tid, axis=axis, reverse=False, inclusive=True))


def _argreduce_handler(op_cls, *ops):
    @handles(*ops)
    def handler(b: GraphBuilder, node: torch.fx.Node) -> None:
        out = meta_val(node)
        x = b.get(node.args[0])
        dim = node_arg(node, 1, "dim")
        keepdim = bool(node_arg(node, 2, "keepdim", False))
        if dim is None or len(x.shape) == 0:  # over the flattened tensor (a 0-d one has no axis)
            n = 1
            for s in x.shape:
                n *= s
            x = b.reshape(x, (n,))
            dim, keepdim_here = 0, False
        else:
            dim, keepdim_here = dim % max(len(x.shape), 1), keepdim
        shape = out.shape if keepdim_here == keepdim else ()
        r = b.emit(op_cls, torch.int32, shape, a=x.tid, axis=dim, keepdims=keepdim_here)
        r = b.cast(r, out.dtype)  # MLX returns uint32 indices
        b.bind(node, b.reshape(r, out.shape))

    return handler


_argreduce_handler(ir.ArgmaxNode, aten.argmax.default)
_argreduce_handler(ir.ArgminNode, aten.argmin.default)


def _reduce_with_index_handler(value_cls, index_cls, op):
    @handles(op)
    def handler(b: GraphBuilder, node: torch.fx.Node) -> None:
        """(values, indices) along one axis; the indices only when read."""
        values, indices = meta_val(node)
        x = b.get(node.args[0])
        if len(x.shape) == 0:
            raise Unsupported(f"{op} of a 0-d tensor")
        axis, keepdim = node.args[1] % len(x.shape), bool(node_arg(node, 2, "keepdim", False))
        v = b.emit(value_cls, x.dtype, values.shape, a=x.tid, axes=[axis], keepdims=keepdim)
        i = None
        if any(user.target is operator.getitem and user.args[1] == 1 for user in node.users):
            i = b.cast(b.emit(index_cls, torch.int32, indices.shape, a=x.tid, axis=axis, keepdims=keepdim),
                       indices.dtype)
        b.bind(node, [v, i])

    return handler


_reduce_with_index_handler(ir.MaxNode, ir.ArgmaxNode, aten.max.dim)
_reduce_with_index_handler(ir.MinNode, ir.ArgminNode, aten.min.dim)


@handles(aten.topk.default)
def topk(b: GraphBuilder, node: torch.fx.Node) -> None:
    """(values, indices) of the k largest (or smallest) along `dim`, in
    order; equal values in index order (torch leaves their order open)."""
    values, indices = meta_val(node)
    x = b.get(node.args[0])
    k = node.args[1]
    if not isinstance(k, int) or len(x.shape) == 0:
        raise Unsupported("topk needs a fixed k and at least one axis")
    axis = node_arg(node, 2, "dim", -1) % len(x.shape)
    keys = b.cast(x, x.dtype if x.dtype.is_floating_point else torch.float32)
    if not node_arg(node, 3, "largest", True):
        keys = b.emit(ir.NegativeNode, keys.dtype, keys.shape, a=keys.tid)
    ids = b.emit(ir.ArgTopKNode, torch.int32, indices.shape, a=keys.tid, k=k, axis=axis)
    picked = b.emit(ir.TakeAlongAxisNode, x.dtype, values.shape, a=x.tid, indices=ids.tid, axis=axis)
    b.bind(node, [b.cast(picked, values.dtype), b.cast(ids, indices.dtype)])


def _softmax_input(b: GraphBuilder, node: torch.fx.Node):
    """The input, cast to the output dtype, and the softmax axes. A 0-d input
    (torch accepts dim 0 / -1) is viewed as shape (1,), since MLX needs an
    axis; the caller reshapes the result back to the output's shape."""
    out = meta_val(node)
    x = b.cast(b.get(node.args[0]), out.dtype)
    if len(x.shape) == 0:
        return b.reshape(x, (1,)), [0]
    return x, norm_axes(node.args[1], len(x.shape))


@handles(aten._softmax.default, aten.softmax.int)
def softmax(b: GraphBuilder, node: torch.fx.Node) -> None:
    x, axis = _softmax_input(b, node)
    # precise: accumulate low-precision inputs in float32, like torch
    r = b.emit(ir.SoftmaxNode, x.dtype, x.shape, a=x.tid, axes=axis, precise=True)
    b.bind(node, b.reshape(r, meta_val(node).shape))


@handles(aten._log_softmax.default, aten.log_softmax.int)
def log_softmax(b: GraphBuilder, node: torch.fx.Node) -> None:
    x, axis = _softmax_input(b, node)
    reduced = tuple(1 if i in axis else s for i, s in enumerate(x.shape))
    lse = b.emit(ir.LogSumExpNode, x.dtype, reduced, a=x.tid, axes=axis, keepdims=True)
    r = b.emit(ir.SubtractNode, x.dtype, x.shape, a=x.tid, b=lse.tid)
    b.bind(node, b.reshape(r, meta_val(node).shape))
