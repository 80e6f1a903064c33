"""Speculative decoding: drafts verified inside the program give exactly the
tokens (and logprobs) of plain decoding, greedy or sampled, whatever drafts
them (docs/sampling.md, "Speculative verification")."""

from __future__ import annotations

import json

import pytest
import numpy as np

from executorch_mlx.cli import main as cli_main
from executorch_mlx.llm.run.drafting import DraftLength, PromptLookup
from executorch_mlx.llm.run.decode_parts import history_rows
from executorch_mlx.llm.run.runner import LLMRunner
from llm_programs import MAX_CONTEXT, chat_program, draft_program, family_program

# A prompt that repeats itself: prompt lookup finds drafts in it.
PROMPT = [5, 9, 3, 7, 11, 5, 9, 3, 7, 11, 5, 9]
SETTINGS = {
    "greedy": dict(temperature=0.0),
    "top-p": dict(temperature=0.8, top_p=0.9, seed=3),
    "min-p+repetition": dict(temperature=1.0, min_p=0.05, repetition_penalty=1.3, seed=5),
    "logit-bias": dict(temperature=0.7, seed=1, logit_bias={5: 3.0, 9: 2.0, 3: 1.5}),
    "frequency+presence": dict(temperature=1.0, frequency_penalty=0.5, presence_penalty=0.3, seed=9,
                               repetition_context_size=8),
}


@pytest.fixture(scope="module")
def programs(shared):
    folder, pte = family_program(shared, "llama")  # with logprobs
    draft_folder, draft_pte = draft_program(shared)
    target = LLMRunner(pte, folder)
    return target, LLMRunner(draft_pte), LLMRunner(pte)


@pytest.mark.parametrize("setting", SETTINGS)
def test_drafted_generation_equals_plain(programs, setting):
    target, draft_model, copy = programs
    kwargs = SETTINGS[setting]
    plain = target.generate(PROMPT, max_new_tokens=24, **kwargs)
    assert plain.draft_tokens == 0 and plain.logprobs is not None
    for draft, extra in (("prompt-lookup", {}), (draft_model, {}), (copy, {}),
                         (draft_model, dict(num_draft_tokens=3, adaptive_drafting=False))):
        drafted = target.generate(PROMPT, max_new_tokens=24, draft=draft, **extra, **kwargs)
        assert drafted.token_ids == plain.token_ids, (draft, extra)
        assert drafted.logprobs == plain.logprobs  # a verify call's rows are bit for bit decode steps
        assert drafted.draft_tokens > 0 and 0 <= drafted.accepted_tokens <= drafted.draft_tokens
        if draft is copy:  # the target's own program drafts the target's tokens
            assert drafted.accepted_tokens == drafted.draft_tokens


def test_an_exact_copy_accepts_every_draft_in_few_calls(programs):
    target, _, copy = programs
    plain = target.generate(PROMPT, max_new_tokens=33, temperature=0.9, seed=11)
    drafted = target.generate(PROMPT, max_new_tokens=33, temperature=0.9, seed=11, draft=copy,
                              num_draft_tokens=8, adaptive_drafting=False)
    assert drafted.token_ids == plain.token_ids
    # after the prefill's token, 32 more: 4 calls of 8 drafts + 1
    assert (drafted.draft_tokens, drafted.accepted_tokens, len(drafted.step_seconds)) == (28, 28, 4)


def test_one_verify_call(programs):
    """The program's contract: drafts fed last, a history row per sampled
    row; out come the accepted drafts and the next token, -1 after."""
    target, _, _ = programs
    plain = target.generate(PROMPT, max_new_tokens=6, temperature=0.8, seed=2).token_ids
    target.generate(PROMPT, max_new_tokens=1, temperature=0.8, seed=2)  # the cache holds the prompt
    sampler = lambda drafts: target.sampler_values(target.input_names[2:], {  # noqa: E731
        "temperature": np.array(0.8, dtype=np.float32), "seed": np.array(2), "position": np.array(1),
        "history": history_rows(PROMPT + plain[:1], drafts, 0)})
    wrong = (plain[3] + 1) % target.vocab_size
    drafts = plain[1:3] + [wrong, plain[4]]
    emitted, _ = target._step(plain[:1] + drafts, len(PROMPT), sampler(drafts))
    assert emitted == plain[1:4]  # two drafts accepted, then the token plain decoding samples instead of `wrong`
    out = target.execute([np.array([plain[:1] + drafts]), np.arange(len(PROMPT), len(PROMPT) + 5)] + sampler(drafts))
    assert out[0].tolist() == plain[1:4] + [-1, -1]
    assert np.isinf(out[1][3:]).all() and np.isfinite(out[1][:3]).all()


def test_a_draft_model_prefills_the_prompt_with_the_target(programs):
    """Its first round then runs one token, not the whole prompt (the
    prompt's cost belongs to the prefill, as with mlx-lm)."""
    target, draft_model, _ = programs
    prompt = [4, 8, 15, 16, 23, 42, 4, 8]
    target.generate(prompt, max_new_tokens=2, draft=draft_model)  # no round: the second token is the last
    assert draft_model._cached == prompt


def test_drafts_never_overflow_the_context(programs):
    target, _, copy = programs
    prompt = (PROMPT * 10)[:MAX_CONTEXT - 20]
    plain = target.generate(prompt, max_new_tokens=20, temperature=0.5, seed=4)
    drafted = target.generate(prompt, max_new_tokens=20, temperature=0.5, seed=4, draft=copy, adaptive_drafting=False)
    assert drafted.token_ids == plain.token_ids and len(drafted.token_ids) == 20


