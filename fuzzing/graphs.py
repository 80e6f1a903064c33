"""One small valid graph per node type of the schema (the fuzzer's seeds).

`GRAPHS[name]()` builds a graph in which node type `name` runs on valid
arguments, reduced to the template's float32 scalar (see sketch.py);
`tests/test_fuzz.py` checks that every node type of the schema has one and
that each runs.
"""

from __future__ import annotations

from executorch_mlx.serialization import ir
from executorch_mlx.serialization.sampler_params import BY_NAME, ROW_PARAMS, TABLE_PARAMS
from .sketch import BOOL, F16, F32, I64, U32, Sketch, sizes

BINARY = ["Add", "Subtract", "Multiply", "Divide", "Power", "Maximum", "Minimum", "Equal", "NotEqual", "Less",
          "LessEqual", "Greater", "GreaterEqual", "Remainder", "FloorDivide"]
UNARY = ["Negative", "Exp", "Log", "Sqrt", "Rsqrt", "Abs", "Sigmoid", "Tanh", "Erf", "IsNan", "IsPosInf", "Sin",
         "Cos", "Expm1", "Log1p", "Floor"]
REDUCE = ["Sum", "Mean", "Max", "Min", "LogSumExp"]


def _binary(name):
    def build():
        s = Sketch()
        return s.finish(s.op(getattr(ir, name + "Node"), a=s.x, b=s.y), 3)
    return build


def _unary(name):
    def build():
        s = Sketch()
        return s.finish(s.op(getattr(ir, name + "Node"), a=s.x), 3)
    return build


def _reduce(name):
    def build():
        s = Sketch()
        return s.finish(s.op(getattr(ir, name + "Node"), a=s.x, axes=[1], keepdims=False), 2)
    return build


def _bool_pair(s: Sketch):
    return s.op(ir.GreaterNode, a=s.x, b=s.y), s.op(ir.LessNode, a=s.x, b=s.lit(0.5))


def _logical(name):
    def build():
        s = Sketch()
        a, b = _bool_pair(s)
        return s.finish(s.op(getattr(ir, name + "Node"), a=a, b=b), 3)
    return build


def _bool_reduce(name):
    def build():
        s = Sketch()
        a, _ = _bool_pair(s)
        return s.finish(s.op(getattr(ir, name + "Node"), a=a, axes=[0, 2], keepdims=True), 3)
    return build


def _bitwise(name):
    def build():
        s = Sketch()
        return s.finish(s.op(getattr(ir, name + "Node"), a=s.i, b=s.lit(3, I64)), 2)
    return build


def logical_not():
    s = Sketch()
    return s.finish(s.op(ir.LogicalNotNode, a=_bool_pair(s)[0]), 3)


def right_shift():
    s = Sketch()
    return s.finish(s.op(ir.RightShiftNode, a=s.i, b=s.lit(1, I64)), 2)


def where():
    s = Sketch()
    return s.finish(s.op(ir.WhereNode, condition=_bool_pair(s)[0], x=s.x, y=s.y), 3)


def as_type():
    s = Sketch()
    return s.finish(s.op(ir.AsTypeNode, a=s.x, dtype=F16), 3)


def matmul():
    s = Sketch()
    yt = s.op(ir.TransposeNode, a=s.y, axes=[0, 2, 1])
    return s.finish(s.op(ir.MatmulNode, a=s.x, b=yt), 3)


def arg_reduce(name):
    def build():
        s = Sketch()
        return s.finish(s.op(getattr(ir, name + "Node"), a=s.x, axis=2, keepdims=False), 2)
    return build


def softmax():
    s = Sketch()
    return s.finish(s.op(ir.SoftmaxNode, a=s.x, axes=[2], precise=True), 3)


def reshape():
    s = Sketch()
    return s.finish(s.op(ir.ReshapeNode, a=s.x, shape=sizes(6, 4)), 2)


def transpose():
    s = Sketch()
    return s.finish(s.op(ir.TransposeNode, a=s.x, axes=[2, 0, 1]), 3)


