"""Step-by-step decoding of a SamplingHead .pte through ExecuTorch's runtime.

Each step feeds the model its token window, gets one sampled id per row
back (no logits cross to the host) and appends it to the window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .sampling import SAMPLER_INPUTS, program_inputs, sampling_inputs

# ExecuTorch's ScalarType codes
_DTYPES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
           6: torch.float32, 7: torch.float64, 11: torch.bool, 15: torch.bfloat16}


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # [B, steps] int64
    step_seconds: list[float] = field(default_factory=list)


class SampledDecoder:
    """Runs a program exported by `export_sampling_head` (or `export_greedy_head`).

    The program's first input is the model's token window [B, S]; the
    sampling inputs are found by name (the `emlx_input_names` metadata).
    """

    def __init__(self, program: bytes | str | Path, method: str = "forward"):
        import executorch_mlx  # noqa: F401  (registers the backend)
        from executorch.runtime import Runtime

        data = program if isinstance(program, (bytes, bytearray)) else Path(program).read_bytes()
        # Keep the Program: a Method does not keep its Program alive.
        self.program = Runtime.get().load_program(bytes(data))
        if "emlx_input_names" not in self.program.method_names:
            raise ValueError(f"{method} is not a sampling head: the program has no emlx_input_names metadata "
                             "(export it with export_sampling_head or export_greedy_head)")
        names = self.program.load_method("emlx_input_names").execute([])[0].split(",")
        self.logprobs = bool(self.program.load_method("emlx_logprobs").execute([])[0])
        meta = self.program.metadata(method)
        self.method = self.program.load_method(method)
        # A sampling/greedy head takes a window [B, S] and returns int64 ids [B].
        window, out = meta.input_tensor_meta(0), meta.output_tensor_meta(0)
        if (meta.num_outputs() != 1 + self.logprobs or _DTYPES.get(out.dtype()) != torch.int64
                or len(window.sizes()) != 2 or tuple(out.sizes()) != tuple(window.sizes()[:1])
                or len(names) != meta.num_inputs() or any(n not in SAMPLER_INPUTS for n in names[1:])):
            raise ValueError(f"{method} is not a sampling head: expected a window [B, S] and sampling inputs in, "
                             "int64 ids [B] out (export it with export_sampling_head or export_greedy_head)")
        self.window_dtype = _DTYPES.get(window.dtype())
        self.batch, self.window = (int(s) for s in window.sizes())
        self.input_names = names[1:]
        self.input_shapes = {n: tuple(meta.input_tensor_meta(i + 1).sizes()) for i, n in enumerate(names[1:])}
        self.seeded = "seed" in self.input_names
        self.greedy_only = not self.input_names

    def step(self, tokens: torch.Tensor, temperature=1.0, seed=None, position=None, **params) -> torch.Tensor:
        """One decode step: the sampled id of each row, int64 [B] (and their
        logprobs [B] for a program exported with logprobs=True).

        `params` are the sampling parameters by name (top_k, top_p, min_p,
        repetition_penalty, ..., history, logit_bias_ids, logit_bias_values);
        the program must take each one given; those not given are off."""
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
            inputs += program_inputs(self.input_names, self.input_shapes, given)
        outputs = self.method.execute(inputs)
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
