"""Issue 38 item 2: batched programs (export --max-batch N,
llm/export/batched.py) and continuous batching on them (llm/run/batch.py).

Plans run side by side, admitted while others decode, each give the tokens
and log-probabilities of the one-row program of the same weights; export
refuses what batched programs do not build yet, naming it."""

from __future__ import annotations

import threading

import pytest
import torch
from llm_programs import MAX_CONTEXT, batched_chat_program, family_program

from executorch_mlx.llm.run.batch import INTERLEAVED_CHUNK, Batch
from executorch_mlx.llm.run.runner import LLMRunner

# (prompt ids, prepare()'s keywords): greedy and sampled rows with settings of their own; the long prompt
# prefills in interleaved chunks once the others decode
CASES = [
    (list(range(5, 12)), dict(max_new_tokens=12)),
    ([(7 * i) % 200 + 3 for i in range(INTERLEAVED_CHUNK + 9)], dict(max_new_tokens=10, temperature=1.1, seed=4,
                                                                       top_k=20)),
    ([9, 4], dict(max_new_tokens=16, temperature=0.9, seed=2**63 + 5, repetition_penalty=1.4,
                  logit_bias={12: 2.0, 30: float("-inf")})),
    ([100, 101, 102], dict(max_new_tokens=9, temperature=0.7, seed=8, min_p=0.05, presence_penalty=0.5)),
]


@pytest.fixture(scope="module")
def runners(shared):
    """(the batched program's runner, the one-row program's), of one folder's weights (test_serve's chat folder)."""
    folder, batched, single = batched_chat_program(shared)
    return LLMRunner(batched, folder), LLMRunner(single, folder)


def _same(result, alone) -> None:
    """The same tokens, log-probabilities and most likely tokens of each step."""
    assert result.token_ids == alone.token_ids and result.stop_reason == alone.stop_reason
    torch.testing.assert_close(torch.tensor(result.logprobs), torch.tensor(alone.logprobs), atol=1e-4, rtol=0)
    assert [[i for i, _ in lp.top] for lp in result.logprobs] == [[i for i, _ in lp.top] for lp in alone.logprobs]


def test_plans_side_by_side_equal_the_one_row_program(runners):
    """Three rows at once, a fourth admitted when one ends (more plans than
    rows), some arriving while others decode: each equals the one-row
    program alone; a batched program's own generate runs row 0 the same."""
    batched, single = runners
    alone = [single.generate(ids, **kw) for ids, kw in CASES]
    assert len(set(map(tuple, (a.token_ids for a in alone)))) == len(CASES)
    batch = Batch(batched)
    decoding = threading.Event()

    def seen(token, logprob) -> bool:
        decoding.set()
        return False

    try:
        first = [batch.submit(batched.prepare(CASES[0][0], **CASES[0][1]), on_token=seen),
                 batch.submit(batched.prepare(CASES[1][0], **CASES[1][1]))]
        assert decoding.wait(60)
        late = [batch.submit(batched.prepare(ids, **kw)) for ids, kw in CASES[2:]]
        for future, want in zip(first + late, alone):
            _same(future.result(60), want)
    finally:
        batch.close()
    _same(batched.generate(CASES[2][0], **CASES[2][1]), alone[2])


def test_conversations_are_kept_and_brought_back_into_any_row(runners):
    """A, then B in the same row (A kept in a snapshot), then a long X in that
    row; A's next turn, sent while X decodes, runs in the next row with A's
    row copied into it: it prefills only what follows, and X, beside it, is
    unchanged. Each equals the one-row program alone."""
    batched, single = runners
    ids, kw = CASES[0]
    long_ids, long_kw = CASES[1]
    batched.reset()  # (rows the other tests left would be kept too)
    batch = Batch(batched)
    decoding = threading.Event()
    try:
        first = batch.submit(batched.prepare(ids, **kw)).result(60)
        other = batch.submit(batched.prepare([50, 51, 52, 53], max_new_tokens=4)).result(60)
        long = batch.submit(batched.prepare(long_ids, **long_kw), on_token=lambda t, lp: decoding.set())
        assert decoding.wait(60)
        turn = ids + first.token_ids + [60, 61]
        again = batch.submit(batched.prepare(turn, max_new_tokens=6)).result(60)
        _same(long.result(60), single.generate(long_ids, **long_kw))
        assert len(batch.kept) == 2  # A's and B's conversations
    finally:
        batch.close()
    assert other.cached_tokens == 0 and again.cached_tokens == len(ids) + len(first.token_ids) - 1
    _same(again, single.generate(turn, max_new_tokens=6))


def test_a_failing_row_ends_alone(runners):
    """A callback that raises ends its own generation with that error; the row beside it goes on."""
    batched, single = runners

    def boom(token, logprob):
        raise KeyError("client gone")

    batch = Batch(batched)
    try:
        failing = batch.submit(batched.prepare(CASES[3][0], **CASES[3][1]), on_token=boom)
        fine = batch.submit(batched.prepare(CASES[0][0], **CASES[0][1]))
        with pytest.raises(KeyError, match="client gone"):
            failing.result(60)
        _same(fine.result(60), single.generate(CASES[0][0], **CASES[0][1]))
    finally:
        batch.close()


def test_batch_refuses_what_it_cannot_run(runners):
    batched, single = runners
    with pytest.raises(ValueError, match="needs a batched program"):
        Batch(single)
    with pytest.raises(ValueError, match="verifies no drafts"):
        batched.prepare([1, 2], draft="prompt-lookup")


@pytest.mark.parametrize("kwargs,message", [
    (dict(max_batch=0), "max_batch must be in"),
    (dict(max_batch=2, sampling=False), "max_batch needs a sampling program"),
    (dict(max_batch=2, max_draft_tokens=3), "verifies no drafts"),
])
def test_export_checks_max_batch_first(shared, tmp_path, kwargs, message):
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions

    folder, _ = family_program(shared, "llama")
    with pytest.raises(ValueError, match=message):
        export_llm(folder, tmp_path / "x.pte", ExportOptions(max_context=MAX_CONTEXT, **kwargs), progress=None)


@pytest.mark.parametrize("family,message", [("gemma3", "sliding-window layers"), ("lfm2", "state caches")])
def test_export_refuses_what_batched_programs_do_not_build(shared, tmp_path, family, message):
    from executorch_mlx.llm.export.hf_export import export_llm
    from executorch_mlx.llm.export.options import ExportOptions
    from executorch_mlx.llm.model_folders import write_model_folder
    from llm_programs import FAMILY_LAYERS

    folder = shared.get(family, lambda r: write_model_folder(r / family, family, layers=FAMILY_LAYERS.get(family, 1)))
    with pytest.raises(NotImplementedError, match=f"--max-batch .*{message}"):
        export_llm(folder, tmp_path / "x.pte", ExportOptions(max_context=MAX_CONTEXT, max_batch=2), progress=None)
