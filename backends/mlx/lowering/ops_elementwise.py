"""Elementwise ops: arithmetic, comparisons, logic, activations, casts."""

from __future__ import annotations

import dataclasses
import math
import operator

import torch

from ..serialization import ir
from .builder import GraphBuilder, Value, meta_val, node_arg
from .registry import Unsupported, aten_op, handles
from .sizes import same_shape

aten = torch.ops.aten


def _example(arg):
    """A value torch.result_type accepts: a (fake) tensor, or the scalar."""
    if isinstance(arg, Value):
        return torch.empty(arg.shape, dtype=arg.dtype, device="meta")
    return meta_val(arg) if isinstance(arg, torch.fx.Node) else arg


_COMPARISONS = (ir.EqualNode, ir.NotEqualNode, ir.LessNode, ir.LessEqualNode, ir.GreaterNode, ir.GreaterEqualNode)


def _unchanged(b: GraphBuilder, op_cls, x: Value, y: Value, out_shape) -> Value | None:
    """The operand that x <op> y equals, when the other is a literal that
    changes nothing: x * 1 (a rotary table's attention scaling of 1.0), and
    x + 0 or x - 0 in integers (in floats, -0.0 + 0 is +0.0)."""
    pairs = {ir.MultiplyNode: ((x, y), (y, x)), ir.AddNode: ((x, y), (y, x)), ir.SubtractNode: ((x, y),)}
    neutral = 1 if op_cls is ir.MultiplyNode else 0
    for kept, other in pairs.get(op_cls, ()):
        if neutral == 0 and (kept.dtype.is_floating_point or kept.dtype.is_complex or kept.dtype == torch.bool):
            continue
        if b.literal_value(other) == neutral and same_shape(kept.shape, out_shape):
            return kept
    return None


def binary(b: GraphBuilder, op_cls, x, y, out_dtype: torch.dtype, out_shape) -> Value:
    """x <op> y computed in torch's promoted type, then cast to `out_dtype`."""
    compute = torch.result_type(_example(x), _example(y))
    if op_cls is ir.DivideNode and not compute.is_floating_point:
        compute = out_dtype  # true division of integers yields floats
    xv, yv = b.operand(x, compute), b.operand(y, compute)
    if (same := _unchanged(b, op_cls, xv, yv, out_shape)) is not None:
        return b.cast(same, out_dtype)
    made = torch.bool if op_cls in _COMPARISONS else compute  # (no cast of a comparison to bool)
    return b.cast(b.emit(op_cls, made, out_shape, a=xv.tid, b=yv.tid), out_dtype)


def bind_binary(b: GraphBuilder, node: torch.fx.Node, op_cls, x, y) -> None:
    out = meta_val(node)
    b.bind(node, binary(b, op_cls, x, y, out.dtype, out.shape))


def _binary_handler(op_cls, *ops):
    @handles(*ops)
    def handler(b: GraphBuilder, node: torch.fx.Node) -> None:
        bind_binary(b, node, op_cls, node.args[0], node.args[1])

    return handler


for _cls, _ops in [
    (ir.MultiplyNode, (aten.mul.Scalar,)),
    (ir.MaximumNode, (aten.maximum.default,)),
    (ir.MinimumNode, (aten.minimum.default,)),
    (ir.RemainderNode, (aten.remainder.Tensor, aten.remainder.Scalar)),
    (ir.EqualNode, (aten.eq.Tensor, aten.eq.Scalar)),
    (ir.NotEqualNode, (aten.ne.Tensor, aten.ne.Scalar)),
    (ir.LessNode, (aten.lt.Tensor, aten.lt.Scalar)),
    (ir.LessEqualNode, (aten.le.Tensor, aten.le.Scalar)),
    (ir.GreaterNode, (aten.gt.Tensor, aten.gt.Scalar)),
    (ir.GreaterEqualNode, (aten.ge.Tensor, aten.ge.Scalar)),
    (ir.PowerNode, (aten.pow.Tensor_Tensor, aten.pow.Tensor_Scalar, aten.pow.Scalar)),
    (ir.BitwiseAndNode, (aten.bitwise_and.Tensor, aten.bitwise_and.Scalar)),
    (ir.BitwiseOrNode, (aten.bitwise_or.Tensor, aten.bitwise_or.Scalar)),
    (ir.BitwiseXorNode, (aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar)),
]:
    _binary_handler(_cls, *_ops)


