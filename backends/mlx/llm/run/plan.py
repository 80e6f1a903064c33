"""One generation, checked before it runs.

    plan = runner.prepare("Once upon a time", max_new_tokens=32, temperature=0.8, seed=42, stop=["\\n"])
    result = runner.run(plan, on_text=print)

`LLMRunner.prepare` checks every argument once, tokenizes the prompt, builds
the sampler's inputs, compiles the grammar and makes the drafter; `run`
executes it (`generate` is the two in one). The server prepares a request
while it parses it, off the event loop, so that nothing is checked or
compiled twice. The grammar's matcher and the drafter keep state as they
run: a plan runs once, on the runner that prepared it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class Plan:
    prompt_ids: list[int]
    max_new_tokens: int
    # the sampler's inputs by name; the decode loop sets the position, the
    # penalty history and the token mask of each step
    sampling: dict[str, np.ndarray]
    window: int  # tokens of history the penalties count (0: no penalties)
    stops: list[str]
    constraint: object | None = None  # grammar.TokenConstraint
    drafter: object | None = None  # drafting.PromptLookup or DraftModel
    draft_length: object | None = None  # drafting.DraftLength
    tool_use: object | None = None  # tool_calls.ToolUse: the answer's calls are read
    runner: object = field(default=None, repr=False)  # the LLMRunner that prepared it
    _ran: bool = field(default=False, repr=False)

    def claim(self, runner) -> None:
        """Marks the plan run by `runner`; ValueError if it cannot be."""
        if self.runner is not runner:
            raise ValueError("this plan was prepared by another runner")
        if self._ran:
            raise ValueError("a plan runs once (its grammar and drafter keep state): prepare another")
        self._ran = True
