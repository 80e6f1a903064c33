"""Weight-only quantization: our quantized linear and embedding against MLX's
own quantized reference (mlx.core.quantize / quantized_matmul / dequantize
in Python) on the same weights, every kernel path against MLX's ops path,
whole models against their eager quantized reference, and export errors."""

from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
import torch
from cli_runs import cli
from executorch.runtime import Runtime
from harness import delegate_graphs, lower, node_types, run, undelegated_ops, without_fusion
from other_process import run_elsewhere
from test_ops import rand

import executorch_mlx  # noqa: F401  (registers the ops)
from executorch_mlx.custom_kernel_ops.quantized import QuantFormat, dequantize
from executorch_mlx.llm.export.options import ExportOptions
from executorch_mlx.llm.export.quantize import QuantizedTable, quantize_model, quantize_weight

MX_DTYPES = {torch.float32: mx.float32, torch.bfloat16: mx.bfloat16}


def to_mx(t: torch.Tensor) -> mx.array:
    return mx.array(t.to(torch.float32).numpy()).astype(MX_DTYPES[t.dtype])


def to_torch(a: mx.array, dtype: torch.dtype) -> torch.Tensor:
    return torch.from_numpy(np.array(a.astype(mx.float32))).to(dtype)


class QLinear(torch.nn.Module):
    def __init__(self, weight, bias, group_size, bits, mode="affine"):
        super().__init__()
        self.table = QuantizedTable(weight, QuantFormat(bits, group_size, mode))
        self.bias = bias

    def forward(self, x):
        return self.table.linear(x, self.bias)


class QEmbedding(torch.nn.Module):
    def __init__(self, weight, group_size, bits, mode="affine"):
        super().__init__()
        self.table = QuantizedTable(weight, QuantFormat(bits, group_size, mode))

    def forward(self, ids):
        return self.table(ids)


def mlx_quantized_linear(x, weight, bias, group_size, bits):
    """MLX's own reference: quantize (in the weight's dtype), then
    quantized_matmul (in Python MLX). Computed in float32: MLX's bfloat16
    CPU quantized_matmul rounds its sums to bfloat16 as it goes (off by 2.0
    on outputs near 70 where ours is within 0.13 of the float64 result)."""
    w, s, b = mx.quantize(to_mx(weight), group_size=group_size, bits=bits)
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    y = mx.quantized_matmul(f32(to_mx(x)), w, f32(s), f32(b), transpose=True, group_size=group_size, bits=bits)
    if bias is not None:
        y = y + f32(to_mx(bias))
    return to_torch(y, x.dtype)


TOL = {torch.float32: dict(atol=2e-4, rtol=2e-4), torch.bfloat16: dict(atol=3e-2, rtol=3e-2)}


def group_steps(amax: torch.Tensor) -> torch.Tensor:
    """x's step per group: max|x| / 127, rounded to half precision (as
    llama.cpp stores its blocks' steps) where that is a normal half."""
    step = amax / 127
    half = step.to(torch.float16).to(torch.float32)
    normal = (step >= 2.0 ** -14) & (half <= 65504)
    return torch.where(normal, half, step)


def integer_rows(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """x as our CPU kernel rounds it for integer dot products with the
    weights' codes: per group, round(x * 127 / max|x|) (ties to even) times
    the group's step. The rounded x meets the whole weight, biases too."""
    g = x.to(torch.float32).reshape(*x.shape[:-1], -1, group_size)
    amax = g.abs().amax(-1, keepdim=True)
    to_int = torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))
    return (torch.round(g * to_int) * group_steps(amax)).reshape(x.shape)


def dequantized(table: QuantizedTable) -> torch.Tensor:
    return dequantize(table.qweight, table.scales.float(), table.biases.float(), table.fmt.group_size,
                      table.fmt.bits)