def _is(node, *ops) -> bool:
    return isinstance(node, torch.fx.Node) and aten_op(node.target) in ops


def rms_norm_eps(b: GraphBuilder, x, r):
    """eps if `r` is rsqrt(mean(x^2 over the last axis, keepdim) + eps)
    (the RMSNorm of transformers' models, decomposed), else None."""
    if not _is(r, aten.rsqrt.default) or not _is(r.args[0], aten.add.Tensor, aten.add.Scalar):
        return None
    mean, eps = r.args[0].args[:2]
    if not _is(mean, aten.mean.dim) or not _is(mean.args[0], aten.pow.Tensor_Scalar):
        return None
    sq = mean.args[0]
    dims, keepdim = node_arg(mean, 1, "dim"), node_arg(mean, 2, "keepdim", False)
    rank = len(meta_val(x).shape)
    if sq.args[0] is not x or sq.args[1] != 2 or not keepdim or [d % rank for d in dims] != [rank - 1]:
        return None
    if isinstance(eps, torch.fx.Node):
        eps = b.literal_value(b.get(eps)) if eps in b.values else None
    return float(eps) if isinstance(eps, (int, float)) else None


def _rms_norm(b: GraphBuilder, node) -> tuple | None:
    """(x, eps) if `node` is x * rsqrt(mean(x^2) + eps) in x's floating dtype."""
    if not _is(node, aten.mul.Tensor):
        return None
    out = meta_val(node)
    for a, r in (node.args[:2], node.args[1::-1]):
        eps = rms_norm_eps(b, a, r) if isinstance(a, torch.fx.Node) else None
        if eps is not None and meta_val(a).dtype == out.dtype and out.dtype.is_floating_point:
            return a, eps
    return None


@handles(aten.mul.Tensor)
def mul(b: GraphBuilder, node: torch.fx.Node) -> None:
    """x * rsqrt(mean(x^2) + eps) is one RmsNormNode; weight * that (float32:
    transformers' RMSNorm) is one RmsNormNode with the weight, the same
    roundings. (The norm node lowered first is then dead and dropped.)
    silu(gate) * up is one SiluNode."""
    x, y = node.args[:2]
    out = meta_val(node)
    if (gated := _gated_silu(node)) is not None:  # (the SiluNode lowered first is then dead and dropped)
        gate, up = gated
        b.bind(node, b.emit(ir.SiluNode, out.dtype, out.shape, a=b.get_upstream(gate).tid, b=b.get(up).tid))
        return
    if (norm := _rms_norm(b, node)) is not None:
        b.bind(node, b.emit(ir.RmsNormNode, out.dtype, out.shape, a=b.get(norm[0]).tid, eps=norm[1]))
        return
    for w, n in ((x, y), (y, x)):
        norm = _rms_norm(b, n)
        if (norm is None or len(n.users) != 1 or not isinstance(w, torch.fx.Node) or out.dtype != torch.float32
                or meta_val(n).dtype != torch.float32 or meta_val(w).dtype != torch.float32
                or tuple(meta_val(w).shape) != tuple(out.shape[-1:]) or tuple(meta_val(n).shape) != tuple(out.shape)):
            continue
        b.bind(node, b.emit(ir.RmsNormNode, out.dtype, out.shape, a=b.get_upstream(norm[0]).tid,
                            weight=b.get(w).tid, eps=norm[1]))
        return
    bind_binary(b, node, ir.MultiplyNode, x, y)


def _last_axis(node, dim) -> bool:
    return dim % len(meta_val(node).shape) == len(meta_val(node).shape) - 1