def expand_dims():
    s = Sketch()
    return s.finish(s.op(ir.ExpandDimsNode, a=s.x, axes=[1]), 4)


def squeeze():
    s = Sketch()
    e = s.op(ir.ExpandDimsNode, a=s.x, axes=[0])
    return s.finish(s.op(ir.SqueezeNode, a=e, axes=[0]), 3)


def broadcast_to():
    s = Sketch()
    return s.finish(s.op(ir.BroadcastToNode, a=s.x, shape=sizes(5, 2, 3, 4)), 4)


def slice_():
    s = Sketch()
    return s.finish(s.op(ir.SliceNode, a=s.x, start=[0, 1, 0], stop=[2, 3, 4], strides=[1, 1, 2]), 3)


def take():
    s = Sketch()
    return s.finish(s.op(ir.TakeNode, a=s.x, indices=s.i, axis=1), 4)


def concatenate():
    s = Sketch()
    return s.finish(s.op(ir.ConcatenateNode, inputs=[s.x, s.y], axis=0), 3)


def full():
    s = Sketch()
    return s.finish(s.full([2, 3], 1.5), 2)


def arange():
    s = Sketch()
    return s.finish(s.op(ir.ArangeNode, start=0.0, stop=10.0, step=1.5, dtype=F32), 1)


def _random_bits(s: Sketch, rows: int = 2) -> ir.Tid:
    return s.op(ir.RandomBitsNode, shape=sizes(rows, 2), seed=s.lit(7, I64), position=s.lit(3, I64), width=4)


def random_bits():
    s = Sketch()
    return s.finish(_random_bits(s), 2)


def cumsum():
    s = Sketch()
    return s.finish(s.op(ir.CumsumNode, a=s.x, axis=1, reverse=False, inclusive=True), 3)


def _batch(s: Sketch) -> ir.Tid:
    """x's dynamic first dimension, plus one: a SymIntNode."""
    op = ir.SymIntOp
    return s.op(ir.SymIntNode, code=[op.symbol, 0, op.push, 1, op.add, 0])


def sym_int():
    s = Sketch(dynamic_batch=True)
    return s.finish(_batch(s), 0)


def dyn_arange():
    s = Sketch(dynamic_batch=True)
    n = _batch(s)
    rng = [ir.IntOrSlot(value=0, slot=-1), ir.IntOrSlot(value=0, slot=n.idx), ir.IntOrSlot(value=1, slot=-1)]
    return s.finish(s.op(ir.DynArangeNode, range=rng, dtype=I64), 1)


def dyn_slice():
    s = Sketch(dynamic_batch=True)
    n = _batch(s)
    start = sizes(0, 1, -3)
    stop = [ir.IntOrSlot(value=0, slot=n.idx), ir.IntOrSlot(value=3, slot=-1), ir.IntOrSlot(value=4, slot=-1)]
    return s.finish(s.op(ir.DynSliceNode, a=s.x, start=start, stop=stop, strides=[1, 2, 1]), 3)


def scatter():
    """A KV-cache-like update: rows 0 and 2 of a [2, 3, 4] state."""
    s = Sketch()
    state = s.state([2, 3, 4])
    idx = s.op(ir.ArangeNode, start=0.0, stop=4.0, step=2.0, dtype=I64)
    new = s.op(ir.ScatterNode, a=state, indices=[idx], updates=s.full([2, 2, 1, 4], 0.5), axes=[1])
    s.update(state, new)
    return s.finish(s.op(ir.AddNode, a=new, b=s.x), 3)


def attention():
    s = Sketch()
    q = s.op(ir.ReshapeNode, a=s.x, shape=sizes(1, 2, 3, 4))
    k = s.op(ir.ReshapeNode, a=s.y, shape=sizes(1, 2, 3, 4))
    kv = s.op(ir.SliceNode, a=k, start=[0, 0, 0, 0], stop=[1, 1, 3, 4], strides=[1, 1, 1, 1])
    mask = s.op(ir.GreaterNode, a=s.full([3, 3], 1.0), b=s.lit(0.0))
    # the first 2 of the 3 slots, the heads merged: [1, 3, 8]
    return s.finish(s.op(ir.ScaledDotProductAttentionNode, q=q, k=kv, v=kv, mask=mask, scale=0.5, causal=False,
                         keys=s.lit(2, I64), merge_heads=True), 3)


