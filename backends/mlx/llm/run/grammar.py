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
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ...custom_kernel_ops.sample import mask_words

# No free whitespace: {"a":1,"b":[2,3]}
_COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


def grammar_text(*, json_schema=None, regex: str | None = None, grammar: str | None = None) -> str | None:
    """llguidance's grammar for exactly one of the three (None for none).
    `json_schema`: a dict, JSON text, or a path to a .json file; `grammar`:
    Lark text or a path to a .lark file."""
    import llguidance

    given = [name for name, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar))
             if v is not None]
    if len(given) > 1:
        raise ValueError(f"give at most one of json_schema, regex and grammar, got {' and '.join(given)}")
    if json_schema is not None:
        if isinstance(json_schema, (str, Path)) and not str(json_schema).lstrip().startswith(("{", "[")):
            json_schema = _read(json_schema, "JSON schema")
        try:
            schema = json.loads(json_schema) if isinstance(json_schema, str) else json_schema
        except json.JSONDecodeError as e:
            raise ValueError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise ValueError(f"a JSON schema is an object (or true/false), got {type(schema).__name__}")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=_COMPACT_JSON)
    if regex is not None:
        if not isinstance(regex, str):
            raise TypeError(f"regex must be a string, got {type(regex).__name__}")
        return llguidance.LLMatcher.grammar_from_regex(regex)
    if grammar is not None:
        text = str(grammar)
        if isinstance(grammar, Path) or (text.endswith(".lark") and "\n" not in text):
            text = _read(grammar, "grammar")
        return llguidance.LLMatcher.grammar_from_lark(text)
    return None


def _read(path, what: str) -> str:
    try:
        return Path(path).read_text()
    except OSError as e:
        raise ValueError(f"cannot read the {what} file {path}: {e.strerror or e}") from None


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: set[int]):
    """llguidance's view of a `tokenizers.Tokenizer` for a model of
    `vocab_size` tokens (ids the tokenizer does not have are never allowed)
    ending at `eos_ids`. Built once per runner: it indexes every token."""
    import llguidance

    return llguidance.LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=sorted(eos_ids) or None)


class TokenConstraint:
    """One generation's grammar state: the mask of the next token, advanced
    by each token generated."""

    def __init__(self, grammar: str, lltok):
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, lltok)
        if error:
            raise ValueError(f"the grammar is not valid: {error}")
        self.matcher = llguidance.LLMatcher(lltok, grammar)
        self._mask = torch.zeros(1, mask_words(lltok.vocab_size), dtype=torch.int32)

    def mask(self) -> torch.Tensor:
        """[1, ceil(V/32)] int32: the tokens allowed next."""
        size = self._mask.numel() * self._mask.element_size()
        self.matcher.unsafe_compute_mask_ptr(self._mask.data_ptr(), size)
        return self._mask

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")

    @property
    def finished(self) -> bool:
        """The grammar allows nothing more (but the end of generation)."""
        return self.matcher.is_stopped()
