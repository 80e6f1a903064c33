"""Continuous batching: many generations at once on a batched program
(`export --max-batch N`, llm/export/batched.py).

    batch = Batch(runner)                       # runner: an LLMRunner of a batched program
    future = batch.submit(runner.prepare(...), on_text, on_token)
    result = future.result()                    # the GenerationResult, as runner.run gives it

Each generation holds a cache row from its admission to its end. One thread
runs the calls: before each, waiting plans take free rows; each call then
feeds every running row its next tokens (a prompt chunk, or the token it
sampled last), so a new request prefills between the others' decode steps
and a row is free again as soon as its generation ends.

A call runs the rows up to the highest one running (pads in the others),
so a plan always takes the lowest free row. Conversations move instead:
the tokens a row held are kept in a copy of that row before another
conversation overwrites them (prompt_cache.KeptRows, up to
`prompt_cache_bytes`), and a plan that shares more with a kept row, or with
another free row, than with its own has that row copied into its own first:
it prefills only what follows (a conversation's next turn).

A generation's tokens are the ones it gets alone: each row samples with its
own seed at its own decode step, and the model computes every row as it
computes one (batched.py). A Batch owns its runner's cache rows until it is
closed: the runner's own generate() (row 0) waits until then.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from .decode_parts import SamplerFeed, StopRules
from .plan import Plan

# The most prompt tokens a row prefills in a call while other rows decode:
# the decoding rows pad to the call's length, so a long chunk slows them.
INTERLEAVED_CHUNK = 32


@dataclass
class _Sequence:
    """One generation in its row."""

    plan: Plan
    future: Future
    feed: SamplerFeed
    rules: StopRules  # (its text: rules.text)
    fed: int  # tokens of `tokens` whose keys and values the row holds
    tokens: list[int]  # the prompt, then what was generated
    cached: int
    logprobs: list = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    prefill_s: float = 0.0
    steps: list[float] = field(default_factory=list)

    @property
    def out(self) -> list[int]:
        return self.tokens[len(self.plan.prompt_ids):]

    def take(self, limit: int) -> list[int]:
        """The tokens this call feeds: the next chunk of the prompt, or the last token sampled."""
        return self.tokens[self.fed:self.fed + limit]

    def sampler(self, runner) -> list[np.ndarray]:
        return self.feed(runner, len(self.out), self.tokens)


class Batch:
    """Generations of an LLMRunner's batched program, run together (see the module doc)."""

    def __init__(self, runner, prompt_cache_bytes: int = 2 << 30):
        from .prompt_cache import KeptRows

        if runner.max_batch < 2:
            raise ValueError("continuous batching needs a batched program (export --max-batch N, N >= 2)")
        self.runner = runner
        self.kept = KeptRows(prompt_cache_bytes, runner.max_batch)
        self.rows: list[_Sequence | None] = [None] * runner.max_batch
        runner._lock.acquire()  # (released by close)
        # what the free rows hold (row 0: what the runner's own generations left)
        self._held: list[list[int]] = [runner.cached_tokens] + [[] for _ in self.rows[1:]]
        self._epoch = _reset_epoch()
        self._waiting: deque[tuple[Plan, Future, Callable | None, Callable | None]] = deque()
        self._wake = threading.Condition()
        self._closed = False
        self._idle = None  # the sampler inputs of a row that runs no generation, made on first use
        self._thread = threading.Thread(target=self._loop, name="batch", daemon=True)
        self._thread.start()

    def submit(self, plan: Plan, on_text: Callable[[str], None] | None = None,
               on_token: Callable[[int, float | None], bool] | None = None) -> Future:
        """Queues a plan of the runner's prepare(); the future's result is its
        GenerationResult (or the exception that ended it). `on_text` and
        `on_token` are run()'s, called on the batch's thread."""
        if plan.drafter is not None:
            raise ValueError("a batched program verifies no drafts: prepare the plan without a draft")
        plan.claim(self.runner)
        future = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the batch is closed")
            self._waiting.append((plan, future, on_text, on_token))
            self._wake.notify()
        return future

    def close(self) -> None:
        """Ends the thread once the running and waiting generations are done;
        drops the kept conversations."""
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join()
        self.kept.clear()
        self.runner.cached_tokens = self.held(0)  # (row 0 is the runner's own again)
        self.runner._lock.release()

    def held(self, row: int) -> list[int]:
        """The token ids whose entries cache row `row` holds, from position 0."""
        epoch = _reset_epoch()
        if epoch != self._epoch:  # someone emptied every cache
            self._held, self._epoch = [[] for _ in self.rows], epoch
        seq = self.rows[row]
        return seq.tokens[:seq.fed] if seq is not None else self._held[row]

    def _set_held(self, row: int, ids: list[int]) -> None:
        """(of a free row)"""
        self.held(row)
        self._held[row] = ids

    # ------------------------------------------------------ scheduling --
    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._waiting and not any(self.rows):
                    if self._closed:
                        return
                    self._wake.wait()
                self._admit()
            if any(self.rows):
                try:
                    self._step()
                except Exception as e:  # (our own bug: no generation waits forever on it)
                    self._fail(range(len(self.rows)), e)

    def _admit(self) -> None:
        """Waiting plans into free rows, in arrival order."""
        while self._waiting and None in self.rows:
            plan, future, on_text, on_token = self._waiting.popleft()
            if not future.set_running_or_notify_cancel():
                continue
            row, runner = self.rows.index(None), self.runner
            try:
                cached = self._bring(plan.prompt_ids, row)
            except Exception as e:  # (the runtime's: what the row holds is unknown)
                self._set_held(row, [])
                future.set_exception(e)
                continue
            self.rows[row] = _Sequence(plan, future, SamplerFeed(plan), runner.stop_rules(plan, on_text, on_token),
                                       cached, list(plan.prompt_ids), cached)

    def _bring(self, ids: list[int], row: int) -> int:
        """Makes free row `row` hold the longest prefix of `ids` there is (its
        own, another free row's or a kept one's), keeping the conversation it
        held unless `ids` extend it; the count of tokens it holds for them."""
        from executorch_mlx._runtime_library import copy_state_row, drop_state, snapshot_state_row

        reusable, held = self.runner.reusable, self.held(row)
        here = reusable(ids, held)
        others = {r: reusable(ids, self.held(r)) for r, seq in enumerate(self.rows) if seq is None and r != row}
        source = max(others, key=others.get, default=None)
        snapshot, kept = self.kept.best(ids, reusable)
        best = max(here, others.get(source, 0), kept)
        if held and here < max(1, len(held) // 2) and held not in [self.held(r) for r in others]:
            self.kept.keep(held, row)  # (another conversation: kept before it is overwritten)
        if best == here:
            tokens = held
        elif source is not None and others[source] == best:
            moved, _ = snapshot_state_row(source, len(self.rows))
            try:
                copy_state_row(moved, row, len(self.rows))
            finally:
                drop_state(moved)
            tokens = self.held(source)
        else:
            tokens = self.kept.restore(snapshot, row)
        self._set_held(row, list(tokens[:best]))
        return best

    # ----------------------------------------------------------- a call --
    def _step(self) -> None:
        runner, t = self.runner, time.perf_counter()  # (a step's time includes building its inputs)
        top = max(r for r, seq in enumerate(self.rows) if seq is not None) + 1
        decoding = any(seq is not None and seq.fed >= len(seq.plan.prompt_ids) for seq in self.rows)
        limit = INTERLEAVED_CHUNK if decoding else runner.max_chunk
        takes = [seq.take(limit) if seq is not None else [] for seq in self.rows[:top]]
        length = max(len(t) for t in takes)
        ids = np.zeros((top, length), dtype=np.int64)
        positions = np.empty((top, length), dtype=np.int64)
        sampler = []
        for r in range(top):
            seq, take = self.rows[r], takes[r]
            start = seq.fed if seq is not None else len(self.held(r))
            end = start + len(take)
            # pads first, at the slots after the row's tokens (the scratch slot past the context)
            pads = [min(end + j, runner.max_context) for j in range(length - len(take))]
            ids[r, length - len(take):] = take
            positions[r] = pads + list(range(start, end))
            sampler.append(seq.sampler(runner) if seq is not None else self._idle_sampler())
        values = [np.concatenate(column) if top > 1 else column[0] for column in zip(*sampler)]
        try:
            outputs = runner.execute([ids, positions] + values)
        except Exception as e:
            self._fail(range(top), e)
            return
        seconds = time.perf_counter() - t
        for r in range(top):
            seq = self.rows[r]
            if seq is None:
                continue
            seq.fed += len(takes[r])
            if seq.fed < len(seq.tokens):
                continue  # more of the prompt to come
            if seq.out:
                seq.steps.append(seconds)
            else:
                seq.prefill_s = time.perf_counter() - seq.started
            try:
                self._emit(seq, outputs, r)
                reason = seq.rules.check(seq.out, seq.logprobs)
            except Exception as e:  # (an invalid token, the grammar's or a callback's error)
                self._end(r, error=e)
                continue
            if reason is not None:
                self._end(r, reason)

    def _emit(self, seq: _Sequence, outputs: list, row: int) -> None:
        """Appends row `row`'s sampled token (and its logprobs) to its sequence."""
        token = int(outputs[0][row])
        self.runner._check_token(token, seq.plan.constraint is not None)
        seq.tokens.append(token)
        seq.logprobs += self.runner.read_logprobs(outputs, 1, row)

    def _fail(self, rows, error: Exception) -> None:
        """Ends the generations of `rows` with `error`: what those cache rows
        hold is unknown now."""
        for r in rows:
            if self.rows[r] is not None:
                self._end(r, error=error)
            self._set_held(r, [])

    def _end(self, row: int, reason: str | None = None, error: Exception | None = None) -> None:
        """Frees row `row`, its generation's result (ended for `reason`) or `error` set."""
        from .runner import GenerationResult

        seq, self.rows[row] = self.rows[row], None
        self._set_held(row, seq.tokens[:seq.fed])
        if error is not None:
            seq.future.set_exception(error)
            return
        out, plan = seq.out, seq.plan
        seq.rules.text.update(out, final=True)
        prompt = len(plan.prompt_ids)
        seq.future.set_result(GenerationResult(
            token_ids=out, text=seq.rules.text.result(out),
            prefill_tokens_per_s=(prompt - seq.cached) / seq.prefill_s if seq.prefill_s else 0.0,
            decode_tokens_per_s=(len(out) - 1) / sum(seq.steps) if seq.steps else 0.0,
            stop_reason=reason, step_seconds=seq.steps,
            logprobs=seq.logprobs if self.runner.logprobs else None, prompt_tokens=prompt,
            cached_tokens=seq.cached, tool_calls=seq.rules.text.tool_calls))

    def _idle_sampler(self) -> list[np.ndarray]:
        """A row with no generation below a running one: greedy, its token unused."""
        if self._idle is None:
            names = self.runner.input_names[2:]
            given = {"seed": np.array(0), "position": np.array(0), "temperature": np.array(0.0, dtype=np.float32)}
            self._idle = self.runner.sampler_values(names, {k: v for k, v in given.items() if k in names})
        return self._idle


def _reset_epoch() -> int:
    import executorch_mlx._runtime_library as library

    return library.reset_count
