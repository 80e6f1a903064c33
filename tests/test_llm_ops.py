"""Ops and runtime features that decoder LLMs need: rotary/attention ops,
run-time sizes from dynamic dimensions, and buffers mutated in place (the KV
cache) that the delegate keeps between calls."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from harness import assert_matches_eager, delegate_graphs, lower, node_types, run, undelegated_ops, without_fusion
from other_process import run_elsewhere
from test_ops import Fn, check, rand

import executorch_mlx
from executorch.runtime import Runtime
from executorch_mlx.serialization import ir


# ------------------------------------------------------------ elementwise --
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sin_cos(dtype):
    check(lambda x: torch.sin(x) + torch.cos(x), rand(dtype=dtype), nodes=["SinNode", "CosNode"])


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64])
def test_bitwise(dtype):
    x, y = rand(dtype=dtype, lo=0, hi=64), rand(dtype=dtype, lo=0, hi=64)
    check(lambda a, b: ((a & b) | (a ^ b)), x, y, nodes=["BitwiseAndNode", "BitwiseOrNode", "BitwiseXorNode"])


def test_any_all():
    x = rand(dtype=torch.bool)
    check(lambda a: torch.any(a, dim=-1, keepdim=True) & torch.all(a, dim=-1, keepdim=True), x,
          nodes=["AnyNode"])  # torch decomposes all() into any()
    check(lambda a: torch.any(a > 2.5, dim=1), rand(), nodes=["AnyNode"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_cumsum(dtype):
    check(lambda a: torch.cumsum(a, dim=1), rand(dtype=dtype), nodes=["CumsumNode"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_remainder_takes_the_divisors_sign(dtype):
    a = torch.tensor([[-7, -1, 0, 5, 7, 9]], dtype=dtype)
    check(lambda a, b: torch.remainder(a, b), a, torch.tensor([[3, -3, 3, -3, 3, 4]], dtype=dtype),
          nodes=["RemainderNode"])
    check(lambda a: a % 5, a, nodes=["RemainderNode"])


def test_an_integer_remainder_by_zero_reads_as_by_one():
    """A program's divisor is untrusted (MLX does not check it): no crash."""
    a, b = torch.tensor([7, -3, 8]), torch.tensor([0, 2, 0])
    edge = lower(Fn(lambda a, b: torch.remainder(a, b)), (a, torch.tensor([1, 2, 3])))
    assert run(edge.to_executorch().buffer, [a, b])[0].tolist() == [0, 1, 0]


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32, torch.int64])
def test_bitwise_not(dtype):
    check(lambda a: torch.bitwise_not(a), rand((3, 5), dtype, -50, 50), nodes=[])


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_gather(dim):
    x = rand((4, 6))
    index = torch.randint(0, x.shape[dim], (4, 6))
    check(lambda x, i: torch.gather(x, dim, i), x, index, nodes=["TakeAlongAxisNode"])
    # an index smaller than x on the other axis (torch allows it): x is cut to it first
    small = torch.randint(0, x.shape[dim], (3, 3))
    check(lambda x, i: torch.gather(x, dim, i), x, small, nodes=["TakeAlongAxisNode"])


def test_scatter_of_a_value_along_the_last_axis():
    """A router's group mask: 1 at each row's chosen groups."""
    index = torch.tensor([[0, 2], [3, 3], [1, 0]])
    check(lambda x, i: x.scatter(1, i, 1.5), rand((3, 5)), index, nodes=["WhereNode"])
    check(lambda i: torch.zeros(3, 4).scatter_(1, i, 1.0), torch.tensor([[1], [3], [0]]))