def integer_linear(table: QuantizedTable, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """What our CPU kernel computes, in float32: the rounded x times the
    dequantized weights."""
    y = integer_rows(x.float(), table.fmt.group_size) @ dequantized(table).T
    return (y if bias is None else y + bias.float()).to(x.dtype)


def assert_close_to_integer_rows(got, want, x, table, dtype):
    """got within the float tolerance plus what rounding x to integers can
    move each output: the rounding of each value times |w|."""
    bound = (integer_rows(x, table.fmt.group_size) - x.float()).abs() @ dequantized(table).abs().T
    tol = TOL[dtype]
    excess = (got.float() - want.float()).abs() - bound - tol["atol"] - tol["rtol"] * want.float().abs()
    assert excess.max() <= 0, f"off by {excess.max():.3g} beyond the bound of rounding x to integers"


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_packing_is_mlx_quantize_and_dequantize_inverts_it(bits, group_size):
    w = torch.randn(24, 256)
    packed, scales, biases = quantize_weight(w, QuantFormat(bits, group_size))
    ref = mx.quantize(to_mx(w), group_size=group_size, bits=bits)
    assert np.array_equal(packed.numpy().view(np.uint32), np.array(ref[0]))
    want = to_torch(mx.dequantize(*ref, group_size=group_size, bits=bits), torch.float32)
    torch.testing.assert_close(dequantize(packed, scales, biases, group_size, bits), want, atol=1e-6, rtol=1e-6)
    # a quantization error is within one step of its group (MLX rounds the zero point too)
    assert ((want - w).abs() <= scales.repeat_interleave(group_size, 1).abs() + 1e-5).all()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,bias", [(1, False), (1, True), (5, True), (20, True)])
def test_quantized_linear_equals_mlx_quantized_matmul(bits, dtype, m, bias):
    """Group size 64, K=320, N=37: one row of x, an odd number (rows go in
    pairs) and more than 16, with and without bias."""
    weight = torch.randn(37, 320).to(dtype)
    b = torch.randn(37).to(dtype) if bias else None
    x = rand((m, 320), dtype)
    model = QLinear(weight, b, 64, bits).eval()
    edge = lower(model, (x,))
    assert undelegated_ops(edge) == [] and "QuantizedLinearNode" in node_types(edge)
    got = run(edge.to_executorch().buffer, [x])[0]
    assert got.dtype == dtype and got.shape == (m, 37)
    want = mlx_quantized_linear(x, weight, b, 64, bits)
    assert_close_to_integer_rows(got, want, x, model.table, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantizing_in_chunks_of_rows_changes_nothing(monkeypatch, dtype):
    """quantize_weight hands MLX a few rows at a time (a [vocab, hidden]
    output layer is not copied whole): the same tables as one call."""
    from executorch_mlx.llm.export import quantize

    w = torch.randn(37, 256).to(dtype)
    whole = quantize_weight(w, QuantFormat(4, 64))
    monkeypatch.setattr(quantize, "CHUNK_BYTES", 5 * 256 * w.element_size())  # 5 rows a chunk
    for got, want in zip(quantize_weight(w, QuantFormat(4, 64)), whole):
        assert torch.equal(got, want)
    ref = mx.quantize(to_mx(w), group_size=64, bits=4)
    assert np.array_equal(whole[0].numpy().view(np.uint32), np.array(ref[0]))


@pytest.mark.parametrize("bits", [2, 3, 5, 6])
def test_other_widths_run_on_mlx_quantized_matmul(bits):
    """2, 3, 5 and 6 bits (no CPU kernel of ours: MLX's quantized_matmul and
    dequantize), a linear layer and an embedding, against MLX's own."""
    weight, b, x = torch.randn(37, 320), torch.randn(37), rand((5, 320), torch.float32)
    edge = lower(QLinear(weight, b, 64, bits).eval(), (x,))
    assert undelegated_ops(edge) == [] and "QuantizedLinearNode" in node_types(edge)
    torch.testing.assert_close(run(edge.to_executorch().buffer, [x])[0],
                               mlx_quantized_linear(x, weight, b, 64, bits), atol=1e-4, rtol=1e-4)
    ids = torch.tensor([[0, 36, 7, 7]])
    edge = lower(QEmbedding(weight, 32, bits).eval(), (ids,))
    w, s, bb = mx.quantize(to_mx(weight), group_size=32, bits=bits)
    want = to_torch(mx.dequantize(w, s, bb, group_size=32, bits=bits), torch.float32)[ids]
    torch.testing.assert_close(run(edge.to_executorch().buffer, [ids])[0], want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bits", [4, 8])
def test_each_row_of_a_long_call_is_the_one_row_calls(bits):
    """Rows of x go through the integer kernel two at a time, in blocks of
    64 rows, for any number of rows: each row of a 71-row call (a prefill)
    is bit for bit what a call with that row alone (a decode step) computes."""
    model = QLinear(torch.randn(37, 320), torch.randn(37), 64, bits).eval()
    x = rand((71, 320), torch.float32)
    pte = lower(model, (x,), dynamic_shapes=({0: torch.export.Dim("m", min=1, max=128)},)).to_executorch().buffer
    program = Runtime.get().load_program(pte)  # alive while its method runs
    method = program.load_method("forward")
    whole = method.execute([x])[0].clone()
    assert all(torch.equal(whole[i:i + 1], method.execute([x[i:i + 1]])[0]) for i in range(len(x)))


@pytest.mark.parametrize("bits", [4, 8])
def test_x_with_a_nan_or_an_infinity_meets_tiled_weights_in_floats(bits):
    """4- and 8-bit weights are tiled at load (16 rows side by side:
    kernels/quantized_dot.h); a call whose x holds a NaN or an infinity takes
    the float path, which reads them back in rows: those rows come out NaN
    or infinite, the others as MLX's quantized_matmul makes them."""
    weight = torch.randn(37, 320)
    model = QLinear(weight, None, 64, bits).eval()
    x = rand((4, 320), torch.float32)
    x[0, 5], x[1, 7] = float("nan"), float("inf")
    got = run(lower(model, (x,)).to_executorch().buffer, [x])[0]
    assert torch.isnan(got[0]).all() and not torch.isfinite(got[1]).any()
    torch.testing.assert_close(got[2:], mlx_quantized_linear(x[2:], weight, None, 64, bits), **TOL[torch.float32])


class TableLinear(torch.nn.Module):
    """A quantized table as a linear layer and as an embedding."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, x, ids):
        return self.table.linear(x), self.table(ids)


@pytest.mark.parametrize("bits", [4, 8])
def test_bfloat16_scales_under_float32_x_compute_what_float32_scales_of_the_same_values_do(bits):
    """Scales and biases stored as bfloat16 (export's default
    --scales-dtype) under float32 x: the linear layer (one row and a
    prefill's 20) and the embedding give, bit for bit, what the same table
    gives with its scales and biases widened to float32, from a smaller
    program."""
    weight = torch.randn(37, 320)
    half = QuantizedTable(weight, QuantFormat(bits, 64, bf16_params=True))
    assert half.scales.dtype == half.biases.dtype == torch.bfloat16 and half.out_dtype == torch.float32
    wide = QuantizedTable(None, QuantFormat(bits, 64), tables=(half.qweight, half.scales.float(), half.biases.float()),
                          dtype=torch.float32)
    ids = torch.tensor([0, 15, 36])
    programs = {}
    for name, table in (("half", half), ("wide", wide)):
        x = rand((20, 320), torch.float32)
        edge = lower(TableLinear(table).eval(), (x, ids), dynamic_shapes=({0: torch.export.Dim("m", min=1, max=32)},
                                                                         None))
        assert undelegated_ops(edge) == []
        programs[name] = edge.to_executorch().buffer
    assert len(programs["half"]) < len(programs["wide"])
    for x in (rand((1, 320), torch.float32), rand((20, 320), torch.float32)):
        got, want = run(programs["half"], [x, ids]), run(programs["wide"], [x, ids])
        assert got[0].dtype == got[1].dtype == torch.float32
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    torch.testing.assert_close(got[1], dequantized(wide)[ids], atol=1e-6, rtol=1e-6)


class TiedTable(torch.nn.Module):
    """An embedding and the output layer tied to it: one table."""

    def __init__(self, weight, group_size, bits):
        super().__init__()
        self.table = QuantizedTable(weight, QuantFormat(bits, group_size))

    def forward(self, ids):
        h = self.table(ids)
        return h, self.table.linear(h)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_tied_table_is_tiled_for_its_head_and_its_embedding_reads_rows_of_the_tiles(bits):
    """A table the output layer and the embedding share is tiled at load
    for the layer (kernels/quantized_dot.h); the embedding takes its rows
    from the tiles: every row (37: two tiles and 5 rows stored in rows) is the
    table's dequantized row, and the logits are what the layer computes on
    its own."""
    weight = torch.randn(37, 128)
    ids = torch.tensor([[0, 15, 16, 31, 32, 36, 5, 20, 33]])
    h, logits = run(lower(TiedTable(weight, 64, bits).eval(), (ids,)).to_executorch().buffer, [ids])
    table = QuantizedTable(weight, QuantFormat(bits, 64))
    torch.testing.assert_close(h, dequantized(table)[ids], atol=1e-6, rtol=1e-6)
    alone = run(lower(QLinear(weight, None, 64, bits).eval(), (h[0],)).to_executorch().buffer, [h[0]])[0]
    assert torch.equal(logits[0], alone)


def test_embedding_rows_are_the_mlx_ops_rows_bit_for_bit(tmp_path):
    """An embedding's rows come from one kernel of ours on a CPU stream
    (kernels/quantized_rows.h) where MLX's dequantize composes ~45 arrays:
    2-, 4- and 8-bit tables, float32 and bfloat16 scales, a bfloat16
    program (rounded after the product and after the bias, as MLX's ops
    round), a tied table read from its tiles; ids negative and out of range
    (clamped) included. Each equals the MLX-ops path (what GPUs run,
    EMLX_DISABLE_CPU_KERNELS=1, in a process of its own) bit for bit."""
    torch.manual_seed(3)
    weight = torch.randn(37, 128)
    ids = torch.tensor([[0, 15, 16, 31, 32, 36, -1, -37, 99, -99, 7]])
    tables = {f"int{bits}": QEmbedding(weight, 64, bits) for bits in (2, 4, 8)}
    tables["int4 bf16 scales"] = QEmbedding(weight, 32, 4)
    tables["int4 bf16 scales"].table = QuantizedTable(weight, QuantFormat(4, 32, bf16_params=True))
    tables["int8 bf16 program"] = QEmbedding(weight.to(torch.bfloat16), 64, 8)
    tables["int4 tied"] = TiedTable(weight, 64, 4)
    cases = []
    for name, model in tables.items():
        pte = tmp_path / f"{name.replace(' ', '_')}.pte"
        pte.write_bytes(lower(model.eval(), (ids[:, :4],), dynamic_shapes=({1: torch.export.Dim("n", max=16)},))
                        .to_executorch().buffer)
        cases.append(str(pte))
    want = [each[0][0] for each in run_elsewhere([(pte, [[ids]]) for pte in cases],
                                                 {"EMLX_DISABLE_CPU_KERNELS": "1"}, tmp_path)]
    for name, pte, expected in zip(tables, cases, want):
        got = run(Path(pte).read_bytes(), [ids])[0]
        assert got.dtype == expected.dtype and torch.equal(got, expected), name
    clamped = ids.clamp(-37, 36) % 37
    torch.testing.assert_close(want[1], dequantized(tables["int4"].table)[clamped], atol=1e-6, rtol=1e-6)


def test_every_x86_build_computes_each_row_alone(tmp_path):
    """The integer kernel is built in plain C++ and for AVX2, AVX-VNNI and
    AVX-512 VNNI (EMLX_X86_KERNELS caps the build a process uses, so each
    runs here up to what this CPU has). In each, a row of a many-row call is
    the one-row call's bit for bit, with every number of rows a pass can take,
    an odd number of groups, and 37 weight rows (two tiles of the tiled layout
    and 5 rows in rows); and every build gives the same bits."""
    torch.manual_seed(1)
    cases = []
    for bits, k, group in ((4, 320, 64), (8, 384, 128), (4, 640, 128), (4, 256, 32), (8, 96, 32)):
        model = QLinear(torch.randn(37, k), torch.randn(37), group, bits).eval()
        x = rand((13, k), torch.float32)
        pte = tmp_path / f"q{bits}_{group}.pte"
        pte.write_bytes(lower(model, (x,), dynamic_shapes=({0: torch.export.Dim("m", min=1, max=16)},))
                        .to_executorch().buffer)
        cases.append((str(pte), x))
    builds = {}
    for build in ("plain", "avx2", "avx-vnni", "best"):
        if build == "best" and "EMLX_X86_KERNELS" not in os.environ:  # this process's own build
            builds[build] = []
            for pte, x in cases:
                program = Runtime.get().load_program(Path(pte).read_bytes())  # alive while its method runs
                method = program.load_method("forward")
                builds[build].append((method.execute([x])[0].clone(),
                                      [method.execute([x[i:i + 1]])[0] for i in range(len(x))]))
        else:
            calls = [(pte, [[x]] + [[x[i:i + 1]] for i in range(len(x))]) for pte, x in cases]
            builds[build] = [(each[0][0], [row[0] for row in each[1:]])
                             for each in run_elsewhere(calls, {"EMLX_X86_KERNELS": build}, tmp_path)]
        for (whole, rows), (pte, _) in zip(builds[build], cases):
            assert all(torch.equal(whole[i], row[0]) for i, row in enumerate(rows)), (build, pte)
    for (a, _), (b, _), (c, _), (d, _) in zip(builds["plain"], builds["avx2"], builds["avx-vnni"], builds["best"]):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_one_row_kernel_rounds_x_to_integers_and_nothing_else(bits, group_size):
    """The integer path equals float math on x rounded as documented
    (integer_rows): the rounding of x is its only departure from exact."""
    weight = torch.randn(41, 256)
    x = rand((1, 256), torch.float32) * torch.logspace(-3, 3, 256)  # groups of very different scales
    model = QLinear(weight, None, group_size, bits).eval()
    got = run(lower(model, (x,)).to_executorch().buffer, [x])[0]
    w = dequantized(model.table).double()
    want = integer_rows(x, group_size).double() @ w.T
    # float32 sums: error relative to the sum of |terms|, not to the (cancelling) result
    magnitude = (x.abs().double() @ w.abs().T).max().item()
    torch.testing.assert_close(got, want.float(), atol=1e-6 * magnitude, rtol=1e-5)
    # and it is not the float path: that one has no rounding of x to undo
    assert not torch.allclose(got, (x.double() @ w.T).float(), atol=1e-6, rtol=1e-7)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 20])
def test_float_activations_multiply_x_by_the_dequantized_weights(bits, m):
    """Exported with activations="float", the kernel meets x unrounded, as
    MLX's quantized_matmul does: within float32 rounding of x @ w^T (one row,
    the dot-product rows and the tiled rows beyond 16), where the int8 path
    is off by its rounding of x. Each row of a call of up to 16 rows is
    the one-row call's bit for bit."""
    weight, b = torch.randn(37, 320), torch.randn(37)
    x = rand((m, 320), torch.float32) * torch.logspace(-2, 2, 320)  # groups of different scales
    model = QLinear(weight, b, 64, bits).eval()
    edge = lower(model, (x,), activations="float")
    nodes = [n.op for g in delegate_graphs(edge) for n in g.nodes if type(n.op).__name__ == "QuantizedLinearNode"]
    assert [n.float_activations for n in nodes] == [True]
    got = run(edge.to_executorch().buffer, [x])[0]
    want = (x.double() @ dequantized(model.table).double().T + b.double()).float()
    magnitude = (x.abs().double() @ dequantized(model.table).abs().double().T).max().item()
    torch.testing.assert_close(got, want, atol=1e-6 * magnitude, rtol=1e-5)
    torch.testing.assert_close(got, mlx_quantized_linear(x, weight, b, 64, bits), atol=1e-6 * magnitude, rtol=1e-5)
    rounded = run(lower(model, (x,)).to_executorch().buffer, [x])[0]
    assert not torch.allclose(rounded, want, atol=1e-6 * magnitude, rtol=1e-5)
    if m <= 16:
        one_row = lower(model, (x[:1],), activations="float").to_executorch().buffer
        assert all(torch.equal(got[i:i + 1], run(one_row, [x[i:i + 1]])[0]) for i in range(m))


def test_unknown_activations_are_refused():
    with pytest.raises(ValueError, match="activations must be one of int8, float"):
        lower(QLinear(torch.randn(8, 64), None, 64, 4).eval(), (torch.randn(1, 64),), activations="fp8")


@pytest.mark.parametrize("bits", [4, 8])
def test_quantized_embedding_equals_mlx_dequantize(bits):
    weight = torch.randn(50, 128)
    ids = torch.tensor([[0, 49, 7, 7, 13]])
    edge = lower(QEmbedding(weight, 64, bits).eval(), (ids,))
    assert undelegated_ops(edge) == [] and "QuantizedEmbeddingNode" in node_types(edge)
    got = run(edge.to_executorch().buffer, [ids])[0]
    w, s, b = mx.quantize(to_mx(weight), group_size=64, bits=bits)
    want = to_torch(mx.dequantize(w, s, b, group_size=64, bits=bits), torch.float32)[ids]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_is_mlx_mxfp4(dtype):
    """MXFP4 (4-bit E2M1 values, a power-of-two scale per 32): the packing
    is mlx.core.quantize's, the reference dequantizes as mlx.core.dequantize
    (every scale exponent, 0 to 255), and a linear layer with a bias and an
    embedding lowered and run equal MLX's quantized_matmul / dequantize."""
    mxfp4 = QuantFormat(4, 32, "mxfp4")
    weight, b, x = torch.randn(37, 320).to(dtype), torch.randn(37).to(dtype), rand((5, 320), dtype)
    packed, scales, biases = quantize_weight(weight, mxfp4)
    w, s = mx.quantize(to_mx(weight), group_size=32, bits=4, mode="mxfp4")
    assert biases is None and scales.dtype == torch.uint8
    assert np.array_equal(packed.numpy().view(np.uint32), np.array(w)) and np.array_equal(scales.numpy(), np.array(s))
    every = torch.arange(37 * 10, dtype=torch.int32).reshape(37, 10).remainder(256).to(torch.uint8)
    want = mx.dequantize(w, mx.array(every.numpy()), None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32)
    torch.testing.assert_close(dequantize(packed, every, None, 32, 4, "mxfp4"), to_torch(want, torch.float32),
                               atol=0, rtol=0, equal_nan=True)  # (exponent 255 is 2^128: 0 * inf)

    edge = lower(QLinear(weight, b, 32, 4, "mxfp4").eval(), (x,))
    assert undelegated_ops(edge) == [] and "QuantizedLinearNode" in node_types(edge)
    want = mx.quantized_matmul(to_mx(x), w, s, None, transpose=True, group_size=32, bits=4, mode="mxfp4") + to_mx(b)
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.1, rtol=0.02)
    torch.testing.assert_close(run(edge.to_executorch().buffer, [x])[0], to_torch(want, dtype), **tol)
    ids = torch.tensor([[0, 36, 7, 7]])
    edge = lower(QEmbedding(weight, 32, 4, "mxfp4").eval(), (ids,))
    got = run(edge.to_executorch().buffer, [ids])[0]
    want = to_torch(mx.dequantize(w, s, None, group_size=32, bits=4, mode="mxfp4", dtype=mx.float32), dtype)[ids]
    assert got.dtype == dtype and torch.equal(got, want)


KERNEL_CASES = {
    "f32": lambda: torch.nn.Linear(300, 70),
    "bf16": lambda: torch.nn.Linear(320, 70).to(torch.bfloat16),
    "q4": lambda: QLinear(torch.randn(70, 320), torch.randn(70), 64, 4),
    "q8": lambda: QLinear(torch.randn(70, 256), None, 128, 8),
}


def test_kernel_paths_agree_in_subprocesses(tmp_path):
    """For each weight format, our kernel, one thread of it, and the MLX-ops
    path (what GPUs run: matmul / quantized_matmul) give the same result on
    the same program, for one row of x and for several. The environment
    variables are read once per process: the last two run in subprocesses."""
    torch.manual_seed(0)
    cases, want, models = [], [], []
    for i, (case, make) in enumerate(KERNEL_CASES.items()):
        model = make().eval()
        models.append(model)
        k = model.in_features if isinstance(model, torch.nn.Linear) else model.table.in_features
        dtype = torch.bfloat16 if case == "bf16" else torch.float32
        xs = [rand((1, k), dtype), rand((4, k), dtype)]
        pte = tmp_path / f"{case}.pte"
        pte.write_bytes(lower(model, (xs[1],), dynamic_shapes=({0: torch.export.Dim("m", min=1, max=8)},))
                        .to_executorch().buffer)
        cases.append((str(pte), xs))
        with torch.no_grad():
            want.append([model(x) for x in xs])
    # the kernel as this process's environment sets it up (what a process of the same env runs)
    outs = [[]]
    for pte, xs in cases:
        program = Runtime.get().load_program(open(pte, "rb").read())  # kept alive while its method runs
        method = program.load_method("forward")
        outs[0].append([method.execute([x])[0] for x in xs])
    for env in [{"EMLX_NUM_THREADS": "1"}, {"EMLX_DISABLE_CPU_KERNELS": "1"}]:
        each = run_elsewhere([(pte, [[x] for x in xs]) for pte, xs in cases], env, tmp_path)
        outs.append([[y[0] for y in ys] for ys in each])
    for (case, kernel, one_thread, mlx_ops, expected), (_, xs), model in zip(zip(KERNEL_CASES, *outs, want), cases,
                                                                            models):
        for ys in (kernel, one_thread, mlx_ops):
            for y, w, x in zip(ys, expected, xs):
                if ys is not mlx_ops and case.startswith("q"):
                    assert_close_to_integer_rows(y, w, x, model.table, w.dtype)
                else:
                    torch.testing.assert_close(y, w, **TOL[w.dtype], msg=lambda m: f"{case}: {m}")
        assert all(torch.equal(a, b) for a, b in zip(kernel, one_thread)), f"{case}: threads changed the result"


# ------------------------------------------------------------ whole models --
@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from executorch_mlx.llm.model_folders import write_model_folder

    path = write_model_folder(tmp_path_factory.mktemp("qmodel") / "llama", "llama", hidden=128, intermediate=256)
    # Norm weights as a trained model has them, not the initial ones: with
    # ones, the first layer's input is the quantized embedding row scaled,
    # whose ratios of small integer codes put many values exactly halfway
    # between two of x's integer levels, where the last float bit decides.
    model = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.25 * torch.randn_like(p))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def logits_program(folder, tmp_path_factory):
    """(quantize, quantize_embedding) -> the folder exported logits-only at
    max context 32, group size 64 (mxfp4: 32); each built once."""
    from executorch_mlx.llm.export.hf_export import export_llm

    root, built = tmp_path_factory.mktemp("qprograms"), {}

    def get(mode: str | None, embedding: bool):
        if (mode, embedding) not in built:
            built[mode, embedding] = export_llm(folder, root / f"{mode}-{int(embedding)}.pte",
                                                ExportOptions(max_context=32, sampling=False, quantize=mode,
                                                              quantize_embedding=embedding),
                                                progress=None)
        return built[mode, embedding]

    return get


def assert_near_integer_reference(got: torch.Tensor, want: torch.Tensor):
    """x rounds to integers in every quantized layer: a discontinuous
    function, where float noise (another order of additions) may tip a value
    lying near half a level, and a tipped value (one step: 1/127 of its
    group's largest |x|) moves every later layer. The bound allows such
    tips: 1% of the logits' spread (measured here, none tipped: about 1e-6
    of it). A wrong kernel moves them by the whole spread."""
    diff, spread = (got - want).abs(), want.std()
    assert diff.max() <= 0.01 * spread, f"off by {diff.max():.3g} (spread {spread:.3g})"


@pytest.mark.parametrize("mode,embedding", [("int4", True), ("int8", False)])
def test_quantized_model_logits_equal_its_quantized_reference(folder, logits_program, mode, embedding, monkeypatch):
    """Our .pte's logits against the same model run eagerly, every quantized
    layer computed as our CPU kernel does (integer_linear, which the tests
    above hold to the kernel and to MLX), on a prefill and on the decode step
    after it."""
    from transformers import AutoModelForCausalLM

    pte = logits_program(mode, embedding)
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    # quantized as export quantizes it (bfloat16 scales: ExportOptions.scales_dtype)
    layers = quantize_model(model, ExportOptions(quantize=mode).quant_format, embedding=embedding)
    assert ("model.embed_tokens" in layers) == embedding
    # tied weights: the head follows the embedding (quantized with it, else full precision)
    assert isinstance(model.lm_head, torch.nn.Linear) != embedding
    monkeypatch.setattr(QuantizedTable, "linear", integer_linear)
    assert_program_near_quantized_model(pte, model)


@pytest.mark.parametrize("mode", ["int3", "mxfp4"])
def test_other_widths_model_logits_equal_the_reference(folder, logits_program, mode):
    """A whole model at 3 bits and in MXFP4 (MLX's quantized_matmul, x not
    rounded; every width per layer above):
    its logits are the same model's, quantized the same way, run eagerly
    (the ops' references dequantize exactly as mlx.core.dequantize)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    quantize_model(model, ExportOptions(quantize=mode).quant_format, embedding=False)
    ids = torch.tensor([[3, 17, 42, 5, 99] * 4])
    program = Runtime.get().load_program(logits_program(mode, False).read_bytes())
    with torch.no_grad():
        want = model(ids).logits[:, -1:]
    got = program.load_method("forward").execute([ids, torch.arange(ids.shape[1])])[0]
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


def assert_program_near_quantized_model(pte, model):
    """A logits program's last logits against `model` quantized (its linears
    computed by integer_linear, patched in by the caller), on a prefill and on
    the decode step after it."""
    ids = torch.tensor([[3, 17, 42, 5, 99] * 4])  # a prefill: 20 rows of x, in pairs
    program = Runtime.get().load_program(pte.read_bytes())  # alive while its method runs
    method = program.load_method("forward")
    with torch.no_grad():
        want = model(ids).logits[:, -1:]
    assert_near_integer_reference(method.execute([ids, torch.arange(ids.shape[1])])[0], want)
    # the next token on the cache the prefill wrote: one row of x
    with torch.no_grad():
        want = model(torch.cat([ids, ids[:, :1]], 1)).logits[:, -1:]
    assert_near_integer_reference(method.execute([ids[:, :1], torch.tensor([ids.shape[1]])])[0], want)


@pytest.mark.parametrize("mode", ["int4", None])
def test_fused_linear_layers_compute_the_same_values(mode, folder, logits_program, tmp_path, monkeypatch):
    """Three fusions of linear layers: q/k/v and gate/up (quantized, or
    float32) as one product each (llm/export/fused_projections.py), the residual stream
    added inside the layer's node (lowering/ops_elementwise.py; float32
    LinearNode: tests/test_ops.py), and the norm before them taken inside it
    (lowering/node_fusion.py). The logits of a prefill and of the decode
    step after it are bit for bit those of the program exported without them."""
    from executorch_mlx.inspector import delegate_graphs as pte_graphs
    from executorch_mlx.llm.export import hf_export
    from executorch_mlx.lowering import node_fusion, ops_elementwise

    fused = logits_program(mode, mode is not None)
    monkeypatch.setattr(hf_export, "fuse_shared_input_projections", lambda ep: 0)
    monkeypatch.setattr(ops_elementwise, "_with_residual", lambda b, node: None)
    without_fusion(monkeypatch, node_fusion._normed_input)
    plain = hf_export.export_llm(folder, tmp_path / "plain.pte",
                                 ExportOptions(max_context=32, sampling=False, quantize=mode,
                                               quantize_embedding=mode is not None),
                                 progress=None)

    def products(pte) -> tuple[int, int, int]:
        ops = [n.op for g in pte_graphs(pte.read_bytes()) for n in g.nodes]
        layers = [op for op in ops if type(op).__name__ in ("QuantizedLinearNode", "LinearNode")]
        return len(layers), sum(op.residual is not None for op in layers), sum(op.norm is not None for op in layers)

    layers = 2  # write_model_folder's default; the tied head is one product more (its norm's rows taken first)
    assert products(fused) == (4 * layers + 1, 2 * layers, 2 * layers)
    assert products(plain) == (7 * layers + 1, 0, 0)
    ids = torch.tensor([[3, 17, 42, 5, 99] * 4])
    calls = ([ids, torch.arange(ids.shape[1])], [ids[:, :1], torch.tensor([ids.shape[1]])])
    outputs = []
    for pte in (fused, plain):
        program = Runtime.get().load_program(pte.read_bytes())
        method = program.load_method("forward")
        outputs.append([method.execute(inputs)[0] for inputs in calls])
    for got, want in zip(*outputs):
        assert torch.equal(got, want)


def test_products_of_one_input_fuse_with_their_biases_stacked():
    """Three quantized layers with biases on one x (Qwen2's q/k/v): one
    product over the stacked weights, scales, biases and layer biases, then
    a slice each; the outputs are the three layers'."""
    from executorch.exir import to_edge_transform_and_lower

    from executorch_mlx import MLXPartitioner
    from executorch_mlx.llm.export.fused_projections import fuse_shared_input_projections
    from executorch_mlx.llm.export.quantize import QuantizedLinear

    class Three(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (QuantizedLinear(QuantizedTable(torch.randn(n, 64), QuantFormat(4, 64)),
                                                      torch.randn(n)) for n in (64, 32, 32))

        def forward(self, x):
            return self.q(x), self.k(x) * 2, self.v(x)

    module, x = Three().eval(), torch.randn(1, 3, 64)
    ep = torch.export.export(module, (x,))
    assert fuse_shared_input_projections(ep) == 2
    edge = to_edge_transform_and_lower(ep, partitioner=[MLXPartitioner("float")])
    ops = [type(n.op).__name__ for g in delegate_graphs(edge) for n in g.nodes]
    assert ops.count("QuantizedLinearNode") == 1, ops
    got = run(edge.to_executorch().buffer, [x])
    for g, w in zip(got, module(x)):
        torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


def test_quantized_pte_sizes(folder, logits_program):
    """Against the float32 weights' bytes (which a float32 .pte holds at
    least): the int4 file (embedding included) at most 20% (4 bits and a
    float32 scale and bias per 64 weights: 15.6%); the int8 file at most 55%
    of what it quantizes, plus the embedding it leaves in float32. Nothing is
    kept outside the delegate: the tied int4 table was once written twice.
    (The programs the test above exports.)"""
    from executorch.exir._serialize._program import deserialize_pte_binary
    from safetensors.torch import load_file

    weights = load_file(folder / "model.safetensors")
    fp32 = sum(t.numel() * 4 for t in weights.values())
    embedding = weights["model.embed_tokens.weight"].numel() * 4
    int4 = logits_program("int4", True).stat().st_size
    int8 = logits_program("int8", False).stat().st_size
    assert int4 <= 0.20 * fp32, (int4, fp32)
    assert int8 <= embedding + 0.55 * (fp32 - embedding), (int8, embedding, fp32)
    for mode, embedded in (("int4", True), ("int8", False)):
        program = deserialize_pte_binary(logits_program(mode, embedded).read_bytes()).program
        assert sum(len(b.storage) for b in program.constant_buffer) == 0, mode


# ------------------------------------------------------------------ errors --
def test_bad_bits_or_group_size(folder, tmp_path):
    from executorch_mlx.llm.export.hf_export import export_llm

    with pytest.raises(ValueError, match=r"quantize must be one of int2, int3, int4, int5, int6, int8, mxfp4, got 'int7'"):
        export_llm(folder, tmp_path / "x.pte", ExportOptions(quantize="int7"), progress=None)
    with pytest.raises(ValueError, match=r"group_size must be one of 32, 64, 128, got 16"):
        export_llm(folder, tmp_path / "x.pte", ExportOptions(quantize="int4", group_size=16), progress=None)
    with pytest.raises(ValueError, match=r"quantize_embedding needs quantize"):
        export_llm(folder, tmp_path / "x.pte", ExportOptions(quantize_embedding=True), progress=None)
    with pytest.raises(ValueError, match=r"bits must be one of \(2, 3, 4, 5, 6, 8\), got 7"):
        QuantFormat(7, 64)
    with pytest.raises(ValueError, match=r"mxfp4 is 4-bit in groups of 32, got 4 bits in groups of 64"):
        export_llm(folder, tmp_path / "x.pte", ExportOptions(quantize="mxfp4", group_size=64), progress=None)
    assert not (tmp_path / "x.pte").exists()


def test_the_embedding_is_quantized_by_default_when_it_can_be(folder):
    """Left to the default, the input embedding (and the head tied to it) is
    quantized; one we cannot quantize (here: max_norm) is kept with its head,
    where True refuses it and False keeps any."""
    from transformers import AutoModelForCausalLM

    fmt = QuantFormat(4, 64)
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert "model.embed_tokens" in quantize_model(model, fmt)
    assert isinstance(model.model.embed_tokens, QuantizedTable) and not isinstance(model.lm_head, torch.nn.Linear)
    for embedding in (None, False):
        model = AutoModelForCausalLM.from_pretrained(folder)
        if embedding is None:
            model.model.embed_tokens.max_norm = 1.0
        layers = quantize_model(model, fmt, embedding=embedding)
        assert "model.embed_tokens" not in layers and "lm_head" not in layers and "model.layers.0.mlp.up_proj" in layers
        assert type(model.model.embed_tokens) is torch.nn.Embedding and type(model.lm_head) is torch.nn.Linear
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.model.embed_tokens.max_norm = 1.0
    with pytest.raises(ValueError, match=r"layer model\.embed_tokens: cannot quantize an embedding with max_norm"):
        quantize_model(model, fmt, embedding=True)


def test_layer_not_divisible_by_group_size_is_named(tmp_path):
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.model_folders import write_model_folder

    folder = write_model_folder(tmp_path / "m", "llama", hidden=64, intermediate=96)
    with pytest.raises(ValueError, match=r"group size 64: the input width of model\.layers\.0\.mlp\.down_proj "
                                         r"\(input width 96\), model\.layers\.1\.mlp\.down_proj"):
        export_llm(folder, tmp_path / "x.pte", ExportOptions(quantize="int8", group_size=64), progress=None)


def test_cli_export_refuses_a_bad_group_size(folder, tmp_path, capfd):
    """(A quantized CLI export that works: the README's, tests/test_documented_commands.py.)"""
    bad = cli(capfd, "export", folder, "-o", tmp_path / "q.pte", "--quantize", "int4", "--group-size", "48")
    assert bad.returncode == 2 and "group_size must be one of 32, 64, 128, got 48" in bad.stderr
