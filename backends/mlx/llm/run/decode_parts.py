"""The parts of a decode loop (LLMRunner._generate), each holding its state:
the sampler's inputs of each call, the rules that end a generation, and the
text as it grows.

    feed = SamplerFeed(plan)            # feed(runner, position, context, drafts) -> sampler values
    rules = StopRules(eos_ids, plan.constraint, TextOut(tokenizer, plan.stops, on_text), on_token, n)
    reason = rules.check(out, logprobs)  # after each token: None, or why it ends

Drafters take the feed too: a draft model samples with the target's
settings (llm/run/drafting.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..sampler_inputs import TOKEN_MASK
from .chat import StopText
from .plan import Plan


class SamplerFeed:
    """The sampler's inputs of each call: the plan's, with the call's
    position, penalty history and token mask. The others are the same every
    call: built once per runner (a draft model takes fewer)."""

    def __init__(self, plan: Plan):
        self.given, self.window, self.constraint = dict(plan.sampling), plan.window, plan.constraint
        self._fixed: dict[int, dict[str, np.ndarray]] = {}  # by id(runner): each input as it is every call

    def __call__(self, runner, position: int, context: list[int], drafts: list[int] = ()) -> list:
        """`runner`'s sampler inputs for the token after `context` (decode
        step `position`), and a row per draft after it."""
        if not runner.samples:
            return []
        names = runner.input_names[2:]
        fixed = self._fixed.get(id(runner))
        if fixed is None:  # (a draft program may take fewer inputs: it drafts without those)
            given = {k: v for k, v in self.given.items() if k in names}
            fixed = self._fixed[id(runner)] = dict(zip(names, runner.sampler_values(names, given)))
        changing = {"position": np.array(position, dtype=np.int64)}
        if "history" in names:  # a row per token sampled: the rows a program samples
            changing["history"] = history_rows(context, drafts, self.window)
        if self.constraint is not None:
            changing[TOKEN_MASK] = self.constraint.mask()
        now = [n for n in names if n in changing]
        values = dict(fixed)
        values.update(zip(now, runner.sampler_values(now, {n: changing[n] for n in now})))
        return [values[n] for n in names]


class StopRules:
    """Why a generation ends, asked after each token: "eos", "stop" (a stop
    string), "cancelled" (on_token returned True), "grammar" (it allows
    nothing more) or "max_new_tokens"; None to go on. Each token advances
    the grammar and the text."""

    def __init__(self, eos_ids: set[int], constraint, text: TextOut,
                 on_token: Callable[[int, float | None], bool] | None, max_new_tokens: int):
        self.eos_ids, self.constraint, self.text = eos_ids, constraint, text
        self.on_token, self.max_new_tokens = on_token, max_new_tokens

    def check(self, out: list[int], logprobs: list[float | None]) -> str | None:
        cancel = self.on_token is not None and self.on_token(out[-1], logprobs[-1])
        if out[-1] in self.eos_ids:
            return "eos"
        if self.constraint is not None:
            self.constraint.advance(out[-1])
        if self.text.update(out):
            return "stop"
        if cancel:
            return "cancelled"
        if self.constraint is not None and self.constraint.finished:
            return "grammar"
        return "max_new_tokens" if len(out) >= self.max_new_tokens else None


def history_rows(context: list[int], drafts: list[int], window: int) -> np.ndarray:
    """The penalty history of the token after `context` and after each
    draft: row i holds the last `window` tokens of context + drafts[:i]
    (plain decoding's history at that step), -1 padded: [len(drafts) + 1, window]."""
    rows = np.full((len(drafts) + 1, window), -1, dtype=np.int64)
    if window:
        for i in range(len(drafts) + 1):
            tail = (context + list(drafts[:i]))[-window:]
            rows[i, :len(tail)] = tail
    return rows


class TextOut:
    """The generated text as it grows: streamed to `on_text` and checked for
    stop strings. A multi-byte character split across tokens waits until it
    is complete; the final update emits whatever is left (an unfinished
    character's U+FFFD included), so the pieces join to the result's text.
    With `tool_use`, the text stops at the first tool call (never streamed),
    and the final update reads the calls into `tool_calls` (if they do not
    parse, the text was not a call: all of it is emitted). With `channels`
    (channels.FinalChannel: gpt-oss), the text is the final channel's only."""

    def __init__(self, tokenizer, stops: list[str], on_text, *, tool_use=None, eos_ids: set[int] = frozenset(),
                 channels=None):
        self.tokenizer, self.on_text = tokenizer, on_text
        self.tool_use, self.eos_ids, self.tool_calls = tool_use, eos_ids, None
        self.channels = channels
        self.calls = tool_use.call_start() if tool_use is not None else None
        self.active = tokenizer is not None and (on_text is not None or bool(stops) or self.calls is not None)
        self.stop = StopText(stops, self.calls.hold if self.calls is not None else None)
        self.text = ""  # the text of ids[:read]
        # Each step decodes only ids[start:], against ids[start:read] (the
        # last piece's tokens, which end on a whole character): the new text
        # is the difference, so a long answer costs linear time, and a
        # decoder that drops a text's leading space drops it from both.
        self.start = self.read = 0

    def update(self, ids: list[int], final: bool = False) -> bool:
        """Emits the new text of `ids` (all generated so far); True at a stop string."""
        if not self.active or self.stop.stopped:
            return self.stop.stopped
        every = ids
        if self.channels is not None:
            ids = self.channels.visible(ids)
        if self.calls is not None and self.calls.ids and self.calls.at is None:  # a special token starts a call
            for j in range(self.read, len(ids)):
                if ids[j] in self.calls.ids:
                    self.calls.see(ids[j], self.tokenizer.decode(ids[:j]))
        before = self.tokenizer.decode(ids[self.start:self.read])
        after = self.tokenizer.decode(ids[self.start:])
        if not after.startswith(before):
            # a decoder that rewrote text already emitted (none of the
            # byte-level ones do): what was streamed cannot be taken back
            return False
        if after.endswith("\ufffd") and not final:
            return False  # a character split across tokens: wait for its end
        if len(ids) > self.read:  # (a repeated final call adds nothing, and keeps its window)
            self.text += after[len(before):]
            self.start, self.read = self.read, len(ids)
        if final and self.calls is not None:
            self._read_calls(every)
        piece = self.stop.update(self.text, final)
        if piece and self.on_text is not None:
            self.on_text(piece)
        return self.stop.stopped

    def _read_calls(self, ids: list[int]) -> None:
        # (gpt-oss's calls are in a channel of their own, never in the text)
        if self.calls.hold(self.text, True) < len(self.text) or self.calls.at is not None or self.channels:
            raw = self.tokenizer.decode([t for t in ids if t not in self.eos_ids], skip_special_tokens=False)
            self.tool_calls = self.tool_use.parse(raw)
        if self.tool_calls is None:
            self.calls.released = True

    def result(self, ids: list[int]) -> str:
        if self.stop.stopped or self.calls is not None:
            return self.stop.emitted
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(self.channels.visible(ids) if self.channels is not None else ids)
