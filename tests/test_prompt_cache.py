"""A prompt cache across conversations (llm/run/prompt_cache.py): after
conversation A, then B, A's next turn runs on A's kept cache, with the tokens
of a runner without one; what is kept stays within its bytes, least recently
used dropped first. (The server's use: tests/test_serve.py.)"""

from __future__ import annotations

from llm_programs import family_program

from executorch_mlx.llm.run.runner import LLMRunner

A, B, C = [5, 17, 42, 8, 99, 3], [7, 7, 61, 2, 30, 11], [90, 4, 4, 18, 27, 64]


def turn(runner: LLMRunner, prompt: list[int]):
    return runner.generate(prompt, max_new_tokens=5, temperature=0.9, seed=1)


def test_a_conversation_comes_back_to_its_cache(shared):
    """(Prompts under 16 tokens: every row is computed as a one-row call
    computes it, so reused or prefilled, the logits are the same bits.)"""
    runner = LLMRunner(family_program(shared, "llama")[1])
    runner.use_prompt_cache(1 << 40)
    a = turn(runner, A)
    turn(runner, B)
    a2 = A + a.token_ids + [12, 13]
    again = turn(runner, a2)
    assert again.cached_tokens == len(A) + len(a.token_ids) - 1  # (the last token is written by the next call)
    assert len(runner.prompt_cache) == 2  # A, then B, each kept as the other took the cache
    runner.use_prompt_cache(0)
    runner.reset()
    alone = turn(runner, a2)
    assert alone.cached_tokens == 0 and alone.token_ids == again.token_ids


def test_what_is_kept_stays_within_its_bytes(shared):
    runner = LLMRunner(family_program(shared, "llama")[1])
    runner.use_prompt_cache(1 << 40)
    turn(runner, A)
    turn(runner, B)
    one = runner.prompt_cache.bytes  # one snapshot: every loaded program's state
    assert one > 0 and len(runner.prompt_cache) == 1
    runner.use_prompt_cache(one)
    runner.reset()
    a, b = turn(runner, A), turn(runner, B)
    turn(runner, C)  # keeps B, dropping A
    assert len(runner.prompt_cache) == 1 and runner.prompt_cache.bytes <= one
    # B comes back (C's snapshot, the newest, is dropped: the resumed one stays); A is gone
    assert turn(runner, B + b.token_ids).cached_tokens == len(B) + len(b.token_ids) - 1
    assert turn(runner, A + a.token_ids).cached_tokens == 0
    runner.use_prompt_cache(1)  # smaller than any snapshot: nothing is kept
    turn(runner, A)
    turn(runner, B)
    assert len(runner.prompt_cache) == 0 and turn(runner, A + [1]).cached_tokens == 0
