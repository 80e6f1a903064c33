"""Structured output: a grammar's allowed next tokens as the program's token mask.

llguidance (a Rust grammar engine with JSON-schema, regex and Lark front ends)
computes on the host, before each step, which tokens may come next, in the
int32 bitmask layout of docs/sampling.md step 1; the runner passes it as the
program's `token_bitmask` input and the sampler applies it on the device,
after penalties and bias and before every filter. Chosen over xgrammar: no
dependencies of its own, Lark grammars as well as JSON schema and regex. A
mask takes about 0.16 ms per token on a 32,000-token vocabulary
(benchmarks/bench_structured.py).

JSON is compact (no whitespace between tokens): a bounded schema then has a
bounded number of ways to continue, and the output always finishes.

A grammar comes from users (a server's request, a CLI file): its text is
bounded (MAX_GRAMMAR_BYTES), and a new constraint is tried for a few steps
before it is handed out, so that a grammar that allows nothing, or whose
matcher gives up on its first tokens (llguidance's step limits: a schema
that requires itself, a regex of a billion states), is a ValueError before
anything runs. Errors carry llguidance's first line, not its parser state.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ...serialization.sampler_params import mask_words

# No free whitespace: {"a":1,"b":[2,3]}
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
# The largest schema, regex or Lark text taken (and grammar file read).
MAX_GRAMMAR_BYTES = 256 * 1024
# Steps a new constraint is walked on a copy (a token each, ~0.1-1 ms a step).
TRIAL_STEPS = 4


class GrammarError(ValueError):
    """A grammar that llguidance gave up on while generating."""


def _first_line(error: str) -> str:
    """llguidance's message without the parser state it appends."""
    return error.strip().splitlines()[0] if error.strip() else "unknown error"


def grammar_text(*, json_schema=None, regex: str | None = None, grammar: str | None = None) -> str | None:
    """llguidance's grammar for exactly one of the three (None for none).
    `json_schema`: a dict, JSON text, or a path to a .json file; `grammar`:
    Lark text or a path to a .lark file."""
    given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex and grammar, got {' and '.join(given)}")
    if not given:
        return None
    import llguidance  # (a generation without a grammar never imports it)

    if json_schema is not None:
        if isinstance(json_schema, (str, Path)) and not str(json_schema).lstrip().startswith(("{", "[")):
            json_schema = read_text_file(json_schema, "JSON schema")
        try:
            schema = json.loads(_bounded(json_schema, "JSON schema")) if isinstance(json_schema, str) else json_schema
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        except RecursionError:
            raise ValueError("the JSON schema is nested too deeply") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        try:
            text = json.dumps(schema)
        except (TypeError, ValueError, RecursionError) as e:  # a dict from Python: what JSON cannot hold
            raise ValueError(f"the JSON schema is not JSON: {_first_line(str(e)) if str(e) else 'too deep'}") from None
        _bounded(text, "JSON schema")
        return _grammar(llguidance.LLMatcher.grammar_from_json_schema, schema, overrides=_COMPACT_JSON)
    if regex is not None:
        if not isinstance(regex, str):
            raise TypeError(f"regex must be a string, got {type(regex).__name__}")
        return _grammar(llguidance.LLMatcher.grammar_from_regex, _bounded(regex, "regex"))
    text = str(grammar)
    if isinstance(grammar, Path) or (text.endswith(".lark") and "\n" not in text):
        text = read_text_file(grammar, "grammar")
    return _grammar(llguidance.LLMatcher.grammar_from_lark, _bounded(text, "grammar"))


def _grammar(front_end, *args, **kwargs) -> str:
    try:
        return front_end(*args, **kwargs)
    except (ValueError, TypeError, RuntimeError) as e:
        raise ValueError(f"the grammar is not valid: {_first_line(str(e))}") from None


def _bounded(text: str, what: str) -> str:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_GRAMMAR_BYTES:
        raise ValueError(f"the {what} is {size} bytes; at most {MAX_GRAMMAR_BYTES} are taken")
    return text


def read_text_file(path, what: str) -> str:
    """A grammar file's text, read no further than the size taken (a path
    may name a device or a pipe that never ends)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_GRAMMAR_BYTES + 1)
    except OSError as e:
        raise ValueError(f"cannot read the {what} file {path}: {e.strerror or e}") from None
    if len(data) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"the {what} file {path} is larger than {MAX_GRAMMAR_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"the {what} file {path} is not UTF-8 text (byte {e.start})") from None


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: set[int]):
    """llguidance's view of a `tokenizers.Tokenizer` for a model of
    `vocab_size` tokens (ids the tokenizer does not have are never allowed)
    ending at `eos_ids`. Built once per runner: it indexes every token."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)


class TokenConstraint:
    """One generation's grammar state: the mask of the next token, advanced
    by each token generated."""

    def __init__(self, grammar: str, lltok, eos_ids: set[int] = frozenset()):
        """ValueError for a grammar that is not valid, that allows no output
        (nothing, or only the end), or whose matcher gives up within
        TRIAL_STEPS tokens of one path through it."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error:
            raise ValueError(f"the grammar is not valid: {_first_line(error)}")
        self.matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        self._mask = np.zeros((1, mask_words(lltok.vocab_size)), dtype=np.int32)
        self._try(set(eos_ids))

    def _try(self, eos_ids: set[int]) -> None:
        matcher, mask = self.matcher.deep_copy(), np.zeros_like(self._mask)
        for step in range(TRIAL_STEPS):
            allowed = [t for t in _ids(_compute(matcher, mask)) if t not in eos_ids]
            if not allowed:
                if step == 0:
                    raise ValueError("the grammar allows no output")
                return
            if not matcher.consume_token(allowed[0]):
                raise ValueError(f"the grammar fails on its first tokens: {_first_line(matcher.get_error())}")

    def mask(self) -> np.ndarray:
        """[1, ceil(V/32)] int32: the tokens allowed next."""
        return _compute(self.matcher, self._mask)

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise GrammarError(f"the grammar refused token {token}: {_first_line(self.matcher.get_error())}")

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (but the end of generation)."""
        return self.matcher.is_stopped()


def _compute(matcher, mask: np.ndarray) -> np.ndarray:
    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, mask.nbytes)
    if matcher.is_error():
        raise GrammarError(f"the grammar failed: {_first_line(matcher.get_error())}")
    return mask


def _ids(mask: np.ndarray) -> list[int]:
    """The token ids a [1, W] int32 bitmask allows."""
    bits = (mask.reshape(-1, 1).astype(np.int64) >> np.arange(32)) & 1
    return np.flatnonzero(bits).tolist()