def test_a_draft_model_of_another_tokenizer_is_refused(programs, shared):
    target, _, _ = programs
    _, chat_pte = chat_program(shared, 256)
    with pytest.raises(ValueError, match=r"draft model's vocabulary size \(\d+\) is not the target's \(\d+\)"):
        target.generate(PROMPT, max_new_tokens=4, draft=LLMRunner(chat_pte))


def test_draft_options_are_checked(programs, shared):
    target, _, _ = programs
    with pytest.raises(ValueError, match="num_draft_tokens needs a draft"):
        target.generate(PROMPT, num_draft_tokens=2)
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in \[1, 8\]"):
        target.generate(PROMPT, draft="prompt-lookup", num_draft_tokens=9)
    with pytest.raises(ValueError, match="draft must be 'prompt-lookup'"):
        target.generate(PROMPT, draft="ngram")
    with pytest.raises(ValueError, match="another LLMRunner"):
        target.generate(PROMPT, draft=target)
    with pytest.raises(NotImplementedError, match="structured output"):
        target.generate(PROMPT, draft="prompt-lookup", regex="[ab]+")
    folder, logits_pte = family_program(shared, "llama", sampling=False)
    with pytest.raises(ValueError, match="verifies no drafts"):
        LLMRunner(logits_pte).generate(PROMPT, draft="prompt-lookup")
    folder, wrapping = family_program(shared, "gemma3")  # a sliding window of 8 in a context of 128
    old = LLMRunner(wrapping)
    old.cache_rewind = 0  # as a ring program exported before emlx_cache_rewind reads
    with pytest.raises(NotImplementedError, match="sliding-window cache that wraps"):
        old.generate(PROMPT, draft="prompt-lookup")


def test_export_checks_the_draft_count(shared, tmp_path):
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions

    folder, _ = family_program(shared, "llama")
    for bad in (16, -1, True):  # refused before any work
        with pytest.raises(ValueError, match=r"max_draft_tokens must be in \[0, 15\]"):
            export_llm(folder, tmp_path / "x.pte", ExportOptions(max_draft_tokens=bad), progress=None)
    with pytest.raises(ValueError, match=r"max_draft_tokens must be in \[0, 2\]"):
        export_llm(folder, tmp_path / "x.pte", ExportOptions(max_context=4, max_draft_tokens=3), progress=None)
    assert not (tmp_path / "x.pte").exists()


def test_prompt_lookup_drafts_the_latest_continuation():
    lookup = PromptLookup(max_ngram=2)
    # (it searches bytes: 256, 0 holds the bytes of a 1 across the two tokens, which is no 1)
    assert lookup.propose([256, 0, 7, 1], 2, 0, None) == []
    context = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    assert lookup.propose(context, 3, 0, None) == [5, 6, 2]  # after the latest earlier "2 3"
    assert lookup.propose(context + [7], 3, 0, None) == []  # 7 never occurred before
    assert lookup.propose([4, 4], 5, 0, None) == [4]
    # in a loop the latest occurrence is cut short by the end: an earlier one has k tokens after it
    assert PromptLookup().propose([7, 8] * 5, 4, 0, None) == [7, 8, 7, 8]


def test_adaptive_draft_length_backs_off_when_drafts_fail():
    length = DraftLength(8)
    assert length.next() == 1
    length.update(1, 1)
    assert length.next() == 3
    length.update(3, 3)
    length.update(5, 5)
    length.update(7, 7)
    assert length.next() == 8  # at most `most`
    length.update(8, 2)
    assert length.next() == 3
    length.update(3, 0)
    assert length.next() == 1
    lengths = []
    for _ in range(40):  # a drafter that is always wrong: plain steps between ever rarer tries
        k = length.next()
        lengths.append(k)
        length.update(k, 0)
    assert [i for i, k in enumerate(lengths) if k] == [0, 5, 22]  # pauses of 4 and 16, then 64
    length.update(1, 1)
    assert length.backoff == 4
    fixed = DraftLength(4, adaptive=False)
    assert fixed.next() == 4
    fixed.update(4, 0)
    assert fixed.next() == 4


def test_cli_generate_with_prompt_lookup(programs, shared, capsys):
    folder, pte = family_program(shared, "llama")
    common = [str(pte), "--tokenizer", str(folder), "--prompt", "ab ab ab ab", "--max-new-tokens", "12",
              "--temperature", "0.8", "--seed", "7", "--json"]
    assert cli_main(["generate", *common]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert cli_main(["generate", *common, "--prompt-lookup", "--num-draft-tokens", "4"]) == 0
    drafted = json.loads(capsys.readouterr().out)
    assert drafted["token_ids"] == plain["token_ids"] and plain["draft_tokens"] == 0
    assert drafted["draft_tokens"] > 0 and drafted["accepted_tokens"] <= drafted["draft_tokens"]
    assert cli_main(["generate", *common, "--prompt-lookup", "--draft-model", str(pte)]) == 2
    assert "two drafters" in capsys.readouterr().err


def test_server_drafts_for_every_request(programs, shared):
    from starlette.testclient import TestClient

    from executorch_mlx.serve.app import create_app

    folder, pte = family_program(shared, "llama")
    body = {"model": "m", "prompt": "ab ab ab ab", "max_tokens": 12, "temperature": 0.8, "seed": 3}
    answers = []
    for draft in (None, {"draft": "prompt-lookup", "num_draft_tokens": 4}):
        with TestClient(create_app(LLMRunner(pte, folder), "m", draft), base_url="http://localhost") as client:
            response = client.post("/v1/completions", json=body)
            assert response.status_code == 200, response.text
            answers.append(response.json()["choices"][0]["text"])
    assert answers[0] == answers[1] and answers[0]
