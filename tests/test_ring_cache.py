"""Sliding-window layers on ring buffers (llm/export/ring_cache.py), on the family
programs of Gemma 3 (sdpa attention; window 8, one sliding and one full layer)
and gpt-oss (its own eager attention with sinks; one sliding layer), max
context 128: the ring's size, logits equal to transformers' far past the
window, rewinds within the limit and beyond it, and drafted generation equal
to plain."""

from __future__ import annotations

import pytest
import torch
from llm_programs import MAX_CONTEXT, family_program
from transformers import AutoModelForCausalLM

from executorch_mlx.inspector import delegate_graphs
from executorch_mlx.llm.run.runner import LLMRunner

WINDOW, CHUNK = 8, 16  # the family's sliding window; calls of a ring program take at most max(window, 16)
SLOTS = WINDOW - 1 + CHUNK


# the family's layers: sliding (on a ring) or full
LAYERS = {"gemma3": ["ring", "full"], "gpt_oss": ["ring"]}


@pytest.fixture(scope="module", params=list(LAYERS))
def logits_program(shared, request):
    folder, pte = family_program(shared, request.param, sampling=False)
    return folder, pte, AutoModelForCausalLM.from_pretrained(folder).eval(), LAYERS[request.param]


def _method(pte):
    from executorch.runtime import Runtime

    program = Runtime.get().load_program(pte.read_bytes())
    return program, program.load_method("forward")  # the program must outlive its method


def _cache_shapes(pte) -> list[list[int]]:
    (graph,) = delegate_graphs(pte.read_bytes())  # one delegate
    return sorted(b.shape for b in graph.mutable_buffers if len(b.shape) == 4)


def test_sliding_layers_cache_the_window_and_full_layers_the_context(logits_program):
    _, pte, _, layers = logits_program
    runner = LLMRunner(pte)
    assert (runner.max_chunk, runner.cache_wraps, runner.cache_rewind) == (CHUNK, True, CHUNK)
    # keys and values: [1, kv heads, slots, head dim], sliding layers first
    slots = sorted(SLOTS if kind == "ring" else MAX_CONTEXT for kind in layers)
    assert _cache_shapes(pte) == [[1, 2, n, 16] for n in slots for _ in "kv"]


def _check_steps(method, model, ids: torch.Tensor, calls: list[tuple[int, int]]):
    """Runs (start, length) calls and compares each call's last logits with
    transformers on the whole sequence so far (no cache)."""
    with torch.no_grad():
        want = model(ids).logits[0]
    for start, n in calls:
        got = method.execute([ids[:, start:start + n], torch.arange(start, start + n)])[0][0, -1]
        torch.testing.assert_close(got, want[start + n - 1], atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"call at {start} of {n} tokens: {m}")


def test_logits_equal_transformers_far_past_the_window(logits_program):
    """A prefill in two calls, then 50 single steps: the ring wraps twice
    over; transformers attends over the full sequence with its window mask."""
    _, pte, model, _ = logits_program
    _program, method = _method(pte)
    ids = torch.tensor([[(13 * i + 5) % 200 for i in range(70)]])
    _check_steps(method, model, ids, [(0, 16), (16, 4)] + [(p, 1) for p in range(20, 70)])


def test_a_rewind_within_the_limit_keeps_the_window(logits_program):
    """Positions 0..59 written, then the sequence changes from position 44
    on (a rewind of 16, the limit): its window is still in the ring."""
    _, pte, model, _ = logits_program
    _program, method = _method(pte)
    first = torch.tensor([[(13 * i + 5) % 200 for i in range(60)]])
    _check_steps(method, model, first, [(0, 16), (16, 16), (32, 16), (48, 12)])
    second = torch.cat([first[:, :60 - CHUNK], torch.tensor([[(7 * i + 1) % 200 for i in range(30)]])], dim=1)
    _check_steps(method, model, second, [(60 - CHUNK, 16), (60, 3)] + [(p, 1) for p in range(63, 74)])


def test_a_runner_prefills_again_past_the_rewind_limit(shared):
    """A conversation that changes an older turn: the runner does not reuse
    a cache whose window may be gone, and the tokens are a fresh runner's."""
    import executorch_mlx

    folder, pte = family_program(shared, "gemma3")
    runner = LLMRunner(pte, folder)
    first = [(11 * i + 2) % 200 for i in range(40)]
    runner.generate(first, max_new_tokens=8)
    near, far = first[:40 - 4] + [3, 4, 5], first[:10] + [3, 4, 5]
    kwargs = dict(max_new_tokens=20, temperature=1.0, seed=4)
    results = {}
    for name, prompt in (("near", near), ("far", far)):
        runner.generate(first, max_new_tokens=8)
        results[name] = runner.generate(prompt, **kwargs)
    assert results["near"].cached_tokens == 36 and results["far"].cached_tokens == 0
    executorch_mlx.reset_state()
    fresh = LLMRunner(pte, folder)
    for name, prompt in (("near", near), ("far", far)):
        assert results[name].token_ids == fresh.generate(prompt, **kwargs).token_ids


@pytest.mark.parametrize("kwargs", [dict(temperature=0.0), dict(temperature=1.0, top_p=0.95, seed=7)],
                         ids=["greedy", "sampled"])
def test_drafted_generation_equals_plain_past_the_window(shared, kwargs):
    """Rejected drafts are rewound (up to 15 positions, within the ring's
    limit): prompt lookup and an exact copy give plain decoding's tokens."""
    folder, pte = family_program(shared, "gemma3")
    target, copy = LLMRunner(pte, folder), LLMRunner(pte)
    prompt = [5, 9, 3, 7, 11, 5, 9, 3, 7, 11, 5, 9]
    plain = target.generate(prompt, max_new_tokens=40, **kwargs)
    for draft in ("prompt-lookup", copy):
        drafted = target.generate(prompt, max_new_tokens=40, draft=draft, **kwargs)
        assert drafted.token_ids == plain.token_ids, draft
        assert drafted.draft_tokens > 0
