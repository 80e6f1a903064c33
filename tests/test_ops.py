"""One test per lowered op: export a tiny module, lower it with MLXPartitioner,
check it is fully delegated (and which IR nodes implement it), run the .pte
through ExecuTorch's runtime and compare with eager PyTorch.

`harness.assert_matches_eager` does the work; tolerances per dtype are
`harness.TOLERANCE`.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from harness import assert_matches_eager, delegate_graphs, lower, lower_and_run, node_types, run, undelegated_ops

FLOATS = [torch.float32, torch.float16, torch.bfloat16]
INTS = [torch.int32, torch.int64]
SHAPE = (2, 3, 4)


def _id(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


floats = pytest.mark.parametrize("dtype", FLOATS, ids=_id)
ints = pytest.mark.parametrize("dtype", INTS, ids=_id)
numeric = pytest.mark.parametrize("dtype", FLOATS + INTS, ids=_id)
# dtype-agnostic layout ops: one of each family (and bool)
SHAPE_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool]
all_dtypes = pytest.mark.parametrize("dtype", FLOATS + INTS + [torch.bool], ids=_id)


def sweep(names: str, cases: list, dtypes=FLOATS + INTS + [torch.bool]):
    """Parametrizes `dtype` and the given case argument(s): every case for
    float32, and (to keep the file fast) only the first case for the other
    dtypes."""
    params = [
        pytest.param(dt, *(c if isinstance(c, tuple) else (c,)), id=f"{_id(dt)}-{c}")
        for dt in dtypes for i, c in enumerate(cases)
        if dt == torch.float32 or i == 0
    ]
    return pytest.mark.parametrize(f"dtype,{names}", params)


class Fn(torch.nn.Module):
    """Wraps a function of tensors as a module for torch.export."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def rand(shape=SHAPE, dtype=torch.float32, lo: float = -3.0, hi: float = 3.0) -> torch.Tensor:
    """Random values in [lo, hi) (integers: [lo, hi) as well; bool: coin flips).
    Floats are drawn in float32 and rounded once to `dtype`, so eager and the
    delegate see the same inputs."""
    if dtype == torch.bool:
        return torch.rand(shape) < 0.5
    if dtype.is_floating_point:
        return (torch.rand(shape) * (hi - lo) + lo).to(dtype)
    return torch.randint(int(lo), int(hi), shape, dtype=dtype)


def away_from_zero(shape=SHAPE, dtype=torch.float32, lo: float = 0.5, hi: float = 3.0) -> torch.Tensor:
    """Magnitudes in [lo, hi) with random signs: safe divisors."""
    mag = rand(shape, torch.float32, lo, hi)
    sign = torch.where(torch.rand(shape) < 0.5, -1.0, 1.0)
    v = mag * sign
    return v.to(dtype) if dtype.is_floating_point else v.round().to(dtype)


def check(fn, *args, nodes=()):
    assert_matches_eager(Fn(fn), tuple(args), expect_nodes=set(nodes))


# --------------------------------------------------------------- arithmetic --


@numeric
def test_add(dtype):
    check(torch.add, rand(dtype=dtype), rand(dtype=dtype), nodes={"AddNode"})


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32], ids=_id)
def test_add_broadcast(dtype):
    check(torch.add, rand(dtype=dtype), rand((3, 1), dtype=dtype), nodes={"AddNode"})


@pytest.mark.parametrize("dtype", INTS, ids=_id)
def test_add_alpha(dtype):
    check(lambda x, y: torch.add(x, y, alpha=3), rand(dtype=dtype), rand(dtype=dtype),
          nodes={"AddNode", "MultiplyNode"})


@floats
def test_add_alpha_float(dtype):
    check(lambda x, y: torch.add(x, y, alpha=0.5), rand(dtype=dtype), rand(dtype=dtype),
          nodes={"AddNode", "MultiplyNode"})


@numeric
def test_add_scalar(dtype):
    # on integer tensors `x + 2.5` promotes to the default float dtype
    check(lambda x: x + 2.5, rand(dtype=dtype), nodes={"AddNode"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32], ids=_id)
def test_add_int_scalar(dtype):
    check(lambda x: x + 2, rand(dtype=dtype), nodes={"AddNode"})


@pytest.mark.parametrize("op,node", [(torch.add, "AddNode"), (torch.mul, "MultiplyNode")], ids=["add", "mul"])
def test_add_mul_bool(op, node):
    # on bools torch's add and mul are logical or / and, and stay bool
    check(op, rand(dtype=torch.bool), rand(dtype=torch.bool), nodes={node})