def test_empty_then_filled():
    """new_empty (edge: _empty_dim_order) filled by slice copies, as DeepSeek's key assembly."""
    def fn(a, b):
        out = a.new_empty(2, 3, 7)
        out[..., :4].copy_(a)
        out[..., 4:].copy_(b)
        return out

    check(fn, rand((2, 3, 4)), rand((2, 3, 3)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_reciprocal(dtype):
    """(Phi-MoE's rotary embedding computes 1 / base^(i/d) in its forward.)"""
    check(lambda a: torch.reciprocal(a), rand((3, 5), dtype, 1, 9), nodes=["DivideNode"])


def test_copy_into_buffer_shape():
    # functional copy: src cast and broadcast to self's shape and dtype
    check(lambda a, b: torch.ops.aten.copy.default(a, b), rand((2, 3)), rand((3,), torch.int32))


# ------------------------------------------------------ indexing, split --
def test_split_with_sizes():
    check(lambda a: [t * 2 for t in torch.split(a, [1, 3], dim=-1)], rand(), nodes=["SliceNode"])


def test_index_tensor():
    idx = torch.tensor([2, 0, 1, 1])
    check(lambda a, i: a[:, i], rand(), idx, nodes=["TakeNode"])


def test_index_put():
    idx = torch.tensor([3, 0])
    check(lambda a, i, v: torch.ops.aten.index_put.default(a, [None, None, i], v), rand(), idx, rand((2, 3, 2)),
          nodes=["ScatterNode"])


def test_index_put_with_several_index_tensors():
    """Each row of a batch written at its own slots (a batched KV cache:
    cache[row, :, slot] = new, the indexed axes apart), and on adjacent axes."""
    rows, slots = torch.tensor([[1], [0]]), torch.tensor([[4, 2], [0, 3]])
    check(lambda a, i, j, v: torch.ops.aten.index_put.default(a, [i, None, j], v), rand((2, 3, 5, 4)), rows, slots,
          rand((2, 2, 3, 4)), nodes=["ScatterNode"])
    check(lambda a, i, j, v: torch.ops.aten.index_put.default(a, [None, i, j], v), rand((3, 2, 5, 4)), rows, slots,
          rand((3, 2, 2, 4)), nodes=["ScatterNode"])
    check(lambda a, i, j, v: torch.ops.aten.index_put.default(a, [None, i, j], v), rand((3, 2, 5, 4)), rows, slots,
          rand((4,)), nodes=["ScatterNode"])  # values broadcast


def test_index_copy():
    idx = torch.tensor([3, 1])
    check(lambda a, i, v: a.index_copy(1, i, v), rand((2, 5, 3)), idx, rand((2, 2, 3)), nodes=["ScatterNode"])


def test_slice_scatter():
    check(lambda a, v: torch.slice_scatter(a, v, dim=1, start=1, end=3), rand(), rand((2, 2, 4)),
          nodes=["SliceUpdateNode"])


def test_index_put_clamps_out_of_range_indices():
    """MLX's scatter does not bounds-check; the runtime clamps (no stray write)."""
    fn = lambda a, i, v: torch.ops.aten.index_put.default(a, [i], v)  # noqa: E731
    a, v = torch.zeros(4, 2), torch.ones(1, 2)
    edge = lower(Fn(fn), (a, torch.tensor([1]), v))
    assert undelegated_ops(edge) == []
    out = run(edge.to_executorch().buffer, [a, torch.tensor([1000]), v])[0]
    assert torch.equal(out, fn(a, torch.tensor([3]), v))  # clamped to the last row


# -------------------------------------------------------------- attention --
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "boolmask"])
def test_sdpa(kv_heads, masked):
    q, k, v = rand((1, 4, 5, 8)), rand((1, kv_heads, 7, 8)), rand((1, kv_heads, 7, 8))
    mask = torch.rand(1, 1, 5, 7) < 0.7
    mask[..., 0] = True  # every query sees something

    def fn(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m if masked else None,
                                              enable_gqa=kv_heads != 4)

    edge = lower(Fn(fn), (q, k, v, mask))
    assert undelegated_ops(edge) == []
    assert "ScaledDotProductAttentionNode" in node_types(edge)
    got = run(edge.to_executorch().buffer, [q, k, v, mask])[0]
    torch.testing.assert_close(got, fn(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_sdpa_causal_square():
    q, k, v = rand((1, 2, 6, 8)), rand((1, 2, 6, 8)), rand((1, 2, 6, 8))
    check(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v,
          nodes=["ScaledDotProductAttentionNode"])


# ---------------------------------------------------------- dynamic sizes --
class Dynamic(torch.nn.Module):
    """Sizes of a dynamic dimension in view, expand, arange, slice, full."""

    def forward(self, x):
        n = x.shape[1]
        pos = torch.arange(n) + 1
        h = x.view(x.shape[0], n, 2, 2).reshape(x.shape[0], n, 4) * pos[None, :, None]
        ones = torch.ones(x.shape[0], n, 1)
        h = torch.cat([h, ones.expand(x.shape[0], n, 1)], dim=-1)
        return h[:, :, 1:], h[:, -1, :], torch.full((n,), 2.0) * n


@pytest.mark.parametrize("length", [1, 2, 7, 16])
def test_dynamic_sizes_run_at_every_length(length):
    seq = torch.export.Dim("seq", min=1, max=16)
    x = rand((2, 5, 4))
    edge = lower(Dynamic(), (x,), dynamic_shapes={"x": {1: seq}})
    assert undelegated_ops(edge) == []
    assert {"SymIntNode", "DynArangeNode", "DynSliceNode"} <= node_types(edge)
    graph = delegate_graphs(edge)[0]
    # torch.export reports Dim(min=1) as min 2, yet the program accepts 1
    assert [(s.min, s.max) for s in graph.symbols] == [(0, 16)]
    x = rand((2, length, 4))
    got = run(edge.to_executorch().buffer, [x])
    for g, w in zip(got, Dynamic()(x)):
        torch.testing.assert_close(g, w)


class SizeAcrossPartitions(torch.nn.Module):
    """A dynamic size used on both sides of an op we do not lower (flip)."""

    def forward(self, x):
        n = x.shape[0]
        a = torch.flip((x * 2).reshape(n, 2, -1), [0])
        return (a + 1).reshape(n * 2, -1) + n


def test_a_size_shared_by_two_delegates_is_an_input_of_the_second():
    edge = lower(SizeAcrossPartitions(), (rand((4, 6)),), dynamic_shapes={"x": {0: torch.export.Dim("n", max=16)}})
    assert len(delegate_graphs(edge)) == 2
    kinds = [io.kind for g in delegate_graphs(edge) for io in g.inputs]
    assert ir.IOKind.int_scalar in kinds  # the size crosses as an int, never as a delegate output
    pte = edge.to_executorch().buffer
    for n in (1, 3, 5):
        x = rand((n, 6))
        torch.testing.assert_close(run(pte, [x])[0], SizeAcrossPartitions()(x))


# ---------------------------------------------- mutable buffers (KV cache) --
class Cache(torch.nn.Module):
    """A toy KV cache: writes rows at `pos`, returns the running sum of rows
    written so far (reads the whole cache)."""

    def __init__(self, slots=8, width=4):
        super().__init__()
        self.register_buffer("cache", torch.zeros(1, slots, width), persistent=False)
        self.register_buffer("steps", torch.zeros((), dtype=torch.int64), persistent=False)

    def forward(self, x, pos):
        self.cache[:, pos] = x
        self.steps.add_(1)
        return self.cache.sum(dim=1) + 0.0, self.steps + 0


def _cache_program():
    seq = torch.export.Dim("seq", min=1, max=8)
    x, pos = rand((1, 3, 4)), torch.arange(3)
    edge = lower(Cache(), (x, pos), dynamic_shapes={"x": {1: seq}, "pos": {0: seq}}, strict=True)
    return edge


class RowCache(torch.nn.Module):
    """A toy batched KV cache [rows, heads, slots, width]: each row writes
    its tokens at its own slots; returns each row's sum over the slots."""

    def __init__(self, rows=2, heads=3, slots=8, width=4):
        super().__init__()
        self.register_buffer("cache", torch.zeros(rows, heads, slots, width), persistent=False)

    def forward(self, x, slots):  # x [rows, heads, S, width], slots [rows, S]
        rows = torch.arange(x.shape[0])[:, None]
        self.cache[rows, :, slots] = x.transpose(1, 2)
        return self.cache.sum(dim=2) + 0.0


def test_a_batched_cache_writes_each_row_at_its_own_slots():
    seq = torch.export.Dim("seq", min=1, max=8)
    x, slots = rand((2, 3, 3, 4)), torch.tensor([[0, 1, 2], [4, 5, 6]])
    edge = lower(RowCache(), (x, slots), dynamic_shapes={"x": {2: seq}, "slots": {1: seq}}, strict=True)
    assert undelegated_ops(edge) == []
    pte = edge.to_executorch().buffer
    eager = RowCache()
    steps = [(rand((2, 3, 3, 4)), torch.tensor([[0, 1, 2], [4, 5, 6]])),  # a prefill of 3 a row
             (rand((2, 3, 1, 4)), torch.tensor([[3], [7]])),  # then one token a row, each at its own slot
             (rand((2, 3, 2, 4)), torch.tensor([[5, 6], [0, 1]]))]
    method = Runtime.get().load_program(pte).load_method("forward")
    for x, slots in steps:  # the cache persists between calls, as eager's buffer does
        torch.testing.assert_close(method.execute([x, slots])[0], eager(x, slots))


def test_kv_cache_lives_in_the_delegate_and_persists():
    edge = _cache_program()
    assert undelegated_ops(edge) == [], "the cache writes must not run on portable kernels"
    graph = delegate_graphs(edge)[0]
    assert len(graph.mutable_buffers) == 2 and all(b.zero_initial for b in graph.mutable_buffers)
    assert "ScatterNode" in node_types(edge)
    program = Runtime.get().load_program(edge.to_executorch().buffer)
    method = program.load_method("forward")
    eager = Cache()
    xs = [(rand((1, 3, 4)), torch.arange(3)), (rand((1, 1, 4)), torch.tensor([3])), (rand((1, 2, 4)), torch.tensor([4, 5]))]
    for x, pos in xs:
        got = method.execute([x, pos])
        want = eager(x, pos)
        torch.testing.assert_close(got[0], want[0])
        assert int(got[1]) == int(want[1])
    # A reset starts over: the same call now sees an empty cache.
    executorch_mlx.reset_state()
    x, pos = xs[1]
    got = method.execute([x, pos])
    torch.testing.assert_close(got[0], Cache()(x, pos)[0])
    assert int(got[1]) == 1


def test_two_loads_of_one_program_keep_separate_state():
    pte = _cache_program().to_executorch().buffer
    a = Runtime.get().load_program(pte).load_method("forward")
    prog_b = Runtime.get().load_program(pte)
    b = prog_b.load_method("forward")
    x = rand((1, 1, 4))
    a.execute([x, torch.tensor([0])])
    a.execute([x, torch.tensor([1])])
    got = b.execute([x, torch.tensor([2])])
    torch.testing.assert_close(got[0], x[:, 0])  # b saw only its own write
    assert int(got[1]) == 1


# ------------------------------------------------------------------ linear --
class Linear(torch.nn.Module):
    def __init__(self, k, n, bias):
        super().__init__()
        self.fc = torch.nn.Linear(k, n, bias=bias)

    def forward(self, x):
        return self.fc(x)


# (M >= 17 is a prefill's product: 19, 33 and 70 rows leave rows of x past
# the kernel's vectors of 16 and chunks of 64, K = 37 and 100 values past its
# steps of 16, N = 13, 50, 130 weight rows past its groups of 6-24)
LINEAR_CASES = [(1, 64, 32, True), (3, 37, 13, False), (64, 256, 130, True), (5, 7, 1, True), (19, 37, 13, True),
                (33, 100, 50, False), (70, 37, 29, True)]


@pytest.mark.parametrize("m,k,n,bias", LINEAR_CASES)
def test_linear_kernel(m, k, n, bias):
    """Our CPU kernel (float32): any M, K not a multiple of the vector width,
    N not a multiple of the row block."""
    assert_matches_eager(Linear(k, n, bias).eval(), (rand((m, k)),), expect_nodes={"LinearNode"})


def test_float_linear_rows_equal_one_row_calls_bit_for_bit(tmp_path):
    """Up to 16 rows of x (a decode step, a verify call), the float32 kernel
    computes each row as a one-row call does, whichever rows of x share a
    pass over a weight row (one, two or four), in the plain C++ build, the
    AVX2 one and this CPU's (AVX-512 where it has it)."""
    torch.manual_seed(3)
    model = Linear(300, 45, True).eval()  # K: 37 vectors of 8 and a tail; N: not a multiple of 4
    x = rand((16, 300))
    pte = tmp_path / "linear.pte"
    pte.write_bytes(lower(model, (x,), dynamic_shapes=({0: torch.export.Dim("m", min=1, max=16)},))
                    .to_executorch().buffer)
    calls = [(pte, [[x[i:i + 1]] for i in range(len(x))] + [[x[:n]] for n in range(1, 17)])]
    for build in ("plain", "avx2"):
        (each,) = run_elsewhere(calls, {"EMLX_X86_KERNELS": build}, tmp_path)
        ones, many = [y[0] for y in each[:16]], [y[0] for y in each[16:]]
        assert all(torch.equal(many[n - 1][i], ones[i][0]) for n in range(1, 17) for i in range(n)), build
    program = Runtime.get().load_program(pte.read_bytes())  # this process's build (alive while its method runs)
    method = program.load_method("forward")
    ones = [method.execute([x[i:i + 1]])[0] for i in range(len(x))]
    assert all(torch.equal(method.execute([x[:n]])[0][i], ones[i][0]) for n in range(1, 17) for i in range(n))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_linear_half_dtypes(dtype):
    """bfloat16 runs our kernel, float16 MLX's matmul (test_quantized.py checks both paths agree)."""
    model = Linear(24, 10, True).to(dtype).eval()
    assert_matches_eager(model, (rand((2, 3, 24), dtype),), expect_nodes={"LinearNode"})


class RMSNorm(torch.nn.Module):
    """transformers' LlamaRMSNorm, as it decomposes in export."""

    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.rand(dim) + 0.5)
        self.eps = eps

    def forward(self, x):
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_fused(dtype):
    model = RMSNorm(48).to(dtype).eval()
    x = rand((2, 5, 48), dtype)
    assert_matches_eager(model, (x,), expect_nodes={"RmsNormNode"})
    types = node_types(lower(model, (x,)))
    assert not {"PowerNode", "MeanNode", "RsqrtNode"} & types, f"the decomposed norm is left in the IR: {types}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("affine", ["weight+bias", "weight", "none"])
def test_layer_norm_is_one_node(dtype, affine):
    model = torch.nn.LayerNorm(48, eps=1e-5, elementwise_affine=affine != "none", bias=affine == "weight+bias")
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-1.5, 1.5)
    model = model.to(dtype).eval()
    x = rand((2, 5, 48), dtype)
    assert_matches_eager(model, (x,), expect_nodes={"LayerNormNode"})
    assert not {"MeanNode", "RsqrtNode"} & node_types(lower(model, (x,)))


