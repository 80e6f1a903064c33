"""Mixture-of-experts layers: the gather ops against their references (and
hostile indices), top-k, our experts forward against transformers' own in
six families, a family exported with int4 experts, and the refusal of
experts we do not route. The families' whole-program greedy tests are
test_llm.py's (qwen3_moe and gpt_oss are in FAMILIES)."""

from __future__ import annotations

import copy

import pytest
import torch
from harness import assert_matches_eager, lower, node_types, run
from test_llm import non_delegated_ops
from test_ops import Fn, check, rand
from test_quantized import integer_rows

from executorch_mlx.custom_kernel_ops import experts  # noqa: F401  (defines the ops)
from executorch_mlx.llm.export.experts import check_experts_routed, route_experts
from executorch_mlx.custom_kernel_ops.quantized import QuantFormat
from executorch_mlx.llm.export.quantize import QuantizedExperts, QuantizedTable, quantize_model

E, N, K, T, TOP = 5, 20, 64, 7, 2  # N: a tile of the tiled layout and 4 rows (kernels/quantized_dot.h)


def _indices(t: int = T) -> torch.Tensor:
    return torch.stack([torch.randperm(E)[:TOP] for _ in range(t)])


@pytest.mark.parametrize("per_expert_x", [False, True], ids=["x-shared", "x-per-expert"])
@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
def test_gather_linear(per_expert_x, bias):
    x = rand((T, TOP, K) if per_expert_x else (T, K))
    w, b = rand((E, N, K)), (rand((E, N)) if bias else None)
    fn = lambda x, i: torch.ops.mlx.gather_linear(x, w, i, b)  # noqa: E731
    check(fn, x, _indices(), nodes={"GatherLinearNode"})
    # against plain per-row math: row t's expert j is w[i[t, j]]
    i = _indices()
    got = fn(x, i)
    rows = x if per_expert_x else x.unsqueeze(1).expand(-1, TOP, -1)
    for t in range(T):
        for j in range(TOP):
            want = w[i[t, j]] @ rows[t, j] + (b[i[t, j]] if bias else 0)
            torch.testing.assert_close(got[t, j], want)


def test_gather_quantized_linear_mxfp4():
    """Microscaling experts run on MLX's gather_qmm: they equal the reference."""
    table = QuantizedExperts(rand((E, N, K)), QuantFormat(4, 32, "mxfp4"))
    b = rand((E, N))
    check(lambda x, i: table(x, i, b), rand((T, K)), _indices(), nodes={"GatherQuantizedLinearNode"})
    check(lambda x, i: table(x, i, None), rand((T, TOP, K)), _indices(), nodes={"GatherQuantizedLinearNode"})


def _experts_and_dense(kind):
    """(the experts layer, one dense layer of every expert's rows, its node)."""
    w, b = rand((E, N, K)), rand((E, N))
    if kind in ("fp32", "bf16"):
        w, b = (w, b) if kind == "fp32" else (w.bfloat16(), b.bfloat16())
        return (lambda x, i: torch.ops.mlx.gather_linear(x, w, i, b),
                lambda r: torch.nn.functional.linear(r, w.reshape(E * N, K), b.reshape(-1)), "GatherLinearNode")
    bits, bf16_params = (4, True) if kind == "int4-bf16-scales" else (kind, False)
    table = QuantizedExperts(w, QuantFormat(bits, 32, bf16_params=bf16_params))
    every = QuantizedTable(None, table.fmt, tables=tuple(t.reshape(E * N, -1)
                                                         for t in (table.qweight, table.scales, table.biases)))
    return lambda x, i: table(x, i, b), lambda r: every.linear(r, b.reshape(-1)), "GatherQuantizedLinearNode"