def rms_norm():
    s = Sketch()
    return s.finish(s.op(ir.RmsNormNode, a=s.x, weight=s.full([4], 1.5), eps=1e-5), 3)


def layer_norm():
    s = Sketch()
    return s.finish(s.op(ir.LayerNormNode, a=s.x, weight=s.full([4], 1.5), bias=s.full([4], -0.5), eps=1e-5), 3)


def silu():
    s = Sketch()
    return s.finish(s.op(ir.SiluNode, a=s.x, b=s.op(ir.SiluNode, a=s.x)), 3)


def rope():
    s = Sketch()
    return s.finish(s.op(ir.RopeNode, x=s.x, cos=s.full([4], 0.5), sin=s.full([1, 4], 0.25)), 3)


def heads():
    """Columns 1-2 of x as one normalized, rotated head: [2, 1, 3, 2]."""
    s = Sketch()
    return s.finish(s.op(ir.HeadsNode, x=s.x, start=1, heads=1, head_dim=2, cos=s.full([2], 0.5),
                         sin=s.full([1, 2], 0.25), norm=s.full([2], 1.5), eps=1e-5), 4)


def heads_into_cache():
    """Columns 1-2 of x as one rotated head, written at slots 0, 2 and 4 of a
    [2, 1, 5, 2] state."""
    s = Sketch()
    state = s.state([2, 1, 5, 2])
    slots = s.op(ir.ArangeNode, start=0.0, stop=6.0, step=2.0, dtype=I64)
    new = s.op(ir.HeadsNode, x=s.x, start=1, heads=1, head_dim=2, cos=s.full([2], 0.5), sin=s.full([1, 2], 0.25),
               cache=state, slots=slots)
    s.update(state, new)
    return s.finish(new, 4)


def cache_write():
    """x as [1, 2, 3, 4] written at slots 0, 2 and 4 of a [1, 2, 5, 4] state."""
    s = Sketch()
    state = s.state([1, 2, 5, 4])
    slots = s.op(ir.ArangeNode, start=0.0, stop=6.0, step=2.0, dtype=I64)
    update = s.op(ir.ReshapeNode, a=s.x, shape=sizes(1, 2, 3, 4))
    new = s.op(ir.CacheWriteNode, cache=state, slots=slots, update=update)
    s.update(state, new)
    return s.finish(new, 4)


def accepted_prefix():
    """i's six entries, sampled after the same six fed: [6] int64."""
    s = Sketch()
    sampled = s.op(ir.ReshapeNode, a=s.i, shape=sizes(6))
    fed = s.op(ir.ReshapeNode, a=s.i, shape=sizes(1, 6))
    return s.finish(s.op(ir.AcceptedPrefixNode, sampled=sampled, fed=fed), 1)


def linear():
    s = Sketch()
    return s.finish(s.op(ir.LinearNode, x=s.x, weight=s.full([5, 4], 0.25), bias=s.full([5], 1.0),
                         norm=s.full([4], 1.5), norm_eps=1e-5), 3)


def slice_update():
    s = Sketch()
    return s.finish(s.op(ir.SliceUpdateNode, a=s.x, update=s.full([2, 1, 4], 2.0), start=[0, 1, 0],
                         stop=[2, 2, 4], strides=[1, 1, 1]), 3)


def _quantized(s: Sketch, rows: int = 8):
    """An int4 [rows, 64] matrix in MLX's layout, group size 32."""
    return dict(weight=s.full([rows, 8], 0x12345678, U32), scales=s.full([rows, 2], 0.1),
                biases=s.full([rows, 2], -0.5), group_size=32, bits=4)