def test_layer_norm_whose_statistics_are_used_stays_outside_and_runs():
    """native_layer_norm's mean and rstd (training outputs) are not computed by
    LayerNormNode: a graph that reads them leaves the op to ExecuTorch."""
    fn = lambda x: torch.ops.aten.native_layer_norm(x, [16], None, None, 1e-5)[1] + 1  # noqa: E731
    x = rand((3, 16))
    edge = lower(Fn(fn), (x,))
    assert "aten.native_layer_norm.default" in str(undelegated_ops(edge))
    torch.testing.assert_close(run(edge.to_executorch().buffer, [x])[0], fn(x))


def test_a_size_expression_reaching_a_delegate_falls_back_and_runs():
    """A tensor sized 2*s, made outside any delegate (after flip, which has no
    handler), read by an op we lower: that op stays with ExecuTorch, saying
    why, instead of an error while lowering (delegate input sizes must be
    the program's own symbols)."""
    from executorch.exir import to_edge_transform_and_lower

    from executorch_mlx.partitioner import DERIVED_SIZE_INPUT

    class M(torch.nn.Module):
        def forward(self, x):
            return torch.flip(torch.cat([x, x]) * 2, dims=[1]) + 1

    partitioner = executorch_mlx.MLXPartitioner()
    ep = torch.export.export(M(), (rand((3, 4)),), dynamic_shapes={"x": {0: torch.export.Dim("s", min=2, max=64)}})
    edge = to_edge_transform_and_lower(ep, partitioner=[partitioner])
    reasons = dict(partitioner.outside)
    assert "aten.flip.default" in reasons, "flip is lowered now: this test needs another op without a handler"
    assert reasons.get("aten.add.Tensor") == DERIVED_SIZE_INPUT, reasons
    x = rand((5, 4))
    torch.testing.assert_close(run(edge.to_executorch().buffer, [x])[0], M()(x))