@pytest.mark.parametrize("kind,activations", [("fp32", "int8"), ("bf16", "int8"), (4, "int8"), (8, "int8"),
                                              (4, "float"), (8, "float"), ("int4-bf16-scales", "int8"),
                                              ("int4-bf16-scales", "float")],
                         ids=["fp32", "bf16", "int4", "int8", "int4-float-x", "int8-float-x", "int4-bf16-scales",
                              "int4-bf16-scales-float-x"])
@pytest.mark.parametrize("per_expert_x", [False, True], ids=["x-shared", "x-per-expert"])
def test_experts_kernel_is_the_dense_kernel_per_pair(kind, activations, per_expert_x):
    """Float (float32, bfloat16) and affine 4/8-bit experts (x rounded to
    8 bits or, with activations="float", not; float32 or bfloat16 scales
    under float32 x) run on our CPU kernels, which group
    a call's rows by expert: each (row, expert) pair is bit for bit what the
    dense kernel computes for that row against that expert's rows, and a
    row of a many-row call is bit for bit the one-row call of that row."""
    fn, dense_fn, node = _experts_and_dense(kind)
    x = rand((T, TOP, K) if per_expert_x else (T, K), torch.bfloat16 if kind == "bf16" else torch.float32)
    i = torch.tensor([[t % E, (t + 2) % E] for t in range(T)])  # experts chosen by several rows
    edge = lower(Fn(fn), (x, i), activations=activations)
    assert node in node_types(edge)
    got = run(edge.to_executorch().buffer, [x, i])[0]
    if kind in ("fp32", "bf16"):
        torch.testing.assert_close(got, fn(x, i), **(dict(atol=0.1, rtol=0.02) if kind == "bf16" else {}))
    elif activations == "float":
        torch.testing.assert_close(got, fn(x, i), atol=1e-5, rtol=1e-4)
    else:  # x rounded as the integer kernel rounds it
        torch.testing.assert_close(got, fn(integer_rows(x, 32), i), atol=1e-5, rtol=1e-4)
    rows = x.reshape(-1, K)
    dense = lower(Fn(dense_fn), (rows,), activations=activations).to_executorch().buffer
    want = run(dense, [rows])[0].reshape(len(rows), E, N)
    for t in range(T):
        for j in range(TOP):
            assert torch.equal(got[t, j], want[t * TOP + j if per_expert_x else t, i[t, j]])
    one_row = lower(Fn(fn), (x[:1], i[:1]), activations=activations).to_executorch().buffer
    for t in range(T):
        assert torch.equal(run(one_row, [x[t:t + 1], i[t:t + 1]])[0][0], got[t])


@pytest.mark.parametrize("kind", ["fp32", 4])
def test_experts_read_the_routers_top_k_ids_without_a_cast(kind):
    """top-k's ids (int32 in the graph, int64 in torch) reach the experts node
    uncast (lowering/node_fusion.py); the rows are those of the same ids given."""
    fn, _, _ = _experts_and_dense(kind)
    routed = lambda x, scores: fn(x, torch.topk(scores, TOP).indices)  # noqa: E731
    x, scores = rand((T, K)), torch.randn(T, E)
    edge = lower(Fn(routed), (x, scores))
    assert "AsTypeNode" not in node_types(edge), node_types(edge)
    got = run(edge.to_executorch().buffer, [x, scores])[0]
    given = lower(Fn(fn), (x, _indices(T))).to_executorch().buffer
    assert torch.equal(got, run(given, [x, torch.topk(scores, TOP).indices])[0])