def quantized_linear():
    s = Sketch()
    x = s.full([2, 64], 1.0)
    return s.finish(s.op(ir.QuantizedLinearNode, x=x, bias=s.full([8], 1.0), norm=s.full([64], 0.5), norm_eps=1e-5,
                         **_quantized(s)), 2)


def arg_top_k():
    s = Sketch()
    return s.finish(s.op(ir.ArgTopKNode, a=s.x, k=2, axis=2), 3)


def take_along_axis():
    s = Sketch()
    return s.finish(s.op(ir.TakeAlongAxisNode, a=s.full([2, 3], 1.5), indices=s.i, axis=1), 2)


def gather_linear():
    s = Sketch()  # x [2, 3, 4]: each of a row's 3 experts (ids in i) sees its own x
    return s.finish(s.op(ir.GatherLinearNode, x=s.x, weight=s.full([3, 5, 4], 0.25), indices=s.i,
                         bias=s.full([3, 5], 1.0)), 3)


def gather_quantized_linear():
    s = Sketch()
    q = _quantized(s, rows=24)  # 3 experts of 8 rows
    q.update(weight=s.op(ir.ReshapeNode, a=q["weight"], shape=sizes(3, 8, 8)),
             **{k: s.op(ir.ReshapeNode, a=q[k], shape=sizes(3, 8, 2)) for k in ("scales", "biases")})
    return s.finish(s.op(ir.GatherQuantizedLinearNode, x=s.full([2, 64], 1.0), indices=s.i, **q), 3)


def gated_delta():
    s = Sketch()  # q, k, v [1, 2, 3, 4], 2 snapshots -> [1, 2, 3 + 2 * 4, 4]
    qkv = {n: s.full([1, 2, 3, 4], 0.5) for n in ("q", "k", "v")}
    return s.finish(s.op(ir.GatedDeltaNode, **qkv, g=s.full([1, 2, 3], -0.1), beta=s.full([1, 2, 3], 0.5),
                         state=s.full([1, 2, 4, 4], 0.25), snapshots=2), 4)


def ssd_scan():
    s = Sketch()  # x [1, 2, 3, 4], state size 5, 2 snapshots -> [1, 2, 3 + 2 * 5, 4]
    return s.finish(s.op(ir.SsdScanNode, x=s.full([1, 2, 3, 4], 0.5), dt=s.full([1, 2, 3], 0.1),
                         a=s.full([2], -1.0), b=s.full([1, 2, 3, 5], 0.5), c=s.full([1, 2, 3, 5], 0.5),
                         state=s.full([1, 2, 4, 5], 0.25), snapshots=2), 4)


def selective_scan():
    s = Sketch()  # x [1, 2, 3], state size 5, 2 snapshots -> [1, 2, 3 + 2 * 5]
    return s.finish(s.op(ir.SelectiveScanNode, x=s.full([1, 2, 3], 0.5), dt=s.full([1, 2, 3], 0.1),
                         a=s.full([2, 5], -1.0), b=s.full([1, 3, 5], 0.5), c=s.full([1, 3, 5], 0.5),
                         state=s.full([1, 2, 5], 0.25), snapshots=2), 3)


def quantized_embedding():
    s = Sketch()
    return s.finish(s.op(ir.QuantizedEmbeddingNode, indices=s.i, **_quantized(s)), 3)


def _on(spec):
    """A valid value of a row parameter that is not its off value."""
    if spec.integer:
        return int(spec.off) + 5
    lo, lo_closed, hi, hi_closed = spec.valid
    up = spec.off + 0.1
    return up if (up < hi or (hi_closed and up == hi)) else spec.off - 0.1