@numeric
def test_sub(dtype):
    check(torch.sub, rand(dtype=dtype), rand(dtype=dtype), nodes={"SubtractNode"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=_id)
def test_sub_alpha(dtype):
    check(lambda x, y: torch.sub(x, y, alpha=2), rand(dtype=dtype), rand(dtype=dtype),
          nodes={"SubtractNode", "MultiplyNode"})


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32], ids=_id)
def test_sub_scalar(dtype):
    check(lambda x: x - 1.5, rand(dtype=dtype), nodes={"SubtractNode"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=_id)
def test_rsub_scalar(dtype):
    check(lambda x: 2 - x, rand(dtype=dtype), nodes={"SubtractNode"})


@numeric
def test_mul(dtype):
    check(torch.mul, rand(dtype=dtype), rand(dtype=dtype), nodes={"MultiplyNode"})


@numeric
def test_mul_scalar(dtype):
    check(lambda x: x * 3, rand(dtype=dtype), nodes={"MultiplyNode"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32], ids=_id)
def test_mul_float_scalar(dtype):
    check(lambda x: x * 0.25, rand(dtype=dtype), nodes={"MultiplyNode"})


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=_id)
def test_mixed_dtype_promotion(dtype):
    # a low-precision tensor with a float32 one promotes to float32
    check(torch.add, rand(dtype=dtype), rand(dtype=torch.float32), nodes={"AddNode"})


@numeric
def test_div(dtype):
    # integer true division yields float32 (the default dtype)
    check(torch.div, rand(dtype=dtype), away_from_zero(dtype=dtype), nodes={"DivideNode"})


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64], ids=_id)
def test_div_scalar(dtype):
    check(lambda x: x / 4.0, rand(dtype=dtype), nodes={"DivideNode"})


@numeric
def test_neg(dtype):
    check(torch.neg, rand(dtype=dtype), nodes={"NegativeNode"})


@floats
def test_exp(dtype):
    check(torch.exp, rand(dtype=dtype), nodes={"ExpNode"})


@ints
def test_exp_of_int(dtype):
    # float ops on integer tensors compute (and return) the default float dtype
    check(torch.exp, rand(dtype=dtype), nodes={"ExpNode"})


@floats
def test_log(dtype):
    check(torch.log, rand(dtype=dtype, lo=0.1, hi=5.0), nodes={"LogNode"})


@floats
def test_expm1_and_log1p(dtype):
    check(torch.expm1, rand(dtype=dtype, lo=-1e-3, hi=3.0), nodes={"Expm1Node"})
    check(torch.log1p, rand(dtype=dtype, lo=-0.9, hi=1e-3), nodes={"Log1pNode"})


@floats
def test_sqrt(dtype):
    check(torch.sqrt, rand(dtype=dtype, lo=0.1, hi=5.0), nodes={"SqrtNode"})


@ints
def test_sqrt_of_int(dtype):
    check(torch.sqrt, rand(dtype=dtype, lo=0, hi=10), nodes={"SqrtNode"})


@floats
def test_rsqrt(dtype):
    check(torch.rsqrt, rand(dtype=dtype, lo=0.1, hi=5.0), nodes={"RsqrtNode"})


@numeric
def test_pow_tensor_scalar(dtype):
    check(lambda x: x ** 2, rand(dtype=dtype), nodes={"PowerNode"})


@floats
def test_pow_tensor_float_scalar(dtype):
    check(lambda x: torch.pow(x, 1.5), rand(dtype=dtype, lo=0.1, hi=3.0), nodes={"PowerNode"})


@floats
def test_pow_tensor_tensor(dtype):
    check(torch.pow, rand(dtype=dtype, lo=0.1, hi=3.0), rand(dtype=dtype, lo=-2.0, hi=2.0),
          nodes={"PowerNode"})


@ints
def test_pow_tensor_tensor_int(dtype):
    check(torch.pow, rand(dtype=dtype, lo=-3, hi=4), rand(dtype=dtype, lo=0, hi=4), nodes={"PowerNode"})


@floats
def test_pow_scalar_tensor(dtype):
    check(lambda x: torch.pow(2.0, x), rand(dtype=dtype), nodes={"PowerNode"})


@numeric
def test_abs(dtype):
    check(torch.abs, rand(dtype=dtype), nodes={"AbsNode"})


@numeric
def test_maximum(dtype):
    check(torch.maximum, rand(dtype=dtype), rand(dtype=dtype), nodes={"MaximumNode"})


@numeric
def test_minimum(dtype):
    check(torch.minimum, rand(dtype=dtype), rand(dtype=dtype), nodes={"MinimumNode"})


# -------------------------------------------------------------- comparisons --

COMPARISONS = {
    "eq": (torch.eq, "EqualNode"),
    "ne": (torch.ne, "NotEqualNode"),
    "lt": (torch.lt, "LessNode"),
    "le": (torch.le, "LessEqualNode"),
    "gt": (torch.gt, "GreaterNode"),
    "ge": (torch.ge, "GreaterEqualNode"),
}


def _ties(dtype, shape=SHAPE):
    """Small integers (as `dtype`), so that equal pairs are common."""
    return rand(shape, torch.int32, -2, 3).to(dtype)


def _comparison(name, dtype):
    fn, node = COMPARISONS[name]
    check(fn, _ties(dtype), _ties(dtype), nodes={node})


def _comparison_scalar(name, dtype):
    fn, node = COMPARISONS[name]
    check(lambda x: fn(x, 1), _ties(dtype), nodes={node})


@numeric
def test_eq(dtype):
    _comparison("eq", dtype)


def test_eq_bool():
    check(torch.eq, rand(dtype=torch.bool), rand(dtype=torch.bool), nodes={"EqualNode"})


@numeric
def test_ne(dtype):
    _comparison("ne", dtype)


def test_ne_bool():
    check(torch.ne, rand(dtype=torch.bool), rand(dtype=torch.bool), nodes={"NotEqualNode"})