@pytest.mark.parametrize("kind", ["fp32", 4, 8])
@pytest.mark.parametrize("rows", [1, T])
def test_experts_combined_by_their_weights_are_one_node(kind, rows):
    """An MoE layer's output, its experts' rows times their weights summed
    over the experts, is the experts node with `weights`
    (lowering/node_fusion.py): bit for bit the multiply and the sum, which a
    program that also returns the rows keeps."""
    fn, _, node = _experts_and_dense(kind)
    combined = lambda x, i, w: (fn(x, i) * w[..., None]).sum(1)  # noqa: E731
    both = lambda x, i, w: ((fn(x, i) * w[..., None]).sum(1), fn(x, i))  # noqa: E731
    x, i, w = rand((rows, K)), _indices(rows), torch.rand(rows, TOP)
    edge = lower(Fn(combined), (x, i, w))
    assert not {"MultiplyNode", "SumNode", "ExpandDimsNode"} & node_types(edge), node_types(edge)
    got = run(edge.to_executorch().buffer, [x, i, w])[0]
    unfused = lower(Fn(both), (x, i, w))
    assert {"MultiplyNode", "SumNode"} <= node_types(unfused)
    assert torch.equal(got, run(unfused.to_executorch().buffer, [x, i, w])[0])
    reference_x = x if kind == "fp32" else integer_rows(x, 32)  # (x rounded as the integer kernel rounds it)
    torch.testing.assert_close(got, combined(reference_x, i, w), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_nan_in_x_reaches_only_its_rows(bits):
    """x with a NaN or an infinity leaves the integer path for float
    products, which propagate them as the float reference does (NaN rows,
    infinite ones) and leave the other rows finite."""
    fn, _, _ = _experts_and_dense(bits)
    x = rand((T, K))
    x[1, 3], x[4, 0] = float("nan"), float("inf")
    i = _indices()
    got = run(lower(Fn(fn), (x, i)).to_executorch().buffer, [x, i])[0]
    assert got[1].isnan().all() and not got[4].isfinite().any()
    torch.testing.assert_close(got, fn(x, i), atol=1e-5, rtol=1e-4, equal_nan=True)


def test_expert_ids_out_of_range_are_clamped():
    """A program's indices are untrusted input: MLX's gather kernels do not
    check them, so the runtime clamps them into [0, E) before any read."""
    w = rand((E, N, K))
    fn = lambda x, i: torch.ops.mlx.gather_linear(x, w, i, None)  # noqa: E731
    x = rand((3, K))
    edge = lower(Fn(fn), (x, _indices(3)))
    hostile = torch.tensor([[E, -1], [1 << 30, -(1 << 30)], [E - 1, 0]])
    got = run(edge.to_executorch().buffer, [x, hostile])[0]
    torch.testing.assert_close(got, fn(x, hostile.clamp(0, E - 1)))


@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("dim", [-1, 0])
def test_topk(largest, dim):
    check(lambda x: tuple(torch.topk(x, 3, dim=dim, largest=largest)), rand((6, 9)),
          nodes={"ArgTopKNode", "TakeAlongAxisNode"})


def test_topk_keeps_equal_values_in_index_order():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 2.0], [5.0, 5.0, 5.0, 5.0, 5.0, 5.0]])
    edge = lower(Fn(lambda x: tuple(torch.topk(x, 4))), (x,))
    values, indices = run(edge.to_executorch().buffer, [x])
    assert indices.tolist() == [[1, 2, 4, 5], [0, 1, 2, 3]]
    assert values.tolist() == [[3.0, 3.0, 3.0, 2.0], [5.0] * 4]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("k", [1, 20, 64, 65])
def test_topk_of_long_rows_is_a_stable_sorts_first_k(dtype, k):
    """Rows of 5000 values with many ties (our one-pass kernel up to k = 64,
    MLX's argsort beyond): a stable descending sort's first k, equal values
    in index order; a NaN ranks as -inf."""
    x = (torch.randint(0, 50, (3, 5000)).float() / 7).to(dtype)
    x[2, ::3] = float("-inf")
    x[2, 5::7] = float("nan")
    edge = lower(Fn(lambda x: tuple(torch.topk(x, k))), (x,))
    values, indices = run(edge.to_executorch().buffer, [x])
    want = torch.sort(torch.nan_to_num(x.float(), nan=float("-inf")), descending=True, stable=True)
    assert torch.equal(indices, want.indices[:, :k])
    assert torch.equal(values.float().nan_to_num(nan=float("-inf")), want.values[:, :k])