def test_attention_we_do_not_lower_decomposes_and_runs():
    """is_causal with fewer queries than keys (torch aligns the mask top-left,
    MLX bottom-right): kept off MLX's kernel, decomposed into ops we lower."""
    q, k, v = rand((1, 2, 3, 8)), rand((1, 2, 5, 8)), rand((1, 2, 5, 8))
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    edge = lower(Fn(fn), (q, k, v))
    assert "ScaledDotProductAttentionNode" not in node_types(edge)
    got = run(edge.to_executorch().buffer, [q, k, v])[0]
    torch.testing.assert_close(got, fn(q, k, v), atol=1e-5, rtol=1e-5)


# The CPU attention kernel: query blocks (64 rows), masks of every kind,
# key columns skipped where no query of a block attends, strided queries.
def _cache_mask(L, S):
    """What a decoder's mask over a static cache looks like: queries at the
    last L of the first S - 3 positions, the last 3 slots not written yet."""
    pos = torch.arange(S - 3 - L, S - 3)
    return torch.arange(S)[None, None, None, :] <= pos[None, None, :, None]


@pytest.mark.parametrize("L,S", [(1, 9), (5, 40), (130, 200)])
@pytest.mark.parametrize("mask_kind", ["none", "cache", "additive", "random"])
@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_attention_kernel(L, S, mask_kind, kv_heads):
    q, k, v = rand((1, L, 4, 16)), rand((1, kv_heads, S, 16)), rand((1, kv_heads, S, 8))
    mask = {"none": None, "cache": _cache_mask(L, S), "random": torch.rand(1, 4, L, S) < 0.5,
            "additive": torch.where(_cache_mask(L, S), torch.rand(1, 1, L, S), -torch.inf)}[mask_kind]
    if mask is not None and mask.dtype == torch.bool:
        mask[..., 0] = True  # every query sees something

    def fn(q, k, v, *m):
        # q arrives [B, L, H, D] and is transposed, as in a decoder: a strided operand
        return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=m[0] if m else None,
                                              enable_gqa=kv_heads != 4)

    args = (q, k, v) + (() if mask is None else (mask,))
    edge = lower(Fn(fn), args)
    assert "ScaledDotProductAttentionNode" in node_types(edge)
    got = run(edge.to_executorch().buffer, list(args))[0]
    torch.testing.assert_close(got, fn(*args), atol=1e-5, rtol=1e-5)