@numeric
def test_lt(dtype):
    _comparison("lt", dtype)


@numeric
def test_le(dtype):
    _comparison("le", dtype)


@numeric
def test_gt(dtype):
    _comparison("gt", dtype)


@numeric
def test_ge(dtype):
    _comparison("ge", dtype)


@pytest.mark.parametrize("name", list(COMPARISONS))
def test_comparison_scalar(name, dtype=torch.float32):
    _comparison_scalar(name, dtype)


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32], ids=_id)
def test_lt_float_scalar(dtype):
    check(lambda x: x < 0.5, rand(dtype=dtype), nodes={"LessNode"})


# -------------------------------------------------------------------- logic --


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.int32], ids=_id)
def test_logical_and(dtype):
    check(torch.logical_and, _ties(dtype), _ties(dtype), nodes={"LogicalAndNode"})


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.int32], ids=_id)
def test_logical_or(dtype):
    check(torch.logical_or, _ties(dtype), _ties(dtype), nodes={"LogicalOrNode"})


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32, torch.int32], ids=_id)
def test_logical_not(dtype):
    check(torch.logical_not, _ties(dtype), nodes={"LogicalNotNode"})


@all_dtypes
def test_where(dtype):
    check(torch.where, rand(dtype=torch.bool), rand(dtype=dtype), rand(dtype=dtype), nodes={"WhereNode"})


@floats
def test_where_scalar(dtype):
    check(lambda c, x: torch.where(c, x, 0.0), rand(dtype=torch.bool), rand(dtype=dtype), nodes={"WhereNode"})


@numeric
def test_clamp(dtype):
    check(lambda x: torch.clamp(x, -1, 2), rand(dtype=dtype), nodes={"MaximumNode", "MinimumNode"})


def test_clamp_int_with_float_bounds():
    # float bounds promote an integer tensor to the default float dtype
    check(lambda x: torch.clamp(x, 0.5, 2.5), rand(dtype=torch.int32), nodes={"MaximumNode", "MinimumNode"})


@floats
def test_clamp_min_only(dtype):
    check(lambda x: torch.clamp(x, min=-0.5), rand(dtype=dtype), nodes={"MaximumNode"})


@floats
def test_clamp_max_only(dtype):
    check(lambda x: torch.clamp(x, max=0.5), rand(dtype=dtype), nodes={"MinimumNode"})


@floats
def test_clamp_tensor(dtype):
    check(lambda x, lo, hi: torch.clamp(x, lo, hi), rand(dtype=dtype), rand((4,), dtype, -2, 0),
          rand((4,), dtype, 0, 2), nodes={"MaximumNode", "MinimumNode"})


# ------------------------------------------------------------------- linalg --


