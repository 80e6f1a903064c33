"""Text from users, checked before the work that grows with it.

A prompt is tokenized only if it could fit the context: a token of the
vocabulary covers at most `longest_token_bytes` bytes of text, so a text of
more than max_context times that many bytes cannot (a 100 MB message is
refused in microseconds, not tokenized for minutes into gigabytes). Text
must be valid Unicode: a lone surrogate (JSON's "\\ud800", or an undecodable
byte in a command line argument) is a ValueError naming where it is.
"""

from __future__ import annotations


class ContextLengthError(ValueError):
    """A prompt that cannot fit the program's context."""


def check_unicode(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{what}: not valid Unicode, a lone surrogate (U+{ord(text[e.start]):04X}) at "
                         f"character {e.start}") from None


def longest_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes one token's string takes: an upper bound of the
    text one token covers (a byte-level vocabulary's strings take 1-2 bytes
    a byte they stand for)."""
    return max((len(t.encode("utf-8", "surrogatepass")) for t in tokenizer.get_vocab(with_added_tokens=True)),
               default=1)


def check_fits(text: str, what: str, max_context: int, longest: int) -> None:
    """ContextLengthError if `text` takes at least `max_context` tokens
    whatever its tokenization (at most `longest` bytes a token)."""
    size = len(text.encode("utf-8"))
    least = -(-size // longest)
    if least >= max_context:
        raise ContextLengthError(f"the {what} is {size} bytes, at least {least} tokens (a token of this vocabulary "
                                 f"covers at most {longest} bytes); this model's context is {max_context} tokens")


def prefix_tail(text: str, strings: list[str]) -> int:
    """The length of the longest tail of `text` that is a proper prefix of one of `strings`."""
    longest = 0
    for s in strings:
        for k in range(min(len(s) - 1, len(text)), longest, -1):
            if text.endswith(s[:k]):
                longest = k
                break
    return longest