def test_attention_kernel_row_that_attends_nothing_is_zero_like_torch():
    q, k, v = rand((1, 2, 3, 8)), rand((1, 2, 6, 8)), rand((1, 2, 6, 8))
    mask = torch.ones(1, 1, 3, 6, dtype=torch.bool)
    mask[..., 1, :] = False
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # noqa: E731
    got = run(lower(Fn(fn), (q, k, v, mask)).to_executorch().buffer, [q, k, v, mask])[0]
    want = fn(q, k, v, mask)
    assert torch.equal(want[:, :, 1], torch.zeros_like(want[:, :, 1]))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("D,Dv", [(16, 24), (12, 20)], ids=["vectors", "other-head-dims"])
def test_attention_kernel_rows_equal_one_row_calls_bit_for_bit(D, Dv):
    """A call of a few query rows (speculative verification) computes each row
    as a one-row call (a decode step) does, whatever key columns the other
    rows attend: here a sliding window moves each row's first column. (Head
    dims not a multiple of 8 take the kernel's other few-row path.)"""
    S, L = 40, 5
    q, k, v = rand((1, 4, L, D)), rand((1, 2, S, D)), rand((1, 2, S, Dv))
    pos, cols = torch.arange(S - 3 - L, S - 3)[:, None], torch.arange(S)[None, :]
    mask = ((cols <= pos) & (cols > pos - 11))[None, None]  # first columns 22..26
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)  # noqa: E731
    many = run(lower(Fn(fn), (q, k, v, mask)).to_executorch().buffer, [q, k, v, mask])[0]
    torch.testing.assert_close(many, fn(q, k, v, mask), atol=1e-5, rtol=1e-5)
    one = lower(Fn(fn), (q[:, :, :1], k, v, mask[:, :, :1])).to_executorch().buffer
    for i in range(L):
        got = run(one, [q[:, :, i:i + 1].contiguous(), k, v, mask[:, :, i:i + 1].contiguous()])[0]
        assert torch.equal(got[:, :, 0], many[:, :, i]), i


class StaticCacheAttention(torch.nn.Module):
    """A decoder layer's attention over a static cache, as transformers writes
    it: index_copy_ of the new keys/values at their positions, repeat_kv, a
    mask hiding the slots after each query's position. The cache starts full
    of garbage: only the mask keeps the unwritten slots out."""

    def __init__(self, slots: int, kv_heads: int = 2, heads: int = 4, dim: int = 8, merged: bool = False):
        super().__init__()
        self.register_buffer("keys", torch.randn(1, kv_heads, slots, dim) * 50)
        self.register_buffer("values", torch.randn(1, kv_heads, slots, dim) * 50)
        self.groups, self.slots, self.merged = heads // kv_heads, slots, merged

    def forward(self, q, k_new, v_new, cache_position):
        self.keys.index_copy_(2, cache_position, k_new)
        self.values.index_copy_(2, cache_position, v_new)
        b, h, s, d = self.keys.shape
        k = self.keys[:, :, None].expand(b, h, self.groups, s, d).reshape(b, h * self.groups, s, d)
        v = self.values[:, :, None].expand(b, h, self.groups, s, d).reshape(b, h * self.groups, s, d)
        mask = torch.arange(self.slots)[None, :] <= cache_position[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None])
        return out.transpose(1, 2).reshape(b, q.shape[2], -1) if self.merged else out


@pytest.mark.parametrize("merged", [False, True])
def test_written_attention_attends_the_written_prefix_only(merged):
    """llm/export/attention.py's rewrite: the same outputs as attention over the whole
    cache, at every position (prefill chunks and decode steps, up to the last
    slot), with the attended keys cut to the last written slot: the caches
    and the mask read whole, the attention node told how many slots
    (lowering/node_fusion.py), its heads merged when the model merges them."""
    from executorch.exir import to_edge_transform_and_lower

    from executorch_mlx.llm.export.attention import attend_written_prefix

    slots = 40
    eager = StaticCacheAttention(slots, merged=merged)
    ours = StaticCacheAttention(slots, merged=merged)
    ours.load_state_dict(eager.state_dict())
    seq = torch.export.Dim("seq", min=1, max=slots - 1)
    example = (rand((1, 4, 2, 8)), rand((1, 2, 2, 8)), rand((1, 2, 2, 8)), torch.arange(2))
    ep = torch.export.export(ours, example, dynamic_shapes=({2: seq}, {2: seq}, {2: seq}, {0: seq}))
    assert attend_written_prefix(ep, slots) == 1
    assert "mlx.written_attention" in str(ep.graph)
    edge = to_edge_transform_and_lower(ep, partitioner=[executorch_mlx.MLXPartitioner()])
    assert undelegated_ops(edge) == []
    assert {"CacheWriteNode", "ScaledDotProductAttentionNode"} <= node_types(edge)
    assert not {"DynSliceNode", "ScatterNode", "TransposeNode"} & node_types(edge)
    attention = [n.op for n in delegate_graphs(edge)[0].nodes if isinstance(n.op, ir.ScaledDotProductAttentionNode)]
    assert len(attention) == 1 and attention[0].keys is not None and attention[0].merge_heads == merged
    program = Runtime.get().load_program(edge.to_executorch().buffer)
    method = program.load_method("forward")
    start = 0
    for length in (20, 1, 1, 7, 1, slots - 30):  # many rows (the block path), then few; ends on the last slot
        args = (rand((1, 4, length, 8)), rand((1, 2, length, 8)), rand((1, 2, length, 8)),
                torch.arange(start, start + length))
        torch.testing.assert_close(method.execute(list(args))[0], eager(*args), atol=1e-5, rtol=1e-5)
        start += length
    assert start == slots


def test_written_attention_reference_equals_whole_cache_attention():
    q, k, v = rand((1, 4, 3, 8)), rand((1, 4, 10, 8)), rand((1, 4, 10, 8))
    written = torch.tensor([4, 5, 6])
    mask = torch.arange(10)[None, :] <= written[:, None]
    got = torch.ops.mlx.written_attention(q, k, v, mask[None, None], written, 0.3)
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], scale=0.3))