class Linear(torch.nn.Module):
    def __init__(self, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.lin = torch.nn.Linear(4, 5, bias=bias).to(dtype)

    def forward(self, x):
        return self.lin(x)


@floats
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_linear(dtype, bias):
    nodes = {"LinearNode"}
    assert_matches_eager(Linear(bias, dtype), (rand(dtype=dtype),), expect_nodes=nodes)


class Residual(torch.nn.Module):
    """A linear layer's output plus a residual, as a decoder layer adds them."""

    def __init__(self, reuse: bool, transposed: bool):
        super().__init__()
        self.lin, self.reuse, self.transposed = torch.nn.Linear(8, 8), reuse, transposed

    def forward(self, x, r):
        y = self.lin(x)
        r = r.transpose(1, 2) if self.transposed else r  # a strided view at run time
        return (y + r, y) if self.reuse else y + r


@pytest.mark.parametrize("case", ["rows", "strided", "broadcast", "reused"])
def test_a_residual_add_joins_the_linear_layer_node(case, monkeypatch):
    """float32 y = x W^T + b, then y + r: one LinearNode with `residual` (its
    output's shape), where no other node reads y, computing bit for bit what
    a LinearNode then an AddNode compute; else those two nodes."""
    from executorch_mlx.lowering import ops_elementwise
    from executorch_mlx.serialization import ir

    x = rand((2, 5, 8))
    r = {"rows": rand((2, 5, 8)), "strided": rand((2, 8, 5)), "broadcast": rand((8,)), "reused": rand((2, 5, 8))}[case]
    module = Residual(case == "reused", case == "strided")
    edge = lower(module, (x, r))
    ops = [n.op for g in delegate_graphs(edge) for n in g.nodes]
    linear = [op for op in ops if isinstance(op, ir.LinearNode)]
    fused = case in ("rows", "strided")
    assert len(linear) == 1 and (linear[0].residual is not None) == fused
    assert any(isinstance(op, ir.AddNode) for op in ops) != fused
    assert_matches_eager(module, (x, r))
    monkeypatch.setattr(ops_elementwise, "_with_residual", lambda b, node: None)
    apart = run(lower(module, (x, r)).to_executorch().buffer, [x, r])
    assert all(torch.equal(a, b) for a, b in zip(run(edge.to_executorch().buffer, [x, r]), apart))


@floats
def test_mm(dtype):
    check(torch.mm, rand((3, 4), dtype), rand((4, 5), dtype), nodes={"MatmulNode"})


@floats
def test_bmm(dtype):
    check(torch.bmm, rand((2, 3, 4), dtype), rand((2, 4, 5), dtype), nodes={"MatmulNode"})


@floats
def test_addmm(dtype):
    check(torch.addmm, rand((5,), dtype), rand((3, 4), dtype), rand((4, 5), dtype),
          nodes={"MatmulNode", "AddNode"})


@floats
def test_addmm_alpha_beta(dtype):
    check(lambda b, x, y: torch.addmm(b, x, y, beta=0.5, alpha=2.0), rand((3, 5), dtype), rand((3, 4), dtype),
          rand((4, 5), dtype), nodes={"MatmulNode", "AddNode", "MultiplyNode"})


def test_addmm_beta0_ignores_input():
    # with beta=0 torch ignores `input`: its nan/inf must not propagate
    bias = torch.tensor([float("nan"), float("inf"), 1.0, 2.0, 3.0])
    check(lambda b, x, y: torch.addmm(b, x, y, beta=0), bias, rand((3, 4)), rand((4, 5)), nodes={"MatmulNode"})


@floats
def test_matmul(dtype):
    check(torch.matmul, rand((2, 3, 4), dtype), rand((4, 5), dtype), nodes={"MatmulNode"})


@floats
def test_matmul_batched(dtype):
    check(torch.matmul, rand((2, 3, 4), dtype), rand((2, 4, 5), dtype), nodes={"MatmulNode"})


@pytest.mark.parametrize("layout", ["transposed", "broadcast", "strided", "one-row"])
def test_matmul_reads_every_layout(layout):
    """float32 products run on our sgemm kernel, which reads a transposed
    last pair of axes as it is, broadcast batch axes by stride 0, and copies
    other layouts."""
    fn, args = {
        "transposed": (lambda x, y: torch.matmul(x.transpose(-1, -2), y.transpose(-1, -2)),
                       (rand((2, 4, 3)), rand((2, 5, 4)))),
        "broadcast": (torch.matmul, (rand((2, 1, 3, 4)), rand((5, 4, 6)))),
        "strided": (lambda x, y: torch.matmul(x[:, :, ::2], y[:, ::2]), (rand((2, 3, 8)), rand((2, 8, 5)))),
        "one-row": (lambda x, y: torch.matmul(x[:, 1:2], y), (rand((2, 3, 4)), rand((2, 4, 5)))),
    }[layout]
    check(fn, *args, nodes={"MatmulNode"})


@ints
def test_mm_int_stays_outside(dtype):
    # MLX's matmul is floating-point only: integer mm must run on ExecuTorch's
    # portable kernel, outside the delegate, and still give the right answer.
    x, y = rand((3, 4), dtype), rand((4, 5), dtype)
    edge = lower(Fn(torch.mm), (x, y))
    assert any("mm" in op for op in undelegated_ops(edge)), undelegated_ops(edge)
    got = run(edge.to_executorch().buffer, [x, y])
    assert torch.equal(got[0], torch.mm(x, y))


# --------------------------------------------------------------- reductions --


@sweep("dim", [-1, 0, 1], FLOATS)
def test_softmax(dtype, dim):
    check(lambda x: torch.softmax(x, dim), rand(dtype=dtype), nodes={"SoftmaxNode"})


@sweep("dim", [-1, 1], FLOATS)
def test_log_softmax(dtype, dim):
    check(lambda x: torch.log_softmax(x, dim), rand(dtype=dtype), nodes={"LogSumExpNode", "SubtractNode"})


REDUCE_DIMS = [((0, 2), True), (-1, False), (None, False)]


def _reduce(fn, dim, keepdim):
    if dim is None:
        return lambda x: fn(x)
    return lambda x: fn(x, dim=dim, keepdim=keepdim)


@sweep("dim,keepdim", REDUCE_DIMS)
def test_sum(dtype, dim, keepdim):
    # sums of ints and bools return int64, like torch
    check(_reduce(torch.sum, dim, keepdim), rand(dtype=dtype), nodes={"SumNode"})


@pytest.mark.parametrize("dtype,out", [(torch.float16, torch.float32), (torch.int32, torch.float32),
                                       (torch.bool, torch.int32)], ids=lambda d: _id(d))
def test_sum_with_dtype(dtype, out):
    check(lambda x: torch.sum(x, dim=-1, dtype=out), rand(dtype=dtype), nodes={"SumNode"})


@sweep("dim,keepdim", REDUCE_DIMS, FLOATS)
def test_mean(dtype, dim, keepdim):
    check(_reduce(torch.mean, dim, keepdim), rand(dtype=dtype), nodes={"MeanNode"})


@sweep("dim,keepdim", [((0, 2), True), (-1, False), ((), False)], FLOATS + INTS)
def test_amax(dtype, dim, keepdim):
    check(lambda x: torch.amax(x, dim=dim, keepdim=keepdim), rand(dtype=dtype), nodes={"MaxNode"})


@sweep("dim,keepdim", [((0, 2), True), (-1, False), ((), False)], FLOATS + INTS)
def test_amin(dtype, dim, keepdim):
    check(lambda x: torch.amin(x, dim=dim, keepdim=keepdim), rand(dtype=dtype), nodes={"MinNode"})


ZERO_D_REDUCTIONS = {  # torch accepts dim 0 / -1 on a 0-d tensor and reduces nothing
    "sum": (lambda x: torch.sum(x, 0), "SumNode"),
    "mean": (lambda x: torch.mean(x, -1, keepdim=True), "MeanNode"),
    "amax": (lambda x: torch.amax(x, 0), "MaxNode"),
    "amin": (lambda x: torch.amin(x, -1), "MinNode"),
    "argmax": (lambda x: torch.argmax(x, 0), "ArgmaxNode"),
    "argmin": (lambda x: torch.argmin(x, -1, keepdim=True), "ArgminNode"),
    "softmax": (lambda x: torch.softmax(x, 0), "SoftmaxNode"),
    "log_softmax": (lambda x: torch.log_softmax(x, -1), "LogSumExpNode"),
}


@pytest.mark.parametrize("name", list(ZERO_D_REDUCTIONS))
def test_reduction_of_0d(name):
    fn, node = ZERO_D_REDUCTIONS[name]
    check(fn, rand(()), nodes={node})


def _distinct(dtype, shape=SHAPE):
    """Distinct values, so that arg-reductions have a unique answer."""
    n = 1
    for s in shape:
        n *= s
    return (torch.randperm(n).reshape(shape) - n // 2).to(dtype)


ARG_DIMS = sweep("dim,keepdim", [(-1, False), (1, True), (None, False), (None, True)], FLOATS + INTS)


@ARG_DIMS
def test_argmax(dtype, dim, keepdim):
    check(lambda x: torch.argmax(x, dim=dim, keepdim=keepdim), _distinct(dtype), nodes={"ArgmaxNode"})


@ARG_DIMS
def test_argmin(dtype, dim, keepdim):
    check(lambda x: torch.argmin(x, dim=dim, keepdim=keepdim), _distinct(dtype), nodes={"ArgminNode"})


@pytest.mark.parametrize("fn", [torch.argmax, torch.argmin], ids=["argmax", "argmin"])
def test_argreduce_ties_pick_first(fn):
    # torch returns the first index of the extreme value
    x = torch.tensor([[1, 3, 3, 0], [2, 2, 0, 0]], dtype=torch.int32)
    check(lambda x: fn(x, dim=-1), x, nodes={"ArgmaxNode" if fn is torch.argmax else "ArgminNode"})


# ------------------------------------------------------------------- shapes --


@pytest.mark.parametrize("dtype", SHAPE_DTYPES, ids=_id)
def test_view(dtype):
    check(lambda x: x.view(6, 4), rand(dtype=dtype), nodes={"ReshapeNode"})


@pytest.mark.parametrize("dtype", SHAPE_DTYPES, ids=_id)
def test_reshape(dtype):
    check(lambda x: x.reshape(4, -1), rand(dtype=dtype), nodes={"ReshapeNode"})


def test_reshape_after_permute(dtype=torch.float32):
    # reshape of a non-contiguous tensor: the element order must follow torch's
    check(lambda x: x.permute(2, 0, 1).reshape(4, 6), rand(dtype=dtype), nodes={"ReshapeNode", "TransposeNode"})


@pytest.mark.parametrize("dtype", SHAPE_DTYPES, ids=_id)
def test_permute(dtype):
    check(lambda x: x.permute(2, 0, 1), rand(dtype=dtype), nodes={"TransposeNode"})


def test_permute_negative(dtype=torch.float32):
    check(lambda x: x.permute(-1, -3, -2), rand(dtype=dtype), nodes={"TransposeNode"})


@pytest.mark.parametrize("dtype", SHAPE_DTYPES, ids=_id)
def test_transpose(dtype):
    check(lambda x: torch.transpose(x, 0, -1), rand(dtype=dtype), nodes={"TransposeNode"})


def test_t(dtype=torch.float32):
    check(lambda x: x.t(), rand((3, 4), dtype), nodes={"TransposeNode"})


@sweep("dim", [-1, 0, 2])
def test_unsqueeze(dtype, dim):
    check(lambda x: x.unsqueeze(dim), rand(dtype=dtype), nodes={"ExpandDimsNode"})


@pytest.mark.parametrize("dtype", SHAPE_DTYPES, ids=_id)
def test_squeeze_dim(dtype):
    check(lambda x: x.squeeze(1), rand((2, 1, 3), dtype), nodes={"SqueezeNode"})


def test_squeeze_all(dtype=torch.float32):
    check(lambda x: x.squeeze(), rand((2, 1, 3, 1), dtype), nodes={"SqueezeNode"})


def test_squeeze_dims(dtype=torch.float32):
    check(lambda x: x.squeeze((0, -1)), rand((1, 3, 1), dtype), nodes={"SqueezeNode"})


def test_squeeze_non_unit_dim(dtype=torch.float32):
    # squeezing a dim whose size is not 1 is a no-op in torch
    check(lambda x: x.squeeze(0) + 1, rand((2, 3), dtype), nodes={"AddNode"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32], ids=_id)
def test_clone(dtype):
    # the edge dialect turns clone into dim_order_ops._clone_dim_order
    check(lambda x: torch.relu(x.clone()) + 1, rand(dtype=dtype), nodes={"MaximumNode", "AddNode"})


@pytest.mark.parametrize("dtype", SHAPE_DTYPES, ids=_id)
def test_expand(dtype):
    check(lambda x: x.expand(2, 3, 4), rand((1, 3, 1), dtype), nodes={"BroadcastToNode"})


def test_expand_new_dims(dtype=torch.float32):
    check(lambda x: x.expand(2, 3, 4), rand((4,), dtype), nodes={"BroadcastToNode"})


SLICES = {
    "negative_step": lambda x: x[..., -3::2],
    "basic": lambda x: x[:, 1:3],
    "negative": lambda x: x[:, -2:],
    "negative_end": lambda x: x[..., :-1],
    "negative_both": lambda x: x[:, -3:-1],
    "step": lambda x: x[..., ::2],
    "start_step": lambda x: x[..., 1::2],
    "clipped": lambda x: x[:, 1:100],
    "dim0": lambda x: x[1:],
}


@sweep("case", list(SLICES))
def test_slice(dtype, case):
    check(SLICES[case], rand(dtype=dtype), nodes={"SliceNode"})


@sweep("dim,index", [(1, -1), (0, 1), (-1, 2)])
def test_select(dtype, dim, index):
    check(lambda x: x.select(dim, index), rand(dtype=dtype), nodes={"TakeNode"})


@sweep("dim", [-1, 0])
def test_cat(dtype, dim):
    shape_b = (1, 3, 4) if dim == 0 else (2, 3, 2)
    check(lambda a, b: torch.cat([a, b, a], dim), rand(dtype=dtype), rand(shape_b, dtype),
          nodes={"ConcatenateNode"})


class Embedding(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 4).to(dtype)

    def forward(self, idx):
        return self.emb(idx)


@pytest.mark.parametrize("dtype,idx_dtype", [(d, torch.int64) for d in FLOATS] + [(torch.float32, torch.int32)],
                         ids=lambda d: _id(d))
def test_embedding(dtype, idx_dtype):
    idx = torch.tensor([[0, 3, 9], [3, 1, 0]], dtype=idx_dtype)
    assert_matches_eager(Embedding(dtype), (idx,), expect_nodes={"TakeNode"})


# ----------------------------------------------------------------- creation --


@numeric
def test_full(dtype):
    value = 1.5 if dtype.is_floating_point else 7
    check(lambda x: torch.full(SHAPE, value, dtype=dtype) + x, rand(dtype=dtype), nodes={"FullNode"})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32], ids=_id)
