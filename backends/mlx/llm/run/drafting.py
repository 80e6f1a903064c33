"""Drafters for speculative decoding: they propose the next tokens; the
target program verifies them (llm/export/speculative.py), so whatever a drafter
proposes, the output is the output of plain decoding.

* `PromptLookup`: the tokens that followed the latest earlier occurrence of
  the context's last n-gram with as many tokens after it as asked for (no
  second model; strong where the output repeats the prompt: code edits,
  summaries, retrieval).
* `DraftModel`: a smaller program of the same tokenizer decodes the drafts
  with its own KV cache, sampling with the target's settings at the same
  positions (the same seed draws the same noise, so a draft model that
  agrees with the target on the distribution proposes the target's token).
  It prefills the prompt with the target. Its cache is rolled back by
  position: the next round feeds it from the first token it holds that
  differs from the context, overwriting the entries of rejected drafts.
* `DraftLength`: how many tokens to draft next; adaptive by default, so
  that speculation with poor acceptance costs little more than plain
  decoding.
"""

from __future__ import annotations

from array import array
from typing import Callable

from .. import program_contract

# sampler inputs of `runner` for (decode step, context): built by the target's generation
SamplerFor = Callable[[object, int, list], list]


class PromptLookup:
    """Drafts the continuation of the latest earlier occurrence of the
    context's last `max_ngram` (down to `min_ngram`) tokens that has k tokens
    after it (else of the one with the most)."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = program_contract.PROMPT_LOOKUP_MAX_NGRAM,
                 min_ngram: int = program_contract.PROMPT_LOOKUP_MIN_NGRAM):
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def check(self, target) -> None:
        """Nothing to check: it drafts from the target's own context."""

    def prefill(self, prompt: list[int], sampler_for: SamplerFor) -> None:
        """Nothing to prefill: it keeps no state."""

    def propose(self, context: list[int], k: int, step: int, sampler_for: SamplerFor) -> list[int]:
        # The search runs over the context's bytes (8 a token) with
        # bytes.rfind, in C: a Python loop over a long context took a good
        # part of a decode step (0.45 ms at 2000 tokens).
        data = array("q", context).tobytes()
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            best: list[int] = []
            for start in _occurrences(data, n):  # the latest first
                # the latest with k tokens after it (in a loop, the latest is
                # cut short by the end of the context)
                follows = context[start + n:start + n + k]
                if len(follows) > len(best):
                    best = follows
                if len(best) == k:
                    break
            if best:
                return best
        return []


def _occurrences(data: bytes, n: int):
    """The token offsets of the earlier occurrences of the last n tokens of
    `data` (int64 tokens as bytes), the latest first."""
    needle = data[-8 * n:]
    end = len(data) - 8  # an occurrence ends before the last token
    while (at := data.rfind(needle, 0, end)) >= 0:
        if at % 8 == 0:  # (a match across token boundaries is no match)
            yield at // 8
        end = at + len(needle) - 1


class DraftModel:
    """A program exported by `executorch-mlx export` from a smaller model of
    the same tokenizer, run as the drafter (see the module doc)."""

    name = "draft-model"

    def __init__(self, runner):
        self.runner = runner

    def check(self, target) -> None:
        """ValueError naming both programs' values when the draft's
        vocabulary or special ids are not the target's."""
        draft = self.runner
        if not draft.samples:
            raise ValueError("the draft program returns logits (exported with --no-sampling): export it with "
                             "its sampler")
        for what, key in (("vocabulary size", program_contract.VOCAB_SIZE),
                          ("eos ids", program_contract.EOS_IDS), ("bos id", program_contract.BOS_ID)):
            ours, theirs = target.contract.metadata.get(key), draft.contract.metadata.get(key)
            if ours != theirs:
                raise ValueError(f"the draft model's {what} ({_one(theirs)}) is not the target's ({_one(ours)}): "
                                 f"a draft model must share the target's tokenizer")

    def prefill(self, prompt: list[int], sampler_for: SamplerFor) -> None:
        """Fills the draft's cache with the prompt while the target prefills
        it (as mlx-lm does), so the first round drafts at once; a prompt
        beyond the draft's context is left to the rounds, which then draft
        nothing."""
        draft = self.runner
        if len(prompt) < draft.max_context:
            self._feed(prompt, draft.reusable(prompt), sampler_for(draft, 0, prompt))

    def propose(self, context: list[int], k: int, step: int, sampler_for: SamplerFor) -> list[int]:
        draft = self.runner
        k = min(k, draft.max_context - len(context))  # the last draft's entry must fit its cache
        drafts: list[int] = []
        cached = draft.reusable(context)
        for i in range(k):
            seen = context + drafts
            drafts.append(self._feed(seen, cached, sampler_for(draft, step + i, seen)))
            cached = len(seen)
        return drafts

    def _feed(self, context: list[int], cached: int, sampling: list) -> int:
        """Runs context[cached:] (at its positions, in chunks) through the
        draft; the token it samples after `context`."""
        draft, fed = self.runner, context[cached:]
        for start in range(0, len(fed), draft.max_chunk):
            emitted, _ = draft._step(fed[start:start + draft.max_chunk], cached + start, sampling)
        return emitted[0]


def _one(values):
    return values[0] if isinstance(values, list) and len(values) == 1 else values


class DraftLength:
    """The number of tokens to draft next, at most `most`. Adaptive: 1 at
    first, two more after a round whose drafts were all accepted, one more
    than were accepted otherwise; after a round that drafted one token and
    lost it, plain decoding for 4, 16, 64 or 256 steps before drafting again
    (reset by an accepted draft), so that poor acceptance costs little: each
    try of a draft model also feeds it the tokens of the pause before it, so
    the tries must grow rare fast.
    Fixed: always `most`."""

    START = program_contract.DRAFT_START  # a failed first round costs one draft step
    BACKOFF_MIN = program_contract.DRAFT_BACKOFF_MIN
    BACKOFF_GROWTH = program_contract.DRAFT_BACKOFF_GROWTH
    BACKOFF_MAX = program_contract.DRAFT_BACKOFF_MAX

    def __init__(self, most: int, adaptive: bool = True):
        self.most, self.adaptive = most, adaptive
        self.k = min(most, self.START) if adaptive else most
        self.pause, self.backoff = 0, self.BACKOFF_MIN

    def next(self) -> int:
        if self.pause:
            self.pause -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if not self.adaptive or not drafted:
            return
        if accepted == drafted:
            self.k = min(self.most, self.k + 2)
        else:
            self.k = max(1, accepted + 1)
        if accepted:
            self.backoff = self.BACKOFF_MIN
        elif drafted == 1:
            self.pause, self.backoff = self.backoff, min(self.BACKOFF_MAX, self.BACKOFF_GROWTH * self.backoff)
