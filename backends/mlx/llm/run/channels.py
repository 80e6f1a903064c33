"""gpt-oss answers in channels (OpenAI's harmony format):

    <|channel|>analysis<|message|>...thinking...<|end|><|start|>assistant<|channel|>final<|message|>Hi!<|return|>

Every marker is a special token, so a plain decode runs the channel names
into the text ("analysis...assistantfinalHi!"). FinalChannel picks, as the
tokens come, the ones that are the answer's content: the `final` channel's
message (and anything before a first channel marker). Tool calls, in the
`commentary` channel, are read from the whole answer (tool_calls.py).
"""

from __future__ import annotations

MARKERS = ("<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|return|>", "<|call|>")


class FinalChannel:
    """The content tokens of one answer, found incrementally."""

    def __init__(self, ids: dict[str, int], decode):
        """`ids`: MARKERS' token ids; `decode(ids) -> str` reads a channel's name."""
        self.ids, self.decode = ids, decode
        self.content: list[int] = []
        self.seen = 0  # tokens of the answer looked at
        self.state = "text"  # text (before any channel), name, body, header
        self.name: list[int] = []
        self.shown = True

    @classmethod
    def of(cls, source: str, tokenizer) -> FinalChannel | None:
        """One for a template that writes harmony and a tokenizer that has its markers, else None."""
        if "<|channel|>" not in source:
            return None
        ids = {m: tokenizer.token_to_id(m) for m in MARKERS}
        if any(i is None for i in ids.values()):
            return None
        return cls(ids, tokenizer.decode)

    def visible(self, ids: list[int]) -> list[int]:
        """The content tokens of `ids` (the answer so far; each call extends the last)."""
        marks = self.ids
        for token in ids[self.seen:]:
            if token == marks["<|channel|>"]:
                self.state, self.name = "name", []
            elif token == marks["<|message|>"]:
                words = self.decode(self.name).split()
                self.state, self.shown = "body", bool(words) and words[0] == "final"
            elif token in (marks["<|end|>"], marks["<|return|>"], marks["<|call|>"], marks["<|start|>"]):
                self.state = "header"  # the next message's role and channel
            elif self.state == "name":
                self.name.append(token)
            elif self.state == "text" or (self.state == "body" and self.shown):
                self.content.append(token)
        self.seen = len(ids)
        return self.content