def test_full_like(dtype):
    check(lambda x: torch.full_like(x, 2) * x, rand(dtype=dtype), nodes={"FullNode"})


@numeric
def test_zeros(dtype):
    check(lambda x: torch.zeros(SHAPE, dtype=dtype) + x, rand(dtype=dtype), nodes={"FullNode"})


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool], ids=_id)
def test_zeros_like(dtype):
    check(lambda x: torch.zeros_like(x), rand(dtype=dtype), nodes={"FullNode"})


@numeric
def test_ones(dtype):
    check(lambda x: torch.ones(3, 4, dtype=dtype) - x, rand(dtype=dtype), nodes={"FullNode"})


@pytest.mark.parametrize("dtype", [torch.float16, torch.int64], ids=_id)
def test_ones_like(dtype):
    check(lambda x: torch.ones_like(x) + x, rand(dtype=dtype), nodes={"FullNode"})


@numeric
def test_arange(dtype):
    check(lambda x: x + torch.arange(4, dtype=dtype), rand(dtype=dtype), nodes={"ArangeNode"})


def test_arange_default_dtype():
    # arange of ints is int64; adding it to float32 promotes to float32
    check(lambda x: x + torch.arange(4), rand(), nodes={"ArangeNode"})


@floats
def test_arange_start_step(dtype):
    check(lambda x: x * torch.arange(1, 9, 2, dtype=dtype), rand(dtype=dtype), nodes={"ArangeNode"})