def sample():
    """Every parameter of the sampler table on: penalties from i, a logit bias, the filters."""
    s = Sketch()
    logits = s.op(ir.ReshapeNode, a=s.x, shape=sizes(2, 12))
    seed, position = s.lit(7, I64), s.lit(3, I64)
    bits = s.op(ir.RandomBitsNode, shape=sizes(2, 2), seed=seed, position=position, width=4)
    params = {name: s.lit(_on(BY_NAME[name]), I64 if BY_NAME[name].integer else F32) for name in ROW_PARAMS}
    # the tables: [2, 3] ids from i (one of them -1 padding), [2, 3] values -1,
    # and a one-word token bitmask that allows 8 of the 12 tokens
    tables = {"int64": lambda: s.i, "float32": lambda: s.full([2, 3], -1.0),
              "int32": lambda: s.full([2, 1], 0x0F0F, ir.DType.int32)}
    params.update({name: tables[BY_NAME[name].dtype]() for name in TABLE_PARAMS})
    token = s.op(ir.SampleNode, logits=logits, temperature=s.lit(0.8), random=bits, seed=seed, position=position,
                 **params)
    return s.finish(token, 1)


def state():
    """A mutable buffer that accumulates x across calls (a graph-level seed)."""
    s = Sketch()
    buf = s.state([2, 3, 4])
    new = s.op(ir.AddNode, a=buf, b=s.x)
    s.update(buf, new)
    return s.finish(new, 3)


def _dtype_mix():
    """Literals and fills of every dtype (mutations retype them)."""
    s = Sketch()
    total = s.lit(0.0)
    for dtype in ir.DType:
        value = s.full([2], 1, dtype) if dtype != BOOL else s.op(ir.GreaterNode, a=s.full([2], 1.0), b=s.lit(0.0))
        total = s.op(ir.AddNode, a=total, b=s.op(ir.AsTypeNode, a=value, dtype=F32))
    return s.finish(total, 1)


GRAPHS = {
    **{f"{n}Node": _binary(n) for n in BINARY},
    **{f"{n}Node": _unary(n) for n in UNARY},
    **{f"{n}Node": _reduce(n) for n in REDUCE},
    **{f"{n}Node": _logical(n) for n in ("LogicalAnd", "LogicalOr")},
    **{f"{n}Node": _bool_reduce(n) for n in ("Any", "All")},
    **{f"{n}Node": _bitwise(n) for n in ("BitwiseAnd", "BitwiseOr", "BitwiseXor")},
    **{f"{n}Node": arg_reduce(n) for n in ("Argmax", "Argmin")},
    "LogicalNotNode": logical_not, "RightShiftNode": right_shift, "WhereNode": where, "AsTypeNode": as_type,
    "MatmulNode": matmul, "SoftmaxNode": softmax, "ReshapeNode": reshape, "TransposeNode": transpose,
    "ExpandDimsNode": expand_dims, "SqueezeNode": squeeze, "BroadcastToNode": broadcast_to, "SliceNode": slice_,
    "TakeNode": take, "ConcatenateNode": concatenate, "FullNode": full, "ArangeNode": arange,
    "RandomBitsNode": random_bits, "CumsumNode": cumsum, "SymIntNode": sym_int, "DynArangeNode": dyn_arange,
    "DynSliceNode": dyn_slice, "ScatterNode": scatter, "ScaledDotProductAttentionNode": attention,
    "RmsNormNode": rms_norm, "LayerNormNode": layer_norm, "SiluNode": silu, "RopeNode": rope, "LinearNode": linear,
    "SliceUpdateNode": slice_update,
    "QuantizedLinearNode": quantized_linear, "QuantizedEmbeddingNode": quantized_embedding, "SampleNode": sample,
    "ArgTopKNode": arg_top_k, "TakeAlongAxisNode": take_along_axis, "GatherLinearNode": gather_linear,
    "GatherQuantizedLinearNode": gather_quantized_linear, "GatedDeltaNode": gated_delta, "SsdScanNode": ssd_scan,
    "SelectiveScanNode": selective_scan, "HeadsNode": heads, "CacheWriteNode": cache_write,
    "AcceptedPrefixNode": accepted_prefix,
    # graph-level seeds: persistent state, every dtype, a node's optional form
    "state": state, "dtypes": _dtype_mix, "heads into a cache": heads_into_cache,
}