def test_rms_norm_weight_folds_in_and_strided_inputs_are_read():
    """float32: weight * norm(x) is one RmsNormNode (no MultiplyNode), also
    on a transposed view (the kernel reads strided rows)."""

    class Transposed(RMSNorm):
        def forward(self, x):
            return super().forward(x.transpose(1, 2))

    model = Transposed(6).eval()
    for rows in (1, 70):  # one row, and enough to use the thread pool
        x = rand((2, 6, rows))
        assert_matches_eager(model, (x,), expect_nodes={"RmsNormNode"})
    assert "MultiplyNode" not in node_types(lower(model, (x,)))


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(torch.nn.Module):
    """transformers' apply_rotary_pos_emb on a projected, transposed q."""

    def forward(self, h, cos, sin):
        q = h.view(h.shape[0], h.shape[1], 3, 8).transpose(1, 2)  # [B, H, L, D]: a strided view
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return (q * cos) + (rotate_half(q) * sin)


@pytest.mark.parametrize("dtype,length", [(torch.float32, 1), (torch.float32, 50), (torch.bfloat16, 5)])
def test_rotary_embedding_is_one_node(dtype, length):
    """A rotation of a tensor as it is: one RopeNode (float32: our kernel,
    one row and enough rows for the pool; bfloat16: MLX ops) with torch's
    products and sums."""
    fn = lambda q, c, s: q * c + rotate_half(q) * s  # noqa: E731
    q, cos, sin = rand((2, 3, length, 8), dtype), rand((2, 1, length, 8), dtype), rand((2, 1, length, 8), dtype)
    assert_matches_eager(Fn(fn), (q, cos, sin), expect_nodes={"RopeNode"})
    types = node_types(lower(Fn(fn), (q, cos, sin)))
    assert not {"ConcatenateNode", "NegativeNode", "AddNode"} & types, types


@pytest.mark.parametrize("dtype,length", [(torch.float32, 1), (torch.float32, 50), (torch.bfloat16, 5)])
def test_rotated_heads_of_a_projection_are_one_node(dtype, length):
    """A projection's output viewed as heads, transposed and rotated: one
    HeadsNode (lowering/node_fusion.py), no view left."""
    h, cos, sin = rand((2, length, 24), dtype), rand((2, length, 8), dtype), rand((2, length, 8), dtype)
    assert_matches_eager(Rotary(), (h, cos, sin), expect_nodes={"HeadsNode"})
    types = node_types(lower(Rotary(), (h, cos, sin)))
    assert not {"RopeNode", "TransposeNode", "ReshapeNode", "ConcatenateNode", "AddNode"} & types, types


class SplitHeads(torch.nn.Module):
    """q, k and v out of one fused projection's output, as a decoder layer
    takes them: slices of the last axis, views as heads, transposes; q and k
    rotated."""

    def forward(self, qkv, cos, sin):
        b, length, _ = qkv.shape
        q, k, v = qkv.split([24, 16, 16], dim=-1)
        q, k, v = (t.view(b, length, -1, 8).transpose(1, 2) for t in (q, k, v))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


class CachedHeads(torch.nn.Module):
    """k and v heads out of a fused projection written into static caches
    (a decoder layer's index_copy_), k rotated; the caches read afterwards."""

    def __init__(self, slots: int = 12):
        super().__init__()
        self.register_buffer("keys", torch.zeros(1, 2, slots, 8))
        self.register_buffer("values", torch.zeros(1, 2, slots, 8))

    def forward(self, kv, cos, sin, position):
        b, length, _ = kv.shape
        k, v = (t.view(b, length, -1, 8).transpose(1, 2) for t in kv.split([16, 16], dim=-1))
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        self.keys.index_copy_(2, position, k * cos + rotate_half(k) * sin)
        self.values.index_copy_(2, position, v)
        return self.keys * 2, self.values.sum(-1)


def test_heads_written_into_a_cache_are_one_node_each(monkeypatch):
    """Heads -> cache write (float32) is one HeadsNode with the cache: no
    CacheWriteNode left, the caches' values bit for bit those of the two
    nodes, call after call (a prefill chunk, then decode steps)."""
    from executorch.exir import to_edge_transform_and_lower

    from executorch_mlx.lowering import node_fusion

    def program():
        seq = torch.export.Dim("seq", min=1, max=8)
        example = (rand((1, 2, 32)), rand((1, 2, 8)), rand((1, 2, 8)), torch.arange(2))
        ep = torch.export.export(CachedHeads(), example, dynamic_shapes=({1: seq}, {1: seq}, {1: seq}, {0: seq}))
        edge = to_edge_transform_and_lower(ep, partitioner=[executorch_mlx.MLXPartitioner()])
        program = Runtime.get().load_program(edge.to_executorch().buffer)
        return edge, program, program.load_method("forward")

    fused, fused_program, fused_method = program()
    heads = [n.op for n in delegate_graphs(fused)[0].nodes if isinstance(n.op, ir.HeadsNode)]
    assert len(heads) == 2 and all(h.cache is not None for h in heads)
    assert "CacheWriteNode" not in node_types(fused)
    without_fusion(monkeypatch, node_fusion._heads_into_cache)
    plain, plain_program, plain_method = program()
    assert "CacheWriteNode" in node_types(plain)
    eager, start = CachedHeads(), 0
    for length in (5, 1, 1):
        args = [rand((1, length, 32)), rand((1, length, 8)), rand((1, length, 8)), torch.arange(start, start + length)]
        got = fused_method.execute(args)
        for g, p, w in zip(got, plain_method.execute(args), eager(*args)):
            assert torch.equal(g, p)
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        start += length


