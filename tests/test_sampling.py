"""SamplingHead + mlx::sample through our runtime, held to docs/sampling.md."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from harness import delegate_graphs, lower, run, undelegated_ops
from scipy.stats import chisquare

from executorch_mlx.inspector import delegate_graphs as pte_delegate_graphs
from executorch_mlx.inspector import describe_graph
from executorch_mlx.llm.run.decode import SampledDecoder
from executorch_mlx.llm.export.sampling import GreedyHead, SamplingHead, export_greedy_head, export_sampling_head
from executorch_mlx.serialization import ir

P_MIN = 1e-3  # chi-square p-value threshold (docs/sampling.md)


class Logits(torch.nn.Module):
    """A 'model' whose output is its input: lets tests feed logits directly."""

    def forward(self, logits):
        return logits


@functools.cache
def sampler_pte(batch: int, vocab: int, dtype=torch.float32, seeded=True, per_row=True) -> bytes:
    example = torch.zeros(batch, vocab, dtype=dtype)
    return export_sampling_head(Logits(), (example,), seeded=seeded, per_row=per_row).buffer


def sample(pte: bytes, logits, temperature, seed=None, position=None) -> torch.Tensor:
    rows = logits.shape[0]
    inputs = [logits, torch.as_tensor(temperature, dtype=torch.float32).expand(rows).contiguous()]
    if seed is not None:
        inputs += [torch.as_tensor(seed, dtype=torch.int64).expand(rows).contiguous(),
                   torch.as_tensor(position, dtype=torch.int64).expand(rows).contiguous()]
    return run(pte, inputs)[0]


def unique_max_logits(batch, vocab, dtype):
    x = torch.randn(batch, vocab)
    x[torch.arange(batch), x.argmax(1)] += 1.0  # a clear winner, even in bf16
    return x.to(dtype)


# ---------------------------------------------------------------- greedy --
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("temperature", [0.0, 1e-6])
def test_greedy_parity(dtype, batch, temperature):
    pte = sampler_pte(batch, 1000, dtype)
    for trial in range(3):
        logits = unique_max_logits(batch, 1000, dtype)
        got = sample(pte, logits, temperature, seed=trial, position=trial)
        assert torch.equal(got, torch.argmax(logits.float(), dim=-1))


def test_greedy_ties_go_to_the_lowest_index_and_nan_is_never_chosen():
    pte = sampler_pte(3, 6)
    nan = float("nan")
    logits = torch.tensor([[1.0, 5, 2, 5, 5, 0], [nan, 1, 3, 3, nan, 2], [0, 0, 0, 0, 0, 0]])
    assert sample(pte, logits, 0.0, seed=1, position=0).tolist() == [1, 2, 0]


def test_per_row_temperature_mixes_greedy_and_sampled_rows():
    pte = sampler_pte(4, 1000)
    logits = unique_max_logits(4, 1000, torch.float32)
    temperature = torch.tensor([0.0, 100.0, float("nan"), 100.0])  # NaN means greedy too
    argmax = torch.argmax(logits, dim=-1)
    hot_rows = set()
    for s in range(20):
        out = sample(pte, logits, temperature, torch.arange(4) + 10 * s, 0)
        assert out[0] == argmax[0] and out[2] == argmax[2]
        hot_rows.add((int(out[1]), int(out[3])))
    assert len(hot_rows) > 10


def test_greedy_head_needs_no_sampling_inputs():
    logits = unique_max_logits(4, 100, torch.float32)
    logits[0, 3] = float("nan")
    prog = export_greedy_head(Logits(), (logits,))
    assert run(prog.buffer, [logits])[0].tolist() == torch.argmax(torch.nan_to_num(logits, nan=-1e9), -1).tolist()


# ----------------------------------------------------- runtime temperature --
def test_temperature_is_a_runtime_input():
    vocab, seeds = 1000, 200
    pte = sampler_pte(seeds, vocab)  # one row per seed, one call per temperature
    logits = torch.randn(1, vocab).expand(seeds, vocab).contiguous()
    seed_ids = torch.arange(seeds)
    cold = sample(pte, logits, 1e-3, seed_ids, 0)
    hot = sample(pte, logits, 100.0, seed_ids, 0)
    assert (cold == logits[0].argmax()).float().mean() > 0.99
    assert len(set(hot.tolist())) > 50


# ----------------------------------------------------------- distribution --
V8_LOGITS = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0, -1.5, 1.2, 0.8])


def _chi_square_p(tokens: torch.Tensor, logits: torch.Tensor, temperature: float) -> float:
    probs = torch.softmax(logits.double() / temperature, dim=0)
    counts = torch.bincount(tokens, minlength=len(logits)).double()
    assert counts.sum() == len(tokens)
    return float(chisquare(counts.numpy(), (probs * len(tokens)).numpy()).pvalue)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_lowered_sampler_matches_softmax(temperature):
    rows, calls = 2000, 50  # 100k draws over 100k (seed, position) pairs
    pte = sampler_pte(rows, 8)
    logits = V8_LOGITS.expand(rows, 8).contiguous()
    draws = [sample(pte, logits, temperature, torch.arange(rows) + 7919 * c, c) for c in range(calls)]
    assert _chi_square_p(torch.cat(draws), V8_LOGITS, temperature) > P_MIN


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_reference_op_matches_softmax(temperature):
    draws = 100_000
    logits = V8_LOGITS.expand(draws, 8)
    tokens = torch.ops.mlx.sample(logits, torch.tensor(temperature), torch.arange(draws), torch.zeros(draws, dtype=torch.int64))
    assert _chi_square_p(tokens, V8_LOGITS, temperature) > P_MIN


# ---------------------------------------------------------- determinism --
def test_same_seed_and_position_give_the_same_token_in_any_batch():
    vocab, seed, position = 1000, 123456789012345, 17
    row_logits = torch.randn(vocab)
    seen = set()
    for batch in (1, 3, 8):
        pte = sampler_pte(batch, vocab)
        for row in range(batch):  # the target (seed, position) at every row index
            logits = torch.randn(batch, vocab)
            logits[row] = row_logits
            seeds = torch.randint(0, 2**62, (batch,))
            positions = torch.randint(0, 1000, (batch,))
            seeds[row], positions[row] = seed, position
            token = sample(pte, logits, 50.0, seeds, positions)[row]
            seen.add(int(token))
            assert int(sample(pte, logits, 50.0, seeds, positions)[row]) == int(token)  # across runs
    assert len(seen) == 1, seen


def test_different_positions_draw_differently():
    pte = sampler_pte(1, 1000)
    logits = torch.randn(1, 1000)
    tokens = {int(sample(pte, logits, 50.0, 5, p)[0]) for p in range(20)}
    assert len(tokens) > 10


def test_all_64_seed_bits_matter():
    pte = sampler_pte(1, 1000)
    logits = torch.randn(1, 1000)
    # seeds equal in their low 32 bits (and in their int32 truncation)
    tokens = {int(sample(pte, logits, 50.0, (k << 40) | 12345, 0)[0]) for k in range(20)}
    assert len(tokens) > 10


def test_seeded_stream_is_mlx_random_key_of_the_mixed_seed():
    """Row (S, t) draws two words of MLX's random::bits under
    random::key(stream_seed(S, t)), the 64-bit key kept whole: an inverse-CDF
    draw (docs/sampling.md) with the 53-bit uniform of those words, reconstructed
    with MLX's Python API, gives the very token the program returned."""
    import mlx.core as mx

    from executorch_mlx.custom_kernel_ops.sample import stream_seed

    vocab = 1000
    logits = torch.randn(1, vocab)
    pte = sampler_pte(1, vocab)
    cdf = torch.softmax(logits[0].double(), dim=0).cumsum(0)
    for seed, position in [(0, 0), (2**63 + 5, 3), (123456789012345, 17), ((1 << 40) | 12345, 2), (2**64 - 1, 999)]:
        as_int64 = seed - 2**64 if seed >= 2**63 else seed
        token = int(sample(pte, logits, 1.0, as_int64, position)[0])
        # random.split(key, 1) is random::bits({1, 2}) under that key
        hi, lo = mx.random.split(mx.random.key(stream_seed(seed, position)), 1).reshape(-1).tolist()
        u = ((hi << 21) | (lo >> 11)) * 2.0**-53
        expected = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True))
        assert token == expected, (seed, position)