def test_arange_float_step():
    check(lambda x: x + torch.arange(0.0, 1.0, 0.25), rand(), nodes={"ArangeNode"})


# -------------------------------------------------------------------- casts --


_f32, _f16, _bf16, _i32, _i64, _bool = FLOATS + INTS + [torch.bool]
CASTS = [(_f32, t) for t in (_f16, _bf16, _i32, _i64, _bool)] + [(t, _f32) for t in (_f16, _bf16, _i32, _i64, _bool)] + [
    (_f16, _bf16), (_bf16, _f16), (_i32, _i64), (_i64, _i32), (_i64, _bool), (_bool, _i64), (_f16, _i32)]


@pytest.mark.parametrize("dtype,to", CASTS, ids=lambda d: _id(d))
def test_to_dtype(dtype, to):
    # values chosen so every target type represents them the same way
    x = rand(dtype=torch.int32, lo=-4, hi=5).to(dtype) if dtype != torch.bool else rand(dtype=torch.bool)
    if dtype.is_floating_point and not to.is_floating_point:
        # float -> int truncates towards zero; float -> bool is "nonzero"
        x = rand(dtype=dtype, lo=-4, hi=4) * (rand(dtype=torch.bool) if to == torch.bool else 1)
    check(lambda x: x.to(to), x, nodes={"AsTypeNode"})


