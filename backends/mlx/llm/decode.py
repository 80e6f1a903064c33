"""Step-by-step decoding of a SamplingHead .pte through ExecuTorch's runtime.

Each step feeds the model its token window, gets one sampled id per row
back (no logits cross to the host) and appends it to the window.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .sampling import sampling_inputs

# ExecuTorch's ScalarType codes
_DTYPES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
           6: torch.float32, 7: torch.float64, 11: torch.bool, 15: torch.bfloat16}


@dataclass
class DecodeResult:
    tokens: torch.Tensor  # [B, steps] int64
    step_seconds: list[float] = field(default_factory=list)


class SampledDecoder:
    """Runs a program exported by `export_sampling_head` (or `export_greedy_head`).

    The program's first input is the model's token window [B, S]; the rest
    are the sampling inputs (see llm/sampling.py for their order).
    """

    def __init__(self, program: bytes | str | Path, method: str = "forward"):
        import executorch_mlx  # noqa: F401  (registers the backend)
        from executorch.runtime import Runtime

        data = program if isinstance(program, (bytes, bytearray)) else Path(program).read_bytes()
        # Keep the Program: a Method does not keep its Program alive.
        self.program = Runtime.get().load_program(bytes(data))
        meta = self.program.metadata(method)
        self.method = self.program.load_method(method)
        self.num_inputs = meta.num_inputs()
        # A sampling/greedy head takes a window [B, S] and returns int64 ids [B].
        window, out = meta.input_tensor_meta(0), meta.output_tensor_meta(0)
        if (meta.num_outputs() != 1 or _DTYPES.get(out.dtype()) != torch.int64 or len(window.sizes()) != 2
                or tuple(out.sizes()) != tuple(window.sizes()[:1])):
            raise ValueError(f"{method} is not a sampling head: expected a window [B, S] in and int64 ids [B] "
                             "out (export it with export_sampling_head or export_greedy_head)")
        self.window_dtype = _DTYPES.get(window.dtype())
        self.batch, self.window = (int(s) for s in window.sizes())
        # [] or [B] per sampling input, as exported (per_row or not)
        self.param_shapes = [tuple(meta.input_tensor_meta(i).sizes()) for i in range(1, meta.num_inputs())]
        self.seeded = self.num_inputs == 4
        self.greedy_only = self.num_inputs == 1
        if self.num_inputs not in (1, 2, 4):
            raise ValueError(
                f"{method} has {self.num_inputs} inputs; expected tokens [+ temperature [+ seed, position]]"
            )

    def step(self, tokens: torch.Tensor, temperature=1.0, seed=None, position=None) -> torch.Tensor:
        """One decode step: the sampled id of each row, int64 [B]."""
        if not isinstance(tokens, torch.Tensor) or tokens.dtype != self.window_dtype:
            raise TypeError(f"tokens must be a {self.window_dtype} tensor (as exported), got "
                            f"{getattr(tokens, 'dtype', type(tokens).__name__)}")
        if tokens.shape != (self.batch, self.window):
            raise ValueError(f"tokens must be [{self.batch}, {self.window}], got {list(tokens.shape)}")
        if self.greedy_only:
            inputs = [tokens]
        else:
            if self.seeded and seed is None:
                raise ValueError("this program is seeded: pass a seed")
            if not self.seeded and seed is not None:
                raise ValueError("this program was exported without a seed input; re-export with seeded=True")
            kwargs = sampling_inputs(self.batch, temperature, seed, position)
            inputs = [tokens]
            for (name, value), shape in zip(kwargs.items(), self.param_shapes):
                if value.shape != shape:
                    if shape != (self.batch,) or value.dim() != 0:
                        raise ValueError(f"{name} must have shape {list(shape)} for this program")
                    value = value.expand(shape).contiguous()  # one value for every row
                inputs.append(value)
        ids = self.method.execute(inputs)[0]
        bad = (ids < 0).nonzero().flatten().tolist()
        if bad:
            raise RuntimeError(f"rows {bad} have no finite logits: nothing to sample")
        return ids

    def generate(self, prompt: torch.Tensor, steps: int, temperature=1.0, seed=None) -> DecodeResult:
        """Decodes `steps` tokens after `prompt` ([B, S] int64, S = window).

        Seeded runs use position = step index, so the same (seed, prompt)
        reproduces the same tokens.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        window = prompt.clone()
        out, times = [], []
        for step in range(steps):
            t0 = time.perf_counter()
            ids = self.step(window, temperature, seed, step if seed is not None else None)
            times.append(time.perf_counter() - t0)
            out.append(ids)
            window = torch.cat([window[:, 1:], ids[:, None]], dim=1)
        return DecodeResult(torch.stack(out, dim=1), times)