# -------------------------------------------------------------- unseeded --
def test_unseeded_export_uses_the_global_key_sequence():
    prog = export_sampling_head(Logits(), (torch.zeros(4, 1000),), seeded=False)
    (graph,) = pte_delegate_graphs(prog.buffer)
    bits = [n.op for n in graph.nodes if isinstance(n.op, ir.RandomBitsNode)]
    assert len(bits) == 1 and bits[0].seed is None and bits[0].position is None
    assert "RandomBitsNode(shape=[4, 2], width=4)" in describe_graph(graph)
    logits = torch.randn(4, 1000)
    draws = [run(prog.buffer, [logits, torch.tensor(100.0)])[0] for _ in range(10)]
    tokens = torch.stack(draws)
    assert ((tokens >= 0) & (tokens < 1000)).all()
    # T=100 makes 1000 tokens nearly uniform: 40 draws repeat an id rarely
    # (expected distinct ids: 39.2); a key that did not advance between
    # calls, or rows sharing noise, would repeat whole rows of ids
    assert len(set(tokens.flatten().tolist())) >= 34
    assert len({tuple(t.tolist()) for t in draws}) == 10


# ------------------------------------------------------------ lowering --
def test_strict_export_lowers_the_whole_sampler_with_runtime_inputs():
    from executorch.exir import to_edge_transform_and_lower

    import executorch_mlx

    class TinyModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 50)

        def forward(self, x):
            return self.proj(x)  # [B, S, V]

    x = torch.randn(2, 3, 16)
    kwargs = {"temperature": torch.ones(2), "seed": torch.zeros(2, dtype=torch.int64),
              "position": torch.zeros(2, dtype=torch.int64)}
    ep = torch.export.export(SamplingHead(TinyModel()), (x,), kwargs, strict=True)
    assert [s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"][1:] == [
        "temperature", "seed", "position"]
    edge = to_edge_transform_and_lower(ep, partitioner=[executorch_mlx.MLXPartitioner()])
    assert undelegated_ops(edge) == []
    (graph,) = delegate_graphs(edge)
    assert len(graph.inputs) == 4  # x, temperature, seed, position: none baked in
    bits = [n.op for n in graph.nodes if isinstance(n.op, ir.RandomBitsNode)]
    assert len(bits) == 1 and bits[0].seed is not None and bits[0].position is not None
    out = run(edge.to_executorch().buffer, [x, *kwargs.values()])[0]
    assert out.shape == (2,) and out.dtype == torch.int64


