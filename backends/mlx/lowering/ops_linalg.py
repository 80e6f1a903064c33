"""Matrix products."""

from __future__ import annotations

import torch

from ..serialization import ir
from .builder import GraphBuilder, meta_val, node_arg
from .registry import Unsupported, handles

aten = torch.ops.aten


def _matmul(b: GraphBuilder, x, y, out) -> object:
    xv, yv = b.cast(b.get(x), out.dtype), b.cast(b.get(y), out.dtype)
    if not out.dtype.is_floating_point:
        raise Unsupported("integer matmul")  # MLX's matmul is floating-point only
    return b.emit(ir.MatmulNode, out.dtype, out.shape, a=xv.tid, b=yv.tid)


@handles(aten.mm.default, aten.bmm.default, aten.matmul.default)
def mm(b: GraphBuilder, node: torch.fx.Node) -> None:
    b.bind(node, _matmul(b, node.args[0], node.args[1], meta_val(node)))


@handles(aten.addmm.default)
def addmm(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    beta = node.kwargs.get("beta", 1)
    alpha = node.kwargs.get("alpha", 1)
    prod = _matmul(b, node.args[1], node.args[2], out)
    if alpha != 1:
        prod = b.emit(ir.MultiplyNode, out.dtype, out.shape, a=prod.tid, b=b.literal(alpha, out.dtype).tid)
    if beta == 0:  # torch ignores the input then: its nan and inf do not propagate
        b.bind(node, prod)
        return
    bias = b.cast(b.get(node.args[0]), out.dtype)
    if beta != 1:
        bias = b.emit(ir.MultiplyNode, out.dtype, bias.shape, a=bias.tid, b=b.literal(beta, out.dtype).tid)
    b.bind(node, b.emit(ir.AddNode, out.dtype, out.shape, a=prod.tid, b=bias.tid))


@handles(aten.linear.default)
def linear(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x @ W^T + bias (kept whole by the partitioner: see ops_to_not_decompose)."""
    out = meta_val(node)
    if not out.dtype.is_floating_point:
        raise Unsupported("integer linear")
    x, w = (b.cast(b.get(a), out.dtype) for a in node.args[:2])
    bias = node_arg(node, 2, "bias")
    fields = dict(x=x.tid, weight=w.tid)
    if bias is not None:
        fields["bias"] = b.cast(b.get(bias), out.dtype).tid
    b.bind(node, b.emit(ir.LinearNode, out.dtype, out.shape, **fields))
