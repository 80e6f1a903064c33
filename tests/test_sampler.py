"""The whole sampler (docs/sampling.md): filters, penalties, logit bias, logprobs,
through our runtime on both of its paths (the native CPU kernel and MLX ops)
and in the CPU reference, against an independent float64 oracle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from harness import run
from sampler_cases import (CALLS, CASES, EDGE_ROWS, HISTORY, LOGITS, ROWS, VOCAB, all_parameters_method, calls, draws,
                           edge_draws, greedy_draws, oracle, reference_tokens, shared_word_draws, write_programs)
from scipy.stats import chisquare

from executorch_mlx.llm.run.decode import SampledDecoder
from executorch_mlx.llm.sampler_inputs import sampling_inputs
from executorch_mlx.llm.export.sampling import SamplingHead, export_sampling_head

P_MIN = 1e-3


class Logits(torch.nn.Module):
    def forward(self, logits):
        return logits


def _check_distribution(tokens: torch.Tensor, params: dict) -> None:
    want = torch.tensor(oracle(LOGITS, history=HISTORY, margin=True, **{
        k: v for k, v in params.items() if k != "bias"}, bias=params.get("bias")), dtype=torch.float64)
    counts = torch.bincount(tokens.flatten(), minlength=VOCAB).double()
    assert counts.sum() == tokens.numel() and (tokens >= 0).all()
    # the tokens drawn are exactly those the rules keep
    assert set(torch.nonzero(counts).flatten().tolist()) == set(torch.nonzero(want).flatten().tolist())
    kept = want > 0
    p = chisquare(counts[kept].numpy(), (want[kept] * counts.sum()).numpy()).pvalue
    assert p > P_MIN, (params, counts.tolist(), (want * counts.sum()).tolist())


@pytest.fixture(scope="module")
def mlx_ops_draws(tmp_path_factory) -> dict:
    """Every case drawn with the native kernel off (the path Apple and CUDA GPUs run),
    on the programs the native path runs (exported here, once)."""
    folder = tmp_path_factory.mktemp("mlx_ops")
    out = folder / "draws.pt"
    write_programs(folder)
    env = {**os.environ, "EMLX_DISABLE_CPU_KERNELS": "1"}
    subprocess.run([sys.executable, str(Path(__file__).with_name("sampler_cases.py")), str(out), str(folder)],
                   check=True, env=env, cwd=Path(__file__).parent)
    return torch.load(out)


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("path", ["native", "mlx-ops", "reference"])
def test_filters_draw_the_exact_distribution(case, path, request):
    even, odd = CASES[case]
    if path == "native":
        tokens = draws(case)
    elif path == "mlx-ops":
        tokens = request.getfixturevalue("mlx_ops_draws")[case]
    else:  # the CPU reference op (unseeded: torch's generator), same parameters, all CALLS * ROWS rows in one call
        torch.manual_seed(0)
        params = [even if r % 2 == 0 else odd for r in range(ROWS)]
        tokens = reference_tokens(torch.tensor([LOGITS] * ROWS), params, times=CALLS).reshape(CALLS, ROWS)
    assert tokens.shape == (CALLS, ROWS)
    _check_distribution(tokens[:, 0::2], even)
    _check_distribution(tokens[:, 1::2], odd)


def test_both_paths_draw_from_the_same_random_words(mlx_ops_draws):
    """The native kernel derives a seeded row's words itself (threefry); MLX
    ops read them from RandomBitsNode. Same words, same token, but for
    uniforms within float rounding of a CDF step."""
    native, ops = shared_word_draws(), mlx_ops_draws["shared words"]
    agree = (native == ops).double().mean()
    assert agree >= 0.98, agree
    assert len(set(native.flatten().tolist())) > 50  # and the draws are spread


@pytest.mark.parametrize("path", ["native", "mlx-ops"])
def test_greedy_with_penalties_and_bias_equals_the_reference(path, request):
    logits, got, params = greedy_draws()
    if path == "mlx-ops":
        got = request.getfixturevalue("mlx_ops_draws")["greedy"]
    want = reference_tokens(logits, params)
    assert torch.equal(got, want)
    # and by hand: the penalized argmax (the oracle's step 1)
    from sampler_cases import penalized
    for r in range(0, ROWS, 97):
        x = penalized(logits[r].tolist(), HISTORY, **{k: v for k, v in params[r].items()
                                                     if k in ("repetition_penalty", "frequency_penalty",
                                                              "presence_penalty", "bias")})
        assert int(got[r]) == max(range(VOCAB), key=lambda i: (x[i], -i))


@pytest.mark.parametrize("path", ["native", "mlx-ops"])
def test_infinite_temperature_and_overflow_rows_draw_only_allowed_tokens(path, request):
    """Issue #6's two silent wrong results, on both device paths (the
    reference: test_sampling.py): masked tokens stay out at T = +inf, and an
    overflowing logits / T picks the largest logit. A token mask that leaves
    no finite token gives -1 (bits past the vocabulary allow nothing), and
    one that masks a +inf token leaves the draw to the allowed ones."""
    tokens = edge_draws() if path == "native" else request.getfixturevalue("mlx_ops_draws")["edge"]
    for kind, (_, _, allowed, *_) in enumerate(EDGE_ROWS):
        assert set(tokens[:, kind::len(EDGE_ROWS)].flatten().tolist()) == allowed, kind


def test_a_nan_logit_read_in_place_counts_as_minus_infinity_as_in_the_copy():
    """The native kernel copies a row only when penalties, a bias or a mask
    change a token (neutral penalties with a history, and bias slots that
    name no token, leave the row to be read in place); either way a NaN
    logit counts as -inf. Token 0 (the largest logit) is NaN: greedy rows
    take token 1 (the lowest index of the next largest), top-k 2 rows draw
    only tokens 1 and 2, with neutral penalties and with a repetition
    penalty that copies the row without changing the choice."""
    logits = torch.tensor(LOGITS).repeat(ROWS, 1)
    logits[:, 0] = float("nan")
    for penalty in (1.0, 1.01):
        params = [dict(temperature=0.0 if r % 2 else 1.0, top_k=2, repetition_penalty=penalty) for r in range(ROWS)]
        tokens = calls(all_parameters_method()[1], logits, params, lambda c: torch.arange(ROWS) + 5 * c, 4)
        assert set(tokens[:, 1::2].flatten().tolist()) == {1}, penalty
        assert set(tokens[:, ::2].flatten().tolist()) == {1, 2}, penalty


def test_logprobs_are_log_softmax_of_the_raw_logits_at_the_chosen_id():
    rows = 6
    prog = export_sampling_head(Logits(), (torch.zeros(rows, VOCAB),), per_row=True, top_k=True, logprobs=True,
                                repetition_penalty=True, history_size=3)
    logits = torch.randn(rows, VOCAB)
    logits[5] = float("-inf")
    dec = SampledDecoder(prog.buffer)
    history = torch.tensor([[0, 1, 2]] * rows)
    inputs = [logits, torch.tensor([0.0, 1.0, 0.5, 2.0, 1.0, 1.0]), torch.arange(rows), torch.zeros(rows, dtype=torch.int64),
              torch.tensor([0, 3, 1, 0, 2, 0]), torch.full((rows,), 1.5), history]
    ids, logprobs = run(prog.buffer, inputs)
    assert ids[5] == -1 and logprobs[5] == float("-inf")
    want = torch.log_softmax(logits[:5], dim=-1)[torch.arange(5), ids[:5]]
    torch.testing.assert_close(logprobs[:5], want)
    assert dec.logprobs
    # the reference head computes the same
    head_ids, head_lp = SamplingHead(Logits(), logprobs=True)(logits[:5], temperature=torch.tensor(0.0))
    torch.testing.assert_close(head_lp, torch.log_softmax(logits[:5], -1)[torch.arange(5), head_ids])


def test_same_seed_and_position_give_the_same_token_in_any_batch_with_filters_on():
    vocab, seed, position = 300, 2**63 + 12345, 41
    row_logits = torch.randn(vocab)
    params = dict(temperature=1.3, top_k=40, top_p=0.9, min_p=0.01, repetition_penalty=1.2, bias={3: 4.0})
    seen = set()
    for batch in (1, 3, 8):
        prog = export_sampling_head(Logits(), (torch.zeros(batch, vocab),), per_row=True, top_k=True, top_p=True,
                                    min_p=True, repetition_penalty=True, history_size=len(HISTORY),
                                    logit_bias_size=1)
        dec = SampledDecoder(prog.buffer)
        for row in range(batch):
            logits = torch.randn(batch, vocab)
            logits[row] = row_logits
            seeds = torch.randint(0, 2**62, (batch,))
            seeds[row] = seed - 2**64
            positions = torch.randint(0, 1000, (batch,))
            positions[row] = position
            top_k = torch.randint(1, 100, (batch,))
            top_k[row] = params["top_k"]
            ids = torch.full((batch, 1), 3)
            token = dec.step(logits, temperature=params["temperature"], seed=seeds, position=positions, top_k=top_k,
                             top_p=params["top_p"], min_p=params["min_p"],
                             repetition_penalty=params["repetition_penalty"],
                             history=torch.tensor([HISTORY] * batch), logit_bias_ids=ids,
                             logit_bias_values=torch.full((batch, 1), 4.0))[row]
            seen.add(int(token))
    assert len(seen) == 1, seen


def test_parameters_are_runtime_inputs_by_name():
    prog = export_sampling_head(Logits(), (torch.zeros(2, 50),), top_k=True, min_p=True)
    dec = SampledDecoder(prog.buffer)
    assert dec.input_names == ["temperature", "seed", "position", "top_k", "min_p"]
    logits = torch.randn(2, 50)
    # top_k = 1 is greedy whatever the temperature, with no re-export
    for s in range(20):
        assert torch.equal(dec.step(logits, temperature=5.0, seed=s, top_k=1), logits.argmax(1))
    assert len({tuple(dec.step(logits, temperature=5.0, seed=s).tolist()) for s in range(20)}) > 5
    with pytest.raises(ValueError, match="exported without top_p"):
        dec.step(logits, seed=1, top_p=0.5)


def test_large_vocabulary_paths_agree_with_the_oracle_support():
    """Native kernel paths for large V (heap top-k, nth_element top-k above
    1024, the nucleus candidate bound, block-sum draw): the drawn tokens stay
    inside the set the rules keep."""
    vocab, rows = 5000, 8
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(rows, vocab, generator=gen) * 2
    prog = export_sampling_head(Logits(), (torch.zeros(rows, vocab),), per_row=True, top_k=True, top_p=True,
                                min_p=True)
    dec = SampledDecoder(prog.buffer)
    settings = [dict(top_k=[50] * rows), dict(top_k=[2000] * rows), dict(top_p=[0.5] * rows),
                dict(top_k=[3000] * rows, top_p=[0.3] * rows), dict(min_p=[0.2] * rows), dict()]
    for setting in settings:
        kwargs = {k: torch.tensor(v, dtype=torch.int64 if k == "top_k" else torch.float32) for k, v in setting.items()}
        from executorch_mlx.custom_kernel_ops.sample import filtered_z
        z = filtered_z(logits, torch.tensor(1.0), **kwargs)
        for s in range(10):
            ids = dec.step(logits, temperature=1.0, seed=s, **kwargs)
            assert bool((z[torch.arange(rows), ids] > float("-inf")).all()), setting


@pytest.mark.parametrize("kwargs,error,name", [
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(min_p=1.0), ValueError, "min_p"),
    (dict(min_p=-0.1), ValueError, "min_p"),
    (dict(repetition_penalty=0.0), ValueError, "repetition_penalty"),
    (dict(repetition_penalty=-1.0), ValueError, "repetition_penalty"),
    (dict(frequency_penalty=float("nan")), ValueError, "frequency_penalty"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(history=torch.zeros(2, 4)), ValueError, "history"),
    (dict(history=torch.zeros(3, 4, dtype=torch.int64)), ValueError, "history"),
    (dict(history=torch.full((2, 4), 99, dtype=torch.int64)), ValueError, "history"),
    (dict(logit_bias_ids=torch.zeros(2, 2, dtype=torch.int64)), ValueError, "logit_bias_values"),
    (dict(logit_bias_ids=torch.zeros(2, 2, dtype=torch.int32), logit_bias_values=torch.zeros(2, 2)),
     ValueError, "logit_bias_ids"),
    (dict(logit_bias_ids=torch.zeros(2, 2, dtype=torch.int64), logit_bias_values=torch.zeros(2, 3)),
     ValueError, "logit_bias"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(top_k=[1, 2, 3]), ValueError, "top_k"),
    (dict(tok_k=3), TypeError, "tok_k"),
], ids=lambda v: str(v)[:40] if not isinstance(v, type) else v.__name__)
def test_bad_parameters_raise_naming_them(kwargs, error, name):
    with pytest.raises(error, match=name):
        sampling_inputs(2, **{"temperature": 1.0, **kwargs}, vocab=16)


def test_export_checks_its_parameters():
    with pytest.raises(ValueError, match="history_size"):
        export_sampling_head(Logits(), (torch.zeros(1, 8),), repetition_penalty=True)
    with pytest.raises(ValueError, match="history_size"):
        export_sampling_head(Logits(), (torch.zeros(1, 8),), history_size=4)
    with pytest.raises(ValueError, match="top_k must be int64"):
        torch.ops.mlx.sample(torch.zeros(1, 8), torch.tensor(1.0), top_k=torch.tensor(2.0))
    with pytest.raises(ValueError, match="need a history"):
        torch.ops.mlx.sample(torch.zeros(1, 8), torch.tensor(1.0), repetition_penalty=torch.tensor(1.2))