@pytest.mark.parametrize("dtype,length", [(torch.float32, 1), (torch.float32, 70), (torch.bfloat16, 3)])
def test_heads_split_out_of_a_fused_projection_are_one_node_each(dtype, length):
    args = (rand((2, length, 56), dtype), rand((2, length, 8), dtype), rand((2, length, 8), dtype))
    assert_matches_eager(SplitHeads(), args, expect_nodes={"HeadsNode"})
    graph = delegate_graphs(lower(SplitHeads(), args))[0]
    heads = [n.op for n in graph.nodes if isinstance(n.op, ir.HeadsNode)]
    assert sorted((h.start, h.heads, h.head_dim, h.cos is not None) for h in heads) == [
        (0, 3, 8, True), (24, 2, 8, True), (40, 2, 8, False)]
    assert not {"SliceNode", "DynSliceNode", "TransposeNode", "ReshapeNode", "RopeNode"} & node_types(
        lower(SplitHeads(), args))


class NormedHeads(torch.nn.Module):
    """Qwen3's q and k: views as heads normalized over the head dim (an RMS
    norm with a weight) before the transpose and the rotation."""

    def __init__(self):
        super().__init__()
        self.q_norm, self.k_norm = RMSNorm(8), RMSNorm(8)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5), self.k_norm.weight.uniform_(0.5, 1.5)

    def forward(self, qkv, cos, sin):
        b, length, _ = qkv.shape
        q, k = qkv[..., :24].view(b, length, 3, 8), qkv[..., 24:40].view(b, length, 2, 8)
        q, k = self.q_norm(q).transpose(1, 2), self.k_norm(k).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


@pytest.mark.parametrize("length", [1, 70])
def test_normed_heads_are_one_node_each(length):
    """A float32 q/k norm between the view and the transpose joins the
    HeadsNode (a bfloat16 norm computes in float32 between casts: not this
    chain)."""
    model = NormedHeads()
    args = (rand((2, length, 40)), rand((2, length, 8)), rand((2, length, 8)))
    assert_matches_eager(model, args, expect_nodes={"HeadsNode"})
    heads = [n.op for n in delegate_graphs(lower(model, args))[0].nodes if isinstance(n.op, ir.HeadsNode)]
    assert len(heads) == 2 and all(h.norm is not None and h.cos is not None for h in heads)
    assert not {"RmsNormNode", "RopeNode", "TransposeNode", "ReshapeNode"} & node_types(lower(model, args))


def test_fused_nodes_on_mlx_ops_give_the_chains_values(tmp_path):
    """The fused nodes as GPUs run them (MLX's ops: EMLX_DISABLE_CPU_KERNELS=1,
    in a process of its own) against eager."""
    from executorch_mlx.custom_kernel_ops import experts  # noqa: F401  (defines mlx::gather_linear)

    experts_w = rand((3, 5, 8))
    merged = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
        q, k, v, enable_gqa=True).transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)
    cases = [(NormedHeads(), (rand((2, 3, 40)), rand((2, 3, 8)), rand((2, 3, 8)))),
             (SplitHeads(), (rand((2, 3, 56)), rand((2, 3, 8)), rand((2, 3, 8)))),
             (Fn(lambda c, i, u: c.index_copy(2, i, u)), (rand((1, 2, 6, 4)), torch.tensor([4, 1]), rand((1, 2, 2, 4)))),
             (Fn(lambda x: F.silu(x[..., :40]) * x[..., 40:]), (rand((1, 3, 80)),)),
             (Fn(merged), (rand((2, 4, 3, 8)), rand((2, 2, 9, 8)), rand((2, 2, 9, 8)))),
             (Fn(lambda x, i, w: (torch.ops.mlx.gather_linear(x, experts_w, i, None) * w[..., None]).sum(1)),
              (rand((3, 8)), torch.tensor([[0, 2], [1, 1], [2, 0]]), torch.rand(3, 2))),
             (Fn(torch.ops.mlx.accepted_prefix), (torch.tensor([4, 9, 2, 6]), torch.tensor([[1, 3, 4, 8, 2]]))),
             (NormedLinear(), (rand((1, 3, 40)),)),
             (Fn(lambda c, i, x: c.index_copy(2, i, x.view(1, 2, 2, 8).transpose(1, 2))),
              (rand((1, 2, 6, 8)), torch.tensor([4, 1]), rand((1, 2, 16))))]
    files = []
    for i, (model, args) in enumerate(cases):
        pte = tmp_path / f"case{i}.pte"
        pte.write_bytes(lower(model, args).to_executorch().buffer)
        files.append((str(pte), [list(args)]))
    for (model, args), (got,) in zip(cases, run_elsewhere(files, {"EMLX_DISABLE_CPU_KERNELS": "1"}, tmp_path)):
        want = model(*args)
        for g, w in zip(got, want if isinstance(want, tuple) else (want,)):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


class NormedLinear(torch.nn.Module):
    """A decoder's norm before its projection."""

    def __init__(self):
        super().__init__()
        self.norm, self.proj = torch.nn.RMSNorm(40, eps=1e-5), torch.nn.Linear(40, 24, bias=False)
        torch.nn.init.uniform_(self.norm.weight, 0.5, 1.5)

    def forward(self, x):
        return self.proj(self.norm(x))


@pytest.mark.parametrize("rows", [1, 20])
def test_a_norm_before_a_linear_layer_is_taken_inside_it(rows, monkeypatch):
    """rms_norm -> linear (float32) is one LinearNode with `norm`, bit for
    bit the two nodes' values, for a decode step's row and a prefill's."""
    from executorch_mlx.lowering import node_fusion

    model, args = NormedLinear(), (rand((1, rows, 40)),)
    edge = lower(model, args)
    ops = [n.op for g in delegate_graphs(edge) for n in g.nodes]
    assert [type(op).__name__ for op in ops] == ["LinearNode"] and ops[0].norm is not None
    fused = run(edge.to_executorch().buffer, list(args))[0]
    torch.testing.assert_close(fused, model(*args), atol=1e-5, rtol=1e-5)
    without_fusion(monkeypatch, node_fusion._normed_input)
    plain = lower(model, args)
    assert "RmsNormNode" in node_types(plain)
    assert torch.equal(run(plain.to_executorch().buffer, list(args))[0], fused)


