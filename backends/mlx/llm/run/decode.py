"""Step-by-step decoding of a SamplingHead .pte, torch tensors in and out.

Each step feeds the model its token window, gets one sampled id per row
back (no logits cross to the host) and appends it to the window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..program_contract import NoContract
from .program_runner import ProgramRunner
from ..sampler_inputs import SAMPLER_INPUTS, sampling_inputs


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # [B, steps] int64
    step_seconds: list[float] = field(default_factory=list)


class SampledDecoder(ProgramRunner):
    """Runs a program exported by `export_sampling_head` (or `export_greedy_head`).

    The program's first input is the model's token window [B, S]; the
    sampling inputs are found by name (llm/program_contract.py).
    """

    def __init__(self, program: bytes | str | Path, method: str = "forward"):
        hint = "export it with export_sampling_head or export_greedy_head"
        try:
            super().__init__(program, method, hint=f"({hint})")
        except NoContract:
            raise ValueError(f"{method} is not a sampling head: the program has no emlx_input_names metadata "
                             f"({hint})") from None
        c = self.contract
        names = c.input_names
        # A sampling/greedy head takes a window [B, S] and returns int64 ids [B].
        window = c.input_shapes[names[0]]
        if (len(c.output_dtypes) != 1 + self.logprobs or c.output_dtypes[0] != np.int64 or len(window) != 2
                or c.output_shapes[0] != window[:1] or any(n not in SAMPLER_INPUTS for n in names[1:])):
            raise ValueError(f"{method} is not a sampling head: expected a window [B, S] and sampling inputs in, "
                             f"int64 ids [B] out ({hint})")
        self.window_dtype = getattr(torch, str(c.input_dtypes[names[0]]))
        self.batch, self.window = (int(s) for s in window)
        self.input_names = names[1:]
        self.seeded = "seed" in self.input_names
        self.greedy_only = not self.input_names

    def step(self, tokens: torch.Tensor, temperature=1.0, seed=None, position=None, **params) -> torch.Tensor:
        """One decode step: the sampled id of each row, int64 [B] (and their
        logprobs [B] for a program exported with logprobs=True).

        `params` are the sampler table's parameters by name (row
        parameters and tables); the program must take each one given; those
        not given are off."""
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != self.window_dtype:
            raise TypeError(f"tokens must be a {self.window_dtype} tensor (as exported), got "
                            f"{getattr(tokens, 'dtype', type(tokens).__name__)}")
        if tokens.shape != (self.batch, self.window):
            raise ValueError(f"tokens must be [{self.batch}, {self.window}], got {list(tokens.shape)}")
        if self.greedy_only and (seed is not None or params):
            raise ValueError("this is a greedy program: it takes no sampling parameters")
        inputs = [tokens]
        if not self.greedy_only:
            if not self.seeded and seed is not None:
                raise ValueError("this program was exported without a seed input; re-export with seeded=True")
            given = sampling_inputs(self.batch, temperature, seed, position, **params)
            inputs += self.sampler_values(self.input_names, given)
        outputs = [torch.from_numpy(o) for o in self.execute(inputs)]
        ids = outputs[0]
        bad = (ids < 0).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(f"rows {bad} have no finite logits: nothing to sample")
        return (ids, outputs[1]) if self.logprobs else ids

    def generate(self, prompt: torch.Tensor, steps: int, temperature=1.0, seed=None, **params) -> DecodeResult:
        """Decodes `steps` tokens after `prompt` ([B, S] int64, S = window).

        Seeded runs use position = step index, so the same (seed, prompt)
        reproduces the same tokens. A program with a history input is given
        the window's tokens (the penalties count them)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        window = prompt.clone()
        out, times = [], []
        for step in range(steps):
            if "history" in self.input_names and "history" not in params:
                step_params = {**params, "history": window.to(torch.int64)}
            else:
                step_params = params
            t0 = time.perf_counter()
            ids = self.step(window, temperature, seed, step if seed is not None else None, **step_params)
            ids = ids[0] if self.logprobs else ids
            times.append(time.perf_counter() - t0)
            out.append(ids)
            window = torch.cat([window[:, 1:], ids[:, None].to(window.dtype)], dim=1)
        return DecodeResult(torch.stack(out, dim=1), times)