def test_max_and_min_along_a_dim():
    x = rand((4, 9))
    check(lambda x: tuple(torch.max(x, dim=1)), x, nodes={"MaxNode", "ArgmaxNode"})
    check(lambda x: tuple(torch.min(x, dim=0, keepdim=True)), x, nodes={"MinNode", "ArgminNode"})
    # only the values read (attention sinks' max): no arg-reduction computed
    assert_matches_eager(Fn(lambda x: torch.max(x, dim=-1, keepdim=True).values + 1), (x,), expect_nodes={"MaxNode"})
    assert "ArgmaxNode" not in node_types(lower(Fn(lambda x: torch.max(x, dim=-1).values), (x,)))


def _tiny(family: str):
    import transformers as tf

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, initializer_range=0.2)
    return {
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32),
        "qwen2_moe": lambda: tf.Qwen2MoeConfig(**common, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32, shared_expert_intermediate_size=32),
        "mixtral": lambda: tf.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        "granitemoe": lambda: tf.GraniteMoeConfig(**common, num_local_experts=4, num_experts_per_tok=2),
        "gpt_oss": lambda: tf.GptOssConfig(**common, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                           max_position_embeddings=131072),
        "olmoe": lambda: tf.OlmoeConfig(**common, num_experts=4, num_experts_per_tok=2),
    }[family]()


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "granitemoe", "gpt_oss", "olmoe"])
def test_routed_experts_compute_what_transformers_computes(family):
    """Our experts forward (every row through its k experts at once) against
    transformers' loop over the experts hit, in eager PyTorch: the router,
    gating and shared experts stay the family's own code."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(_tiny(family)).eval()
    ids = torch.randint(0, 96, (1, 11))
    routed = copy.deepcopy(model)
    assert route_experts(routed) == ["model.layers.0." + ("block_sparse_moe" if family == "granitemoe" else "mlp")
                                     + ".experts"]
    with torch.no_grad():
        torch.testing.assert_close(routed(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_int4_experts_export_whole_and_match_the_quantized_model(shared, tmp_path):
    """Qwen3-MoE with int4 experts (and linear layers): one delegate, and the
    greedy ids of the quantized model run eagerly (our ops' references)."""
    from transformers import AutoModelForCausalLM

    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions
    from executorch_mlx.llm.model_folders import write_model_folder
    from executorch_mlx.llm.run.runner import LLMRunner

    folder = shared.get("qwen3_moe", lambda r: write_model_folder(r / "qwen3_moe", "qwen3_moe", layers=1))
    # float activations: the reference model computes in floats (int8 ones
    # would tip its near-ties; the kernels' integer rows are tested above)
    options = ExportOptions(max_context=64, quantize="int4", group_size=32, activations="float")
    pte = export_llm(folder, tmp_path / "int4.pte", options, progress=None)
    assert non_delegated_ops(pte.read_bytes()) == []
    runner = LLMRunner(pte, folder)
    ids = runner.tokenizer.encode("Once upon a time").ids
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    quantized = quantize_model(model, options.quant_format)  # (as export quantizes: bfloat16 scales)
    assert "model.layers.0.mlp.experts.down_proj" in quantized
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=12)[0, len(ids):].tolist()
    assert runner.generate(ids, max_new_tokens=12).token_ids == want


def test_experts_we_do_not_route_are_refused_by_name():
    class DbrxExperts(torch.nn.Module):  # a layout of its own, run in a loop
        pass

    model = torch.nn.Module()
    model.experts = DbrxExperts()
    with pytest.raises(NotImplementedError, match=r"DbrxExperts \(experts\) runs its experts in a loop"):
        check_experts_routed(model, [])
    check_experts_routed(model, ["experts"])
    check_experts_routed(torch.nn.Linear(2, 2), [])