@pytest.mark.parametrize("sampled,fed,emitted", [
    ([7], [[3, 5]], [7]),  # a decode step: its one token
    ([4, 9, 2, 6], [[1, 3, 4, 9, 2]], [4, 9, 2, 6]),  # x = 3 and three drafts, every one confirmed
    ([4, 9, 2, 6], [[1, 3, 5, 9, 2]], [4, -1, -1, -1]),  # the first draft rejected
    ([4, 9, 2, 6], [[1, 3, 4, 8, 2]], [4, 9, -1, -1]),  # the second
])
def test_the_tokens_a_verify_call_emits_are_one_node(sampled, fed, emitted):
    """mlx::accepted_prefix (speculative verification's emitted tokens) is
    one AcceptedPrefixNode, with the op's reference values."""
    from executorch_mlx.custom_kernel_ops import verification  # noqa: F401  (defines the op)

    args = (torch.tensor(sampled), torch.tensor(fed))
    assert torch.ops.mlx.accepted_prefix(*args).tolist() == emitted
    edge = lower(Fn(torch.ops.mlx.accepted_prefix), args)
    assert [type(n.op).__name__ for n in delegate_graphs(edge)[0].nodes] == ["AcceptedPrefixNode"]
    assert run(edge.to_executorch().buffer, list(args))[0].tolist() == emitted


def test_a_transposed_view_read_elsewhere_too_is_left_as_it_is():
    """A chain whose inner value has another reader is not fused (the fused
    node would compute it a second time)."""
    fn = lambda h: (h.view(2, 3, 3, 8).transpose(1, 2).sin(), h.view(2, 3, 3, 8).sum(-1))  # noqa: E731
    assert_matches_eager(Fn(fn), (rand((2, 3, 24)),))
    assert "HeadsNode" not in node_types(lower(Fn(fn), (rand((2, 3, 24)),)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cache_write_is_one_node_and_leaves_an_input_cache_as_it_was(dtype):
    """index_copy along axis 2 of a [B, H, S, D] cache is one CacheWriteNode
    (any dtype; the update cast to the cache's). The cache here is an input
    the caller holds and also read afterwards: written into a copy, never
    in place. Out-of-range slots are clamped."""
    fn = lambda c, i, u: (c.index_copy(2, i, u), c * 2)  # noqa: E731
    args = (rand((1, 2, 6, 4), dtype), torch.tensor([4, 1]), rand((1, 2, 2, 4), dtype))
    assert_matches_eager(Fn(fn), args, expect_nodes={"CacheWriteNode"})
    assert not {"ScatterNode", "TransposeNode", "ExpandDimsNode"} & node_types(lower(Fn(fn), args))
    pte = lower(Fn(fn), args).to_executorch().buffer
    got = run(pte, [args[0], torch.tensor([9, -3]), args[2]])[0]
    want = args[0].clone()
    want[:, :, 5], want[:, :, 0] = args[2][:, :, 0], args[2][:, :, 1]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 1), (torch.float32, 300), (torch.bfloat16, 4)])
def test_silu_of_a_fused_gate_and_up_is_one_node(dtype, rows):
    """silu(x[..., :N]) * x[..., N:] (a fused gate/up product): one SiluNode
    reading both halves, no slices; the same values as two inputs give."""
    fn = lambda x: F.silu(x[..., :40]) * x[..., 40:]  # noqa: E731
    args = (rand((1, rows, 80), dtype),)
    assert_matches_eager(Fn(fn), args, expect_nodes={"SiluNode"})
    graph = delegate_graphs(lower(Fn(fn), args))[0]
    assert [type(n.op).__name__ for n in graph.nodes] == ["SiluNode"] and graph.nodes[0].op.halves
    two = lambda g, u: F.silu(g) * u  # noqa: E731
    x = args[0]
    whole = run(lower(Fn(fn), args).to_executorch().buffer, [x])[0]
    halves = run(lower(Fn(two), (x[..., :40], x[..., 40:])).to_executorch().buffer,
                 [x[..., :40].contiguous(), x[..., 40:].contiguous()])[0]
    assert torch.equal(whole, halves)


@pytest.mark.parametrize("masked", [None, "bool", "additive"])
@pytest.mark.parametrize("length", [1, 20])
def test_attention_output_with_its_heads_merged_is_one_node(masked, length):
    """attention(q, k, v).transpose(1, 2).reshape(B, L, H * D): one
    ScaledDotProductAttentionNode writing the heads side by side (few query
    rows and the block path)."""
    q, k, v = rand((2, 4, length, 8)), rand((2, 2, 9, 8)), rand((2, 2, 9, 8))
    mask = {None: None, "bool": rand((1, 1, length, 9), torch.bool),
            "additive": rand((1, 1, length, 9))}[masked]

    def fn(q, k, v, *mask):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[0] if mask else None, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1)

    args = (q, k, v) + ((mask,) if mask is not None else ())
    assert_matches_eager(Fn(fn), args, expect_nodes={"ScaledDotProductAttentionNode"})
    graph = delegate_graphs(lower(Fn(fn), args))[0]
    attention = [n.op for n in graph.nodes if isinstance(n.op, ir.ScaledDotProductAttentionNode)]
    assert len(attention) == 1 and attention[0].merge_heads
    assert not {"TransposeNode", "ReshapeNode"} & node_types(lower(Fn(fn), args))


def test_rotation_of_another_tensor_is_not_rope():
    """q * cos + rotate_half(k) * sin is not a rotary embedding of q."""
    fn = lambda q, k, c, s: q * c + rotate_half(k) * s  # noqa: E731
    args = tuple(rand((2, 3, 8)) for _ in range(4))
    assert_matches_eager(Fn(fn), args)
    assert "RopeNode" not in node_types(lower(Fn(fn), args))
