"""Tensors created from sizes and scalars."""

from __future__ import annotations

import torch

from ..serialization import ir
from .builder import GraphBuilder, ir_dtype, meta_val
from .registry import Unsupported, handles

aten = torch.ops.aten


def _full(b: GraphBuilder, node: torch.fx.Node, value) -> None:
    out = meta_val(node)
    if isinstance(value, torch.fx.Node):  # a size, e.g. scalar_tensor(sym_size)
        value = meta_val(value)
    if isinstance(value, torch.SymFloat):
        raise Unsupported("a dynamic float fill value")
    v = b.cast(b.sym_value(value), out.dtype) if isinstance(value, torch.SymInt) else b.literal(value, out.dtype)
    b.bind(node, b.emit(ir.FullNode, out.dtype, out.shape, shape=b.dims(out.shape), value=v.tid,
                        dtype=ir_dtype(out.dtype)))


@handles(aten.full.default, aten.full_like.default)
def full(b: GraphBuilder, node: torch.fx.Node) -> None:
    _full(b, node, node.args[1])


@handles(aten.scalar_tensor.default)
def scalar_tensor(b: GraphBuilder, node: torch.fx.Node) -> None:
    """A 0-d tensor holding a Python scalar (e.g. from `torch.where(c, x, 0.0)`)."""
    _full(b, node, node.args[0])


@handles(aten.zeros.default, aten.zeros_like.default, aten.empty.memory_format,
         torch.ops.dim_order_ops._empty_dim_order.default)  # (edge's empty: its values are unspecified)
def zeros(b: GraphBuilder, node: torch.fx.Node) -> None:
    _full(b, node, 0)


@handles(aten.ones.default, aten.ones_like.default)
def ones(b: GraphBuilder, node: torch.fx.Node) -> None:
    _full(b, node, 1)


@handles(aten.arange.start_step, aten.arange.default, aten.arange.start)
def arange(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    args = list(node.args)
    if len(args) == 1:
        start, end, step = 0, args[0], 1
    else:
        start, end = args[0], args[1]
        step = args[2] if len(args) > 2 else node.kwargs.get("step", 1)
    start, end, step = (meta_val(a) if isinstance(a, torch.fx.Node) else a for a in (start, end, step))
    if any(isinstance(a, torch.SymFloat) for a in (start, end, step)):
        raise Unsupported("arange with dynamic float bounds")
    if any(isinstance(a, torch.SymInt) for a in (start, end, step)):
        b.bind(node, b.emit(ir.DynArangeNode, out.dtype, out.shape, range=[b.size(a) for a in (start, end, step)],
                            dtype=ir_dtype(out.dtype)))
        return
    b.bind(node, b.emit(ir.ArangeNode, out.dtype, out.shape, start=float(start), stop=float(end),
                        step=float(step), dtype=ir_dtype(out.dtype)))
