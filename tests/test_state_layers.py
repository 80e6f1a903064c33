"""State layers (llm/export/state_cache.py): the recurrences against their float64
references at every length a call may have (step and chunked forms), long
prompts equal to transformers, and the rings of snapshots that let drafted
generation, a runner that served another prompt and a second chat turn give
exactly what plain, fresh decoding gives."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from executorch_mlx.custom_kernel_ops import state  # noqa: F401  (defines the ops)
from executorch_mlx.llm.export.hf_export import export_llm
from executorch_mlx.llm.export.options import ExportOptions
from executorch_mlx.llm.model_folders import write_model_folder
from executorch_mlx.llm.run.runner import LLMRunner
from harness import lower, node_types, run
from llm_programs import HYBRIDS, MAX_CONTEXT, draft_program, family_program

SNAPSHOTS = 5
# A prompt that repeats itself: prompt lookup finds drafts in it.
PROMPT = [5, 9, 3, 7, 11, 5, 9, 3, 7, 11, 5, 9]


class Scans(torch.nn.Module):
    def forward(self, q, k, v, g, beta, s, x, dt, a, b, c, s2, x1, dt1, a1, b1, c1, s1, g_channels):
        return (torch.ops.mlx.gated_delta(q, k, v, g, beta, s, SNAPSHOTS),
                torch.ops.mlx.gated_delta(q, k, v, g_channels, beta, s, SNAPSHOTS),  # KDA's decay per key channel
                torch.ops.mlx.ssd_scan(x, dt, a, b, c, s2, SNAPSHOTS),
                torch.ops.mlx.selective_scan(x1, dt1, a1, b1, c1, s1, SNAPSHOTS))


def scan_inputs(length: int) -> tuple:
    gen = torch.Generator().manual_seed(length)
    rand = lambda *shape: torch.randn(*shape, generator=gen)  # noqa: E731
    q, k = (torch.nn.functional.normalize(rand(1, 2, length, 8), dim=-1) for _ in range(2))
    g = -torch.rand(1, 2, length, generator=gen)  # log decays in (-1, 0]
    beta = torch.rand(1, 2, length, generator=gen)
    dt, dt1 = (torch.rand(1, 3, length, generator=gen) * 0.5 for _ in range(2))
    return (q * 8 ** -0.5, k, rand(1, 2, length, 4), g, beta, rand(1, 2, 8, 4),
            rand(1, 3, length, 4), dt, -torch.rand(3, generator=gen), rand(1, 3, length, 6), rand(1, 3, length, 6),
            rand(1, 3, 4, 6),
            # Mamba-1: 3 channels, 5 states each, each its own decay rate
            rand(1, 3, length), dt1, -torch.rand(3, 5, generator=gen) * 2, rand(1, length, 5), rand(1, length, 5),
            rand(1, 3, 5),
            # a log decay per key channel, some channels forgetting fast (down to exp(-8) a step)
            -torch.rand(1, 2, length, 8, generator=gen) * torch.linspace(0.1, 8, 8))


def test_state_scans_equal_their_references_at_every_length():
    """One program, lengths from a decode step to three chunks and a part: the
    steps of the kept positions and the chunked form before them."""
    seq = torch.export.Dim("seq", min=1, max=256)
    dynamic = [{2: seq}, {2: seq}, {2: seq}, {2: seq}, {2: seq}, None, {2: seq}, {2: seq}, None, {2: seq}, {2: seq},
               None, {2: seq}, {2: seq}, None, {1: seq}, {1: seq}, None, {2: seq}]
    edge = lower(Scans(), scan_inputs(3), dynamic_shapes=dynamic)
    assert {"GatedDeltaNode", "SsdScanNode", "SelectiveScanNode"} <= node_types(edge)
    program = edge.to_executorch().buffer
    for length in (1, 4, SNAPSHOTS, SNAPSHOTS + 1, 64 + SNAPSHOTS, 200):
        args = scan_inputs(length)
        got = run(program, list(args))
        want = Scans()(*args)
        for g, w in zip(got, want):
            assert g.shape == w.shape
            torch.testing.assert_close(g, w, atol=2e-4, rtol=2e-4, msg=f"length {length}")


def test_a_call_keeps_the_states_of_its_last_positions_only():
    """min(L, snapshots) states: a short call's own (a decode step writes
    one state into the ring, not one per snapshot), the last `snapshots` of
    a long one; each the state a call ending at that position leaves."""
    args = scan_inputs(SNAPSHOTS + 3)
    q, k, v, g, beta, s = args[:6]
    for length in (2, SNAPSHOTS + 3):
        out = torch.ops.mlx.gated_delta(q[:, :, :length], k[:, :, :length], v[:, :, :length], g[:, :, :length],
                                        beta[:, :, :length], s, SNAPSHOTS)
        kept = min(length, SNAPSHOTS)
        assert out.shape == (1, 2, length + kept * 8, 4)
        for j in range(kept):
            end = length - kept + j + 1
            alone = torch.ops.mlx.gated_delta(q[:, :, :end], k[:, :, :end], v[:, :, :end], g[:, :, :end],
                                              beta[:, :, :end], s, 1)
            torch.testing.assert_close(out[:, :, length + 8 * j:length + 8 * (j + 1)], alone[:, :, end:])


@pytest.fixture(scope="module")
def hybrids(shared):
    return {family: family_program(shared, family) for family in HYBRIDS}


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_long_prompt_prefills_in_chunks_and_equals_transformers(hybrids, family):
    folder, pte = hybrids[family]
    runner = LLMRunner(pte, folder)
    ids = (runner.tokenizer.encode("The quick brown fox jumps over the lazy dog. ").ids * 20)[:100]
    model = AutoModelForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), do_sample=False, max_new_tokens=8)[0, len(ids):].tolist()
    assert runner.generate(ids, max_new_tokens=8).token_ids == want


@pytest.mark.parametrize("family", HYBRIDS)
@pytest.mark.parametrize("setting", [dict(temperature=0.0), dict(temperature=0.9, top_p=0.9, seed=3)])
def test_drafted_generation_equals_plain(hybrids, shared, family, setting):
    folder, pte = hybrids[family]
    target = LLMRunner(pte, folder)
    draft_model = LLMRunner(draft_program(shared)[1])
    plain = target.generate(PROMPT, max_new_tokens=24, **setting)
    for draft in ("prompt-lookup", draft_model):
        drafted = target.generate(PROMPT, max_new_tokens=24, draft=draft, **setting)
        assert drafted.token_ids == plain.token_ids, draft
    # (prompt lookup drafts only where the output repeats the context, which sampled text may never do;
    # the draft model always drafts) its drafts are mostly rejected: the rings gave back earlier states
    assert 0 <= drafted.accepted_tokens < drafted.draft_tokens


@pytest.mark.parametrize("family", HYBRIDS)
def test_a_runner_that_served_another_prompt_gives_a_fresh_runners_ids(hybrids, family):
    folder, pte = hybrids[family]
    used = LLMRunner(pte, folder)
    first = used.generate(PROMPT, max_new_tokens=4)
    # a prompt that leaves the cached context 3 positions before its end (within the rewind)...
    near = PROMPT + first.token_ids[:1] + [(first.token_ids[1] + 1) % 200]
    # ... and one that shares nothing
    for prompt in (near, [17, 4, 30, 8], near):
        got = used.generate(prompt, max_new_tokens=8)
        assert got.token_ids == LLMRunner(pte, folder).generate(prompt, max_new_tokens=8).token_ids
    assert got.cached_tokens == 0
    again = used.generate(near + got.token_ids[:3], max_new_tokens=8)
    assert again.cached_tokens > len(near)  # 4 positions back: a snapshot
    assert again.token_ids == LLMRunner(pte, folder).generate(near + got.token_ids[:3], max_new_tokens=8).token_ids


def test_a_second_chat_turn_reuses_the_first(shared):
    def build(root):
        folder = write_model_folder(root / "lfm2-chat", "lfm2", layers=2, chat=True)
        return folder, export_llm(folder, root / "lfm2-chat.pte", ExportOptions(max_context=MAX_CONTEXT), progress=None)

    folder, pte = shared.get("lfm2-chat", build)
    runner = LLMRunner(pte, folder)
    messages = [{"role": "user", "content": "Once upon a time"}]
    first = runner.chat(messages, max_new_tokens=6)
    messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "the fox"}]
    second = runner.chat(messages, max_new_tokens=6)
    assert second.cached_tokens > 0
    assert second.token_ids == LLMRunner(pte, folder).chat(messages, max_new_tokens=6).token_ids


def test_int4_hybrid_logits_equal_the_quantized_reference(hybrids, tmp_path, monkeypatch):
    """int4 weights on a hybrid (Qwen3.5: a convolution and the gated delta
    rule): the program's logits against transformers' own layer code with
    every linear quantized as our kernel computes it (tests/test_quantized.py's
    reference), on a prefill and on the decode step after it."""
    from test_quantized import assert_program_near_quantized_model, integer_linear

    from executorch_mlx.llm.export.quantize import QuantizedTable, quantize_model

    # Norm weights as a trained model has them: with the initial ones, the
    # first layer's x is a quantized embedding row scaled, whose values lie
    # exactly between two of x's integer levels, where the last float bit
    # decides (tests/test_quantized.py's folder does the same).
    model = AutoModelForCausalLM.from_pretrained(hybrids["qwen3_5_text"][0]).eval()
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.25 * torch.randn_like(p))
    folder = tmp_path / "qwen3_5_text"
    model.save_pretrained(folder)
    for extra in Path(hybrids["qwen3_5_text"][0]).iterdir():  # the tokenizer's files
        if not (folder / extra.name).exists():
            shutil.copy(extra, folder / extra.name)
    options = ExportOptions(max_context=64, sampling=False, quantize="int4", group_size=64)
    pte = export_llm(folder, tmp_path / "int4.pte", options, progress=None)
    quantize_model(model, options.quant_format)  # (as export quantizes: bfloat16 scales)
    monkeypatch.setattr(QuantizedTable, "linear", integer_linear)
    assert_program_near_quantized_model(pte, model)
