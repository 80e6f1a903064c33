"""float32 matrices packed at load (runtime/kernels/packed_floats.h): the
linear layers and tied embeddings that read them give bit for bit what the
stored floats give, for any number of rows and any weights, and the packed
matrices take fewer bytes. EMLX_PACKED_FLOAT32 (read at each load) turns the
packing on (1) or off (0) for the comparisons."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from harness import lower
from other_process import run_elsewhere

from executorch_mlx.loaded_program import LoadedProgram, active_memory

# one, two and four rows a pass; a verify call's 16; prefills, whose products
# decode 6, 8, 12 or 24 rows at a time by their chunks of 64 rows of x
ROWS = (1, 2, 3, 4, 5, 16, 17, 40, 64, 100, 130)


class TiedHead(torch.nn.Module):
    """An embedding whose table the output layer shares, and a linear layer
    with a bias: both packed (their K, 96, is a multiple of 32; 512 rows
    keep the awkward ones below, ~90 exceptions each matrix, under the 1 in
    256 weights that packing allows)."""

    def __init__(self, vocab: int = 512, dim: int = 96, out: int = 512):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.proj = torch.nn.Linear(dim, out)

    def forward(self, ids, x):
        h = self.embed(ids) + x
        return torch.nn.functional.linear(h, self.embed.weight), self.proj(h)


def awkward_weights(model: TiedHead) -> None:
    """Weights a block of 32 cannot code in 4-bit exponent offsets (zeros
    beside others, subnormals, 1e-30 beside 1), signed zeros, blocks of only
    zeros, infinities and NaN: every one an exception or an edge."""
    torch.manual_seed(0)
    w = model.proj.weight.data
    w[0, :32] = 0.0
    w[1, 5] = 0.0
    w[2, 7], w[2, 8] = 1e-30, 1.0
    w[3, 40], w[3, 41] = 1e-40, -1e-42  # subnormal
    w[4, 64:] = -0.0
    w[5, 3] = float("inf")
    w[6, 90] = float("nan")
    w[7] = torch.randn(96) * 1e-3
    w[8] = torch.randn(96) * 1e30
    t = model.embed.weight.data
    t[0, 10:20] = 0.0
    t[1, :] = torch.logspace(-38, 38, 96)


def program(tmp_path, model: torch.nn.Module, dim: int = 96) -> tuple:
    ids, x = torch.randint(0, 512, (130,)), torch.randn(130, dim)
    m = torch.export.Dim("m", min=1, max=130)
    pte = tmp_path / "packed.pte"
    pte.write_bytes(lower(model, (ids, x), dynamic_shapes=({0: m}, {0: m})).to_executorch().buffer)
    return pte, [[ids[:n], x[:n]] for n in ROWS]


def loaded(pte, monkeypatch, packed: str, alive: list) -> int:
    """Loads the program with packing on ("1") or off ("0"); the bytes its
    load took. The method is kept in `alive` (freed while another loads, it
    would count against that one)."""
    monkeypatch.setenv("EMLX_PACKED_FLOAT32", packed)
    before = active_memory()
    alive.append(LoadedProgram(pte).load_method("forward"))
    return active_memory() - before


def saved_bytes(*shapes, narrow: bool = False) -> int:
    """What packing [N, K] float32 matrices saves: 3616 of 4096 bytes a 1024
    weights (narrow, bfloat16 values: 1568)."""
    return sum(n * k * 4 - n * k // 32 * (49 if narrow else 113) for n, k in shapes)


def bfloat16_valued(model: TiedHead) -> None:
    """A bfloat16 checkpoint exported as float32 (every weight's low 16 bits
    zero: packed narrow), but for a few weights that are not (exceptions)."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
        model.proj.weight[9, :5] = torch.tensor([0.1, -0.3, 1e-3, 7.77, 1 / 3])
        model.embed.weight[11, 40] = 0.1


def awkward_model(seed: int, narrow: bool) -> TiedHead:
    """A TiedHead with awkward_weights, bfloat16-valued when `narrow`."""
    torch.manual_seed(seed)
    model = TiedHead().eval()
    awkward_weights(model)
    if narrow:
        bfloat16_valued(model)
    return model


def assert_same_bits(a: list, b: list) -> None:
    for ya, yb in zip(a, b):
        for p, q in zip(ya, yb):
            assert p.shape == q.shape and np.array_equal(p.view(np.int32), q.view(np.int32))


@pytest.mark.parametrize("narrow", [False, True])
def test_packed_matrices_give_bit_for_bit_what_their_floats_give(tmp_path, monkeypatch, narrow):
    model = awkward_model(1, narrow)
    pte, calls = program(tmp_path, model)
    methods = []
    held = {packed: loaded(pte, monkeypatch, packed, methods) for packed in ("0", "1")}
    # both packed (one alone saves half; each row's exceptions take 4 bytes and 8 each; narrow
    # saves more than a wide packing could)
    assert held["0"] - held["1"] >= 0.75 * saved_bytes((512, 96), (512, 96), narrow=narrow), held
    stored, packed = ([[np.array(y) for y in m.execute(inputs)] for inputs in calls] for m in methods)
    assert_same_bits(packed, stored)
    # (and the floats are what eager PyTorch computes with them, up to float order)
    eager = model(*calls[0])
    assert np.allclose(stored[0][1][:, 9:], eager[1].detach().numpy()[:, 9:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build,narrow", [("plain", False), ("avx2", False), ("avx2", True)])
def test_every_x86_build_packs_and_reads_them_the_same(tmp_path, build, narrow):
    """The plain and AVX2 builds pack, and decode a row before their dot
    products, with generic code; AVX-512 VBMI decodes in registers (the
    test above, on such a CPU)."""
    pte, calls = program(tmp_path, awkward_model(2, narrow))
    (stored,) = run_elsewhere([(pte, calls)], {"EMLX_X86_KERNELS": build, "EMLX_PACKED_FLOAT32": "0"}, tmp_path)
    (packed,) = run_elsewhere([(pte, calls)], {"EMLX_X86_KERNELS": build, "EMLX_PACKED_FLOAT32": "1"}, tmp_path)
    assert_same_bits([[y.numpy() for y in ys] for ys in packed], [[y.numpy() for y in ys] for ys in stored])


def test_a_packed_matrix_takes_about_an_eighth_fewer_bytes(tmp_path, monkeypatch):
    """[2048, 1024] float32 (8 MiB) packs into 2048 rows of 3616 bytes (7.06
    MiB): 28.25 bits a weight."""
    torch.manual_seed(3)
    model = torch.nn.Linear(1024, 2048, bias=False).eval()
    x = torch.randn(1, 1024)
    pte = tmp_path / "linear.pte"
    pte.write_bytes(lower(model, (x,)).to_executorch().buffer)
    methods = []
    held = {packed: loaded(pte, monkeypatch, packed, methods) for packed in ("0", "1")}
    assert held["0"] - held["1"] >= 0.9 * saved_bytes((2048, 1024)), held
    for method in methods:
        assert np.allclose(np.array(method.execute([x])[0]), model(x).detach().numpy(), rtol=1e-4, atol=1e-4)