# -------------------------------------------------------------- activations --


@floats
def test_sigmoid(dtype):
    check(torch.sigmoid, rand(dtype=dtype, lo=-6, hi=6), nodes={"SigmoidNode"})


@floats
def test_silu(dtype):
    check(F.silu, rand(dtype=dtype, lo=-6, hi=6), nodes={"SiluNode"})


def test_silu_kernel_edges():
    """The CPU kernel's sigmoid is built from e^-|x|: saturated inputs, zeros,
    infinities and NaN come out as torch's (below x = -87 the result, under
    1e-36, is flushed to zero); a length that is not a multiple of 8 goes
    through the vector tail."""
    x = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 3.5, -3.5, 87.5, -87.5, 100.0, -100.0, 1e4, -1e4,
                      math.inf, -math.inf, math.nan])
    edge, (got,) = lower_and_run(Fn(F.silu), (x,))
    assert node_types(edge) == {"SiluNode"}
    torch.testing.assert_close(got, F.silu(x), atol=1e-36, rtol=2e-7, equal_nan=True)


@floats
def test_swiglu_is_one_node(dtype):
    """silu(gate) * up (a gated MLP) is one SiluNode, either operand order;
    with the silu read elsewhere too, it stays its own node."""
    gate, up = rand((5, 37), dtype=dtype, lo=-6, hi=6), rand((5, 37), dtype=dtype)
    check(lambda g, u: F.silu(g) * u, gate, up, nodes={"SiluNode"})
    edge, _ = lower_and_run(Fn(lambda g, u: u * F.silu(g)), (gate, up))
    assert [type(n.op).__name__ for g in delegate_graphs(edge) for n in g.nodes] == ["SiluNode"]
    edge, _ = lower_and_run(Fn(lambda g, u: (F.silu(g) * u, F.silu(g))), (gate, up))
    assert [type(n.op).__name__ for g in delegate_graphs(edge) for n in g.nodes] == ["SiluNode", "SiluNode"]


@floats
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(dtype, approximate):
    node = "ErfNode" if approximate == "none" else "TanhNode"
    check(lambda x: F.gelu(x, approximate=approximate), rand(dtype=dtype, lo=-4, hi=4), nodes={node})


@numeric
def test_relu(dtype):
    check(torch.relu, rand(dtype=dtype), nodes={"MaximumNode"})


@floats
def test_tanh(dtype):
    check(torch.tanh, rand(dtype=dtype), nodes={"TanhNode"})


# ------------------------------------------------------------------- models --


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return torch.softmax(self.fc2(torch.relu(self.fc1(x))), dim=-1)


def test_mlp():
    model = MLP().eval()
    x = rand((3, 8))
    assert_matches_eager(model, (x,), expect_nodes={"LinearNode", "MaximumNode", "SoftmaxNode"})
    edge = lower(model, (x,))
    assert len(delegate_graphs(edge)) == 1  # one delegate holds the whole model