# ---------------------------------------------------------- edge cases --
def _both_paths(logits, temperature, draws=300):
    """Tokens drawn by the lowered sampler and by the CPU reference."""
    pte = sampler_pte(*logits.shape)
    t = torch.full((logits.shape[0],), float(temperature))
    device = [sample(pte, logits, temperature, s, 3) for s in range(draws)]
    reference = [torch.ops.mlx.sample(logits, t, torch.full_like(t, s, dtype=torch.int64),
                                      torch.full_like(t, 3, dtype=torch.int64)) for s in range(draws)]
    return torch.stack(device), torch.stack(reference)


def test_infinite_temperature_never_revives_masked_tokens():
    """T = +inf makes the finite tokens uniform; -inf / inf is NaN, which an
    argmax would take: a masked (-inf) token must never be drawn."""
    inf = float("inf")
    logits = torch.tensor([[-inf, 0.0, 3.0, -inf, -1.0, -inf]])
    for drawn in _both_paths(logits, inf):
        assert set(drawn.flatten().tolist()) == {1, 2, 4}


@pytest.mark.parametrize("logits,temperature", [
    ([1.0, 3.0, 2.0, 3.0 - 1e-6, 0.0], 1e-45),       # logits / T overflows float32
    ([-3.0e38, 3.0e38, 2.9e38, 3.1e38, 1.0], 0.5),   # so does 3e38 / 0.5
], ids=["tiny-T", "huge-logits"])
def test_overflowing_logits_over_temperature_pick_the_largest_logit(logits, temperature):
    logits = torch.tensor([logits])
    want = int(logits.argmax())
    for drawn in _both_paths(logits, temperature, draws=50):
        assert set(drawn.flatten().tolist()) == {want}


def test_nan_inf_and_empty_rows():
    pte = sampler_pte(3, 5)
    inf, nan = float("inf"), float("nan")
    logits = torch.tensor([[nan, 0.0, nan, 0.0, nan], [0.0, inf, 5.0, inf, 0.0], [-inf, nan, -inf, -inf, nan]])
    seen = [set(), set()]
    for s in range(200):
        out = sample(pte, logits, 1.0, s, 0)
        seen[0].add(int(out[0]))
        seen[1].add(int(out[1]))
        assert out[2] == -1
    assert seen == [{1, 3}, {1, 3}]


def test_decoder_rejects_bad_parameters_and_reports_empty_rows():
    pte = sampler_pte(2, 8)
    dec = SampledDecoder(pte)
    logits = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="temperature"):
        dec.step(logits, temperature=-0.5, seed=1)
    with pytest.raises(ValueError, match="seed"):
        dec.step(logits, temperature=1.0)
    logits[1] = float("-inf")
    with pytest.raises(RuntimeError, match=r"rows \[1\]"):
        dec.step(logits, temperature=1.0, seed=1)