def _half_of(s, x, first: bool) -> bool:
    """Whether `s` is x[..., :D/2] (first) or x[..., D/2:] (not first)."""
    if not _is(s, aten.slice_copy.Tensor, aten.slice.Tensor) or s.args[0] is not x:
        return False
    dim, start, end = node_arg(s, 1, "dim", 0), node_arg(s, 2, "start", None), node_arg(s, 3, "end", None)
    D = meta_val(x).shape[-1]
    if not isinstance(D, int) or D % 2 or node_arg(s, 4, "step", 1) != 1 or not _last_axis(x, dim):
        return False
    start = start or 0
    return (start == 0 and end == D // 2) if first else (start == D // 2 and (end is None or end >= D))


def _rotate_half_of(rot, x) -> bool:
    """Whether `rot` is concat(-x[..., D/2:], x[..., :D/2]) on the last axis."""
    if not _is(rot, aten.cat.default) or not _last_axis(rot, node_arg(rot, 1, "dim", 0)):
        return False
    parts = rot.args[0]
    return (len(parts) == 2 and _is(parts[0], aten.neg.default) and _half_of(parts[0].args[0], x, first=False)
            and _half_of(parts[1], x, first=True))


def _rope(node) -> tuple | None:
    """(x, cos, sin) if `node` is x * cos + rotate_half(x) * sin (transformers'
    apply_rotary_pos_emb) in one floating dtype, cos and sin broadcasting to x."""
    if not _is(node, aten.add.Tensor) or node_arg(node, 2, "alpha", 1) != 1:
        return None
    out = meta_val(node)
    for p, q in (node.args[:2], node.args[1::-1]):
        if not (_is(p, aten.mul.Tensor) and _is(q, aten.mul.Tensor)):
            continue
        for x, cos in (p.args[:2], p.args[1::-1]):
            for rot, sin in (q.args[:2], q.args[1::-1]):
                if not all(isinstance(t, torch.fx.Node) for t in (x, cos, rot, sin)) or not _rotate_half_of(rot, x):
                    continue
                if (all(meta_val(t).dtype == out.dtype for t in (x, cos, sin)) and out.dtype.is_floating_point
                        and tuple(meta_val(x).shape) == tuple(out.shape)
                        and meta_val(cos).shape[-1:] == meta_val(sin).shape[-1:] == out.shape[-1:]):
                    return x, cos, sin
    return None


_PRODUCTS = (aten.linear.default, torch.ops.mlx.quantized_linear.default)


def _with_residual(b: GraphBuilder, node) -> Value | None:
    """A linear layer's output plus a float32 tensor of its shape (a
    decoder's residual stream), as the layer's own node with that residual:
    one node instead of two, the same float additions in the same order
    (the layer's node lowered first is then dead and dropped). None where
    the add is another."""
    out = meta_val(node)
    if b.scratch or node_arg(node, 2, "alpha", 1) != 1 or out.dtype != torch.float32:
        return None
    for p, r in (node.args[:2], node.args[1::-1]):
        if not (_is(p, *_PRODUCTS) and len(p.users) == 1 and isinstance(r, torch.fx.Node) and p in b.values):
            continue
        if any(meta_val(t).dtype != out.dtype or tuple(meta_val(t).shape) != tuple(out.shape) for t in (p, r)):
            continue
        op = b.producer(b.get(p))
        if isinstance(op, (ir.LinearNode, ir.QuantizedLinearNode)) and op.residual is None:
            fused = b.new_value(out.dtype, out.shape)
            b.graph.nodes.append(ir.Node(op=dataclasses.replace(op, residual=b.get(r).tid, out=fused.tid)))
            return fused
    return None


def _add_sub_handler(op_cls, *ops):
    @handles(*ops)
    def handler(b: GraphBuilder, node: torch.fx.Node) -> None:
        x, y = node.args[0], node.args[1]
        if op_cls is ir.AddNode and (fused := _with_residual(b, node)) is not None:
            b.bind(node, fused)
            return
        if op_cls is ir.AddNode and (rope := _rope(node)) is not None:
            # One RopeNode; the pieces lowered before are dead and dropped.
            out = meta_val(node)
            x, cos, sin = (b.get_upstream(t).tid for t in rope)
            b.bind(node, b.emit(ir.RopeNode, out.dtype, out.shape, x=x, cos=cos, sin=sin))
            return
        alpha = node_arg(node, 2, "alpha", 1)
        if alpha != 1:  # x + alpha * y
            ye = _example(y)
            y = binary(b, ir.MultiplyNode, y, alpha, torch.result_type(ye, alpha), getattr(ye, "shape", ()))
        bind_binary(b, node, op_cls, x, y)

    return handler


_add_sub_handler(ir.AddNode, aten.add.Tensor, aten.add.Scalar)
_add_sub_handler(ir.SubtractNode, aten.sub.Tensor, aten.sub.Scalar)


@handles(aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode)
def div(b: GraphBuilder, node: torch.fx.Node) -> None:
    mode = node.kwargs.get("rounding_mode")
    if mode not in (None, "floor"):
        raise Unsupported(f"div with rounding_mode={mode!r}")
    bind_binary(b, node, ir.FloorDivideNode if mode == "floor" else ir.DivideNode, node.args[0], node.args[1])


@handles(aten.logical_and.default, aten.logical_or.default)
def logical_binary(b: GraphBuilder, node: torch.fx.Node) -> None:
    x, y = (b.operand(a, torch.bool) for a in node.args[:2])
    op_cls = ir.LogicalAndNode if aten_op(node.target) == aten.logical_and.default else ir.LogicalOrNode
    b.bind(node, b.cast(b.emit(op_cls, torch.bool, meta_val(node).shape, a=x.tid, b=y.tid), meta_val(node).dtype))


@handles(aten.logical_not.default)
def logical_not(b: GraphBuilder, node: torch.fx.Node) -> None:
    x = b.operand(node.args[0], torch.bool)
    b.bind(node, b.cast(b.emit(ir.LogicalNotNode, torch.bool, x.shape, a=x.tid), meta_val(node).dtype))


@handles(aten.bitwise_not.default)
def bitwise_not(b: GraphBuilder, node: torch.fx.Node) -> None:
    """Logical not of bools, ~x = x ^ -1 of integers."""
    out = meta_val(node)
    if out.dtype == torch.bool:
        logical_not(b, node)
        return
    x = b.get(node.args[0])
    b.bind(node, b.emit(ir.BitwiseXorNode, out.dtype, out.shape, a=x.tid, b=b.literal(-1, out.dtype).tid))


def unary(b: GraphBuilder, op_cls, x, dtype: torch.dtype):
    return b.emit(op_cls, dtype, x.shape, a=x.tid)


def _unary_handler(op_cls, *ops):
    @handles(*ops)
    def handler(b: GraphBuilder, node: torch.fx.Node) -> None:
        out = meta_val(node)
        x = b.operand(node.args[0], out.dtype)  # float ops on ints compute in float
        b.bind(node, unary(b, op_cls, x, out.dtype))

    return handler


for _cls, _op in [
    (ir.NegativeNode, aten.neg.default),
    (ir.ExpNode, aten.exp.default),
    (ir.LogNode, aten.log.default),
    (ir.Expm1Node, aten.expm1.default),
    (ir.Log1pNode, aten.log1p.default),
    (ir.SqrtNode, aten.sqrt.default),
    (ir.RsqrtNode, aten.rsqrt.default),
    (ir.AbsNode, aten.abs.default),
    (ir.SigmoidNode, aten.sigmoid.default),
    (ir.TanhNode, aten.tanh.default),
    (ir.SinNode, aten.sin.default),
    (ir.CosNode, aten.cos.default),
    (ir.FloorNode, aten.floor.default),
]:
    _unary_handler(_cls, _op)


@handles(aten.reciprocal.default)
def reciprocal(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)  # floating (torch promotes integers)
    x = b.operand(node.args[0], out.dtype)
    b.bind(node, b.emit(ir.DivideNode, out.dtype, out.shape, a=b.literal(1, out.dtype).tid, b=x.tid))


@handles(aten.relu.default)
def relu(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    x = b.get(node.args[0])
    b.bind(node, b.emit(ir.MaximumNode, out.dtype, out.shape, a=x.tid, b=b.literal(0, out.dtype).tid))


@handles(aten.silu.default)
def silu(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    b.bind(node, b.emit(ir.SiluNode, out.dtype, out.shape, a=b.operand(node.args[0], out.dtype).tid))


def _gated_silu(node) -> tuple | None:
    """(gate, up) if `node` is silu(gate) * up of one shape and floating dtype
    (a SwiGLU MLP), the silu read by nothing else."""
    out = meta_val(node)
    for s, up in (node.args[:2], node.args[1::-1]):
        if (_is(s, aten.silu.default) and len(s.users) == 1 and isinstance(up, torch.fx.Node)
                and out.dtype.is_floating_point
                and meta_val(s.args[0]).dtype == meta_val(s).dtype == out.dtype == meta_val(up).dtype
                and tuple(meta_val(s).shape) == tuple(meta_val(up).shape) == tuple(out.shape)):
            return s.args[0], up
    return None


@handles(aten.gelu.default)
def gelu(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    dt, shape = out.dtype, out.shape
    x = b.get(node.args[0])
    approximate = node_arg(node, 1, "approximate", "none")

    def mul(p, q):
        return b.emit(ir.MultiplyNode, dt, shape, a=p.tid, b=q.tid)

    if approximate == "none":  # 0.5 x (1 + erf(x / sqrt 2))
        inner = unary(b, ir.ErfNode, mul(x, b.literal(1 / math.sqrt(2), dt)), dt)
    elif approximate == "tanh":  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        cube = mul(mul(x, x), x)
        poly = b.emit(ir.AddNode, dt, shape, a=x.tid, b=mul(cube, b.literal(0.044715, dt)).tid)
        inner = unary(b, ir.TanhNode, mul(poly, b.literal(math.sqrt(2 / math.pi), dt)), dt)
    else:
        raise Unsupported(f"gelu approximate={approximate!r}")
    one_plus = b.emit(ir.AddNode, dt, shape, a=inner.tid, b=b.literal(1, dt).tid)
    b.bind(node, mul(mul(x, one_plus), b.literal(0.5, dt)))


@handles(aten.where.self)
def where(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    cond = b.operand(node.args[0], torch.bool)
    x, y = (b.operand(a, out.dtype) for a in node.args[1:3])
    b.bind(node, b.emit(ir.WhereNode, out.dtype, out.shape, condition=cond.tid, x=x.tid, y=y.tid))


@handles(aten.clamp.default, aten.clamp.Tensor)
def clamp(b: GraphBuilder, node: torch.fx.Node) -> None:
    out = meta_val(node)
    lo, hi = node_arg(node, 1, "min"), node_arg(node, 2, "max")
    v = b.operand(node.args[0], out.dtype)
    if lo is not None:
        v = b.emit(ir.MaximumNode, out.dtype, out.shape, a=v.tid, b=b.operand(lo, out.dtype).tid)
    if hi is not None:
        v = b.emit(ir.MinimumNode, out.dtype, out.shape, a=v.tid, b=b.operand(hi, out.dtype).tid)
    b.bind(node, v)


@handles(aten._to_copy.default, torch.ops.dim_order_ops._to_dim_order_copy.default,
         torch.ops.dim_order_ops._clone_dim_order.default)  # edge's form of clone
def to_copy(b: GraphBuilder, node: torch.fx.Node) -> None:
    """A dtype cast (or plain copy). Layout changes are not: MLX arrays are row-major."""
    out = meta_val(node)
    dim_order = node.kwargs.get("dim_order")
    if dim_order is not None and list(dim_order) != list(range(out.dim())):
        raise Unsupported(f"copy to dim order {list(dim_order)}")
    if node.kwargs.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
        raise Unsupported(f"copy to memory format {node.kwargs['memory_format']}")
    b.bind(node, b.cast(b.get(node.args[0]), out.dtype))


@handles(aten.isnan.default)
def isnan(b: GraphBuilder, node: torch.fx.Node) -> None:
    x = b.get(node.args[0])
    b.bind(node, b.emit(ir.IsNanNode, torch.bool, x.shape, a=x.tid))


@handles(aten.copy.default)
def copy(b: GraphBuilder, node: torch.fx.Node) -> None:
    """copy(self, src): `src` cast to self's dtype and broadcast to its shape
    (functional form of `self.copy_(src)`; a buffer's new value)."""
    out = meta_val(node)
    src = b.operand(node.args[1], out.dtype)
    if tuple(src.shape) != tuple(out.shape):
        src = b.emit(ir.BroadcastToNode, out.dtype, out.shape, a=src.tid, shape=b.dims(out.shape))
    b.bind(node, src)


@handles(aten.native_layer_norm.default)
def layer_norm(b: GraphBuilder, node: torch.fx.Node) -> None:
    """LayerNorm over the last axis, one LayerNormNode (MLX's fast kernel).
    Only the normalized output may be used: the mean and rstd outputs (for
    training) are not computed."""
    x, shape, weight, bias, eps = node.args[:5]
    value = b.get(x)
    if len(shape) != 1 or not value.shape or shape[0] != value.shape[-1]:
        raise Unsupported("layer_norm over more than the last axis")
    if any(user.target is not operator.getitem or user.args[1] != 0 for user in node.users):
        raise Unsupported("layer_norm's mean or rstd output is used")
    out = meta_val(node)[0]
    args = {}
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None:
            if meta_val(t).dtype != out.dtype:
                raise Unsupported(f"layer_norm {name} of another dtype than its input")
            args[name] = b.get(t).tid
    b.bind(node, [b.emit(ir.LayerNormNode, out.dtype, out.shape, a=value.tid, eps=float(eps), **args)])