class Mixed(torch.nn.Module):
    """Supported ops on both sides of one we do not lower (flip)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = torch.relu(self.fc(x)) * 2.0
        h = torch.flip(h, dims=[-1])
        return torch.softmax(h - 1.0, dim=-1)


def test_mixed_model_partial_delegation():
    model = Mixed().eval()
    x = rand((3, 4))
    edge = lower(model, (x,))
    outside = undelegated_ops(edge)
    assert len(outside) == 1 and "flip" in outside[0], outside
    graphs = delegate_graphs(edge)
    assert len(graphs) == 2, "the ops before and after flip are two delegates"
    types = node_types(edge)
    assert {"LinearNode", "MaximumNode", "SoftmaxNode", "SubtractNode"} <= types, types
    got = run(edge.to_executorch().buffer, [x])
    assert len(got) == 1
    torch.testing.assert_close(got[0], model(x), atol=1e-5, rtol=1e-5)


def test_embedding_out_of_range_ids_give_nan_rows_not_a_crash():
    """torch raises IndexError; without a host sync we return NaN rows (a
    SamplingHead then yields -1), and never read outside the table."""

    class E(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.e = torch.nn.Embedding(10, 4)

        def forward(self, ids):
            return self.e(ids)

    m = E()
    edge = lower(m, (torch.tensor([1, 2, 3]),))
    assert undelegated_ops(edge) == []
    pte = edge.to_executorch().buffer
    out = run(pte, [torch.tensor([9, -1, 1_000_000_000])])[0]
    torch.testing.assert_close(out[0], m.e.weight[9].detach())
    assert out[1:].isnan().all()


# ------------------------------------------------------------ common nodes --
def test_repeated_computations_are_lowered_once():
    """Each layer of an export repeats small computations (positions, the
    cache's written length): equal nodes on equal inputs become one."""

    class Twice(torch.nn.Module):
        def forward(self, x, y):
            a = torch.sin(x * 2.0) + y
            b = torch.sin(x * 2.0) + y  # the same again
            return a * b, torch.sin(x * 3.0)

    x, y = rand(), rand()
    edge = lower(Twice(), (x, y))
    ops = [type(n.op).__name__ for g in delegate_graphs(edge) for n in g.nodes]
    assert ops.count("SinNode") == 2 and ops.count("AddNode") == 1 and ops.count("MultiplyNode") == 3
    got = run(edge.to_executorch().buffer, [x, y])
    want = Twice()(x, y)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_computations_that_change_nothing_are_not_lowered():
    """x * 1.0 (a rotary table's attention scaling), integer x + 0, a
    comparison's cast to bool, an expand to the shape a tensor has, and
    unsqueezes of unsqueezes (a causal mask's) cost no node of their own;
    float x + 0.0 stays (-0.0 + 0.0 is +0.0), and so does x * 1 that widens."""

    class Neutral(torch.nn.Module):
        def forward(self, x, i, z):
            scaled = torch.cos(x) * 1.0
            shifted = torch.arange(6) + 0 + i
            mask = (shifted[None, None, :, None] <= torch.arange(5)[None, None, None, :]).to(torch.bool)
            mask = mask.expand(1, 1, 6, 5)
            return scaled, mask, z + 0.0, i * 1.5

    x, i, z = rand((6,)), torch.tensor(2), torch.tensor([-0.0, 1.0])
    edge = lower(Neutral(), (x, i, z))
    ops = [type(n.op).__name__ for g in delegate_graphs(edge) for n in g.nodes]
    assert "BroadcastToNode" not in ops and ops.count("AsTypeNode") == 1  # (i * 1.5 widens i to float)
    assert ops.count("MultiplyNode") == 1 and ops.count("ExpandDimsNode") == 2 and ops.count("AddNode") == 2
    got = run(edge.to_executorch().buffer, [x, i, z])
    for g, w in zip(got, Neutral()(x, i, z)):
        torch.testing.assert_close(g, w)
    assert torch.signbit(got[2]).tolist() == [False, False]  # -0.0 + 0.0


def test_random_draws_are_never_merged():
    from executorch_mlx.lowering.common_nodes import merge_common_nodes
    from executorch_mlx.serialization import ir

    def draw(out):
        return ir.Node(op=ir.RandomBitsNode(shape=[ir.IntOrSlot(value=4, slot=-1)], out=ir.Tid(out)))

    graph = ir.Graph(num_values=3, nodes=[draw(0), draw(1), ir.Node(op=ir.AddNode(a=ir.Tid(0), b=ir.Tid(1), out=ir.Tid(2)))])
    assert merge_common_nodes(graph) == 0 and len(graph.nodes) == 3


# ------------------------------------------- floor, repeat, scatter by slice --


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64], ids=_id)
def test_floor_division(dtype):
    # torch's floor mode rounds toward -inf (negative quotients included), as MLX's floor_divide
    check(lambda a, b: torch.div(a, b, rounding_mode="floor"), rand(dtype=dtype, lo=-20, hi=20),
          away_from_zero(dtype=dtype, lo=1.0), nodes={"FloorDivideNode"})


def test_floor():
    check(torch.floor, rand(), nodes={"FloorNode"})


def test_repeat_tiles_every_axis_and_adds_leading_ones():
    check(lambda x: x.repeat(2, 1, 1, 3), rand((2, 3, 4)), nodes={"BroadcastToNode"})


def test_index_select_takes_entries_along_an_axis():
    check(lambda x: x.index_select(1, torch.tensor([3, 0, 3, 2])), rand((2, 4, 5)), nodes={"TakeNode"})


class IndexSelect(torch.nn.Module):
    def forward(self, x, i):
        return x.index_select(1, i)


def test_index_select_of_rows_known_on_the_host_is_a_slice_or_a_take_with_the_same_values():
    """Indices that reach the runtime as an input are on the host when the
    graph is built: consecutive rows (after the runtime's clamping into
    range and counting negative ones from the end) are taken as a slice, any
    others by MLX's take; both give x's rows at the clamped indices."""
    x = rand((2, 6, 3))
    program = lower(IndexSelect().eval(), (x, torch.tensor([2, 3]))).to_executorch().buffer
    for i in ([2, 3], [4, 5], [-2, -1], [5, 99], [-99, -98], [1, 0], [3, 3]):
        rows = [min(max(r, -6), 5) % 6 for r in i]
        got = run(program, [x, torch.tensor(i)])[0]
        assert torch.equal(got, x[:, rows]), i


def test_indexing_with_two_index_tensors_takes_at_broadcast_pairs():
    # x[i, j] with i [3, 1] and j [4] (a padding mask read at [batch, position]); and on middle axes
    check(lambda x, i, j: x[i, j], rand((3, 5, 2)), torch.tensor([[2], [0], [1]]), torch.tensor([4, 0, 0, 3]),
          nodes={"TakeNode"})
    check(lambda x, i, j: x[:, i, j], rand((2, 3, 5)), torch.tensor([2, 0]), torch.tensor([1, 4]),
          nodes={"TakeNode"})


class EveryOtherColumn(torch.nn.Module):
    def forward(self, x, src):
        return torch.slice_scatter(x, src, dim=1, start=1, end=6, step=2)


def test_slice_scatter_with_a_dynamic_axis_elsewhere():
    seq = torch.export.Dim("seq", min=2, max=16)
    assert_matches_eager(EveryOtherColumn(), (rand((5, 6)), rand((5, 3))), expect_nodes={"ScatterNode"},
                         dynamic_shapes=({0: seq}, {0: seq}))