def test_reference_rejects_seed_without_position():
    with pytest.raises(ValueError, match="position"):
        torch.ops.mlx.sample(torch.zeros(1, 4), torch.tensor(1.0), torch.tensor(1), None)


def test_greedy_head_is_plain_argmax_in_eager_too():
    logits = torch.randn(3, 7, 11)
    assert torch.equal(GreedyHead(Logits())(logits), logits[:, -1].argmax(-1))


# ------------------------------------------------- host-side bad input --
def test_export_rejects_example_inputs_it_cannot_sample_from():
    with pytest.raises(ValueError, match=r"model_args\[0\] has batch size 0"):
        export_sampling_head(Logits(), (torch.zeros(0, 8),))
    with pytest.raises(ValueError, match="model_args must be a non-empty tuple"):
        export_sampling_head(Logits(), ())


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(seed=1.5), TypeError, "seed"),
    (dict(seed=2**64), ValueError, "seed"),
    (dict(seed=1, position=2**63), ValueError, "position"),
    (dict(seed=1, position=-1), ValueError, "position"),
    (dict(seed=torch.tensor([1.0, 2.0])), TypeError, "seed"),
    (dict(temperature=-0.5, seed=1), ValueError, "temperature"),
], ids=["float-seed", "seed-65-bits", "position-overflow", "negative-position", "float-seed-tensor", "temperature"])
def test_decoder_parameters_are_checked_before_running(kwargs, error, name):
    dec = SampledDecoder(sampler_pte(2, 8))
    with pytest.raises(error, match=name):
        dec.step(torch.zeros(2, 8), **kwargs)  # (this head samples from the logits it is given)


def test_decoder_checks_tokens_steps_and_the_program():
    class Tokens(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)

        def forward(self, tokens):
            return self.emb(tokens)

    dec = SampledDecoder(export_sampling_head(Tokens(), (torch.zeros(2, 3, dtype=torch.int64),)).buffer)
    for bad in (torch.zeros(2, 3, dtype=torch.int32), torch.zeros(2, 3)):
        with pytest.raises(TypeError, match="tokens must be a torch.int64 tensor"):
            dec.step(bad, seed=1)
    with pytest.raises(ValueError, match=r"tokens must be \[2, 3\], got \[3, 3\]"):
        dec.step(torch.zeros(3, 3, dtype=torch.int64), seed=1)
    for steps in (0, -2):
        with pytest.raises(ValueError, match="steps must be a positive int"):
            dec.generate(torch.zeros(2, 3, dtype=torch.int64), steps, seed=1)
    mlp = lower(torch.nn.Linear(4, 2), (torch.randn(3, 4),)).to_executorch().buffer
    with pytest.raises(ValueError, match="forward is not a sampling head: the program has no emlx_input_names"):
        SampledDecoder(mlp)


# ------------------------------------------------------ older programs --
DATA = Path(__file__).with_name("data")


def test_programs_exported_before_the_sample_node_still_run():
    """tests/data/*_v1_*.pte were exported by the previous lowering of
    mlx::sample (Gumbel-max over RandomBitsNode bits [B, V], no SampleNode, no
    metadata). They load and run unchanged: greedy rows are the argmax, and a
    seeded row's token is the Gumbel-max draw under MLX's own
    random::key(stream_seed(S, t)), reconstructed here with MLX's Python API."""
    import mlx.core as mx

    from executorch_mlx.custom_kernel_ops.sample import stream_seed

    sampler, greedy = (DATA / "sampler_v1_b4_v8.pte").read_bytes(), (DATA / "greedy_v1_b4_v8.pte").read_bytes()
    logits = torch.randn(4, 8)
    assert torch.equal(run(greedy, [logits])[0], logits.argmax(1))
    zeros = torch.zeros(4, dtype=torch.int64)
    assert torch.equal(run(sampler, [logits, torch.zeros(4), zeros, zeros])[0], logits.argmax(1))
    seeds, position = torch.tensor([3, 2**40 + 7, -5, 11]), 9
    tokens = run(sampler, [logits, torch.ones(4), seeds, torch.full((4,), position)])[0]
    for row in range(4):
        raw = mx.random.split(mx.random.key(stream_seed(int(seeds[row]), position)), 4).reshape(-1)
        u = (mx.right_shift(raw, mx.array(9, mx.uint32)).astype(mx.float32) + 0.5) * 2.0**-23
        assert int(tokens[row]) == mx.argmax(mx.array(logits[row].numpy()) - mx.log(-mx.log(u))).item()
