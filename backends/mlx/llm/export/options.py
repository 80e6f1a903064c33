"""What `export_llm` writes, as one object: `ExportOptions`.

    from executorch_mlx.llm import ExportOptions, export_llm
    export_llm("MODEL_DIR", "model.pte", ExportOptions(max_context=512, quantize="int4"))

Each option is checked when the object is made, so a bad value is refused
before any weight is read; what depends on the model (its context length,
an already quantized folder) is checked by `export_llm`. The CLI's `export`
flags map one to one onto these fields.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..program_contract import MAX_TOP_LOGPROBS

# The most drafts one verify call takes: beyond a few, acceptance of the
# later ones is rare and each costs a row. With the token before them, at
# most kDotRows (runtime/kernels/cpu_kernel.h) rows, which the CPU kernels
# compute exactly as a decode step does.
MAX_DRAFT_TOKENS = 15
DEFAULT_DRAFT_TOKENS = 8
MAX_BATCH = 64  # sequences one batched program runs at once (export --max-batch)
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
# export --scales-dtype: bfloat16, or the program's dtype
SCALES_DTYPES = ("bf16", "dtype")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ExportOptions:
    """`max_context` is the KV cache length: prompt plus generated tokens never
    exceed it. A prompt prefills in chunks of at most max_context - 1 tokens;
    `max_context` above the model's max_position_embeddings needs
    `allow_longer_context`. `dtype` ("fp32", "fp16", "bf16") is the dtype the
    weights load in and the program computes in.

    `quantize` ("int2", "int3", "int4", "int5", "int6", "int8" or "mxfp4")
    stores every linear weight and the input embedding in MLX's affine
    layout with `group_size` values per scale and bias (default 64), or as
    MXFP4 (groups of 32; see llm/export/quantize.py). `quantize_embedding`
    False keeps the input embedding (and a head tied to it) at `dtype`; True
    requires it quantized; None (default) quantizes it when it can.
    `scales_dtype` is how export stores the scales and biases of the layers
    it quantizes (int2 ... int8): "bf16" (rounded to bfloat16, as MLX's own
    checkpoints of bfloat16 models hold them: 4.5 bits a weight at group 64
    instead of 5, for a rounding far below a quantization step) or "dtype"
    (in `dtype`, exactly as mlx.core.quantize gives them); None (default):
    "bf16", but "dtype" for fp16 programs (MLX's fp16 kernels would convert
    bfloat16 scales at every call). An mlx-lm folder's tables stay as they
    are either way. `activations` is how 4- and 8-bit layers meet x in our CPU kernel:
    "int8" (each group of x rounded to 8 bits, as llama.cpp does: faster) or
    "float" (x times the dequantized weights, as MLX's quantized_matmul and
    so mlx-lm compute); None (default): "float" for an mlx-lm folder, else
    "int8".

    A `sampling` program (the default; False returns the last position's
    logits) takes every sampler parameter at run time: the penalties count
    the last tokens of a `history_size`-token history, and up to
    `logit_bias_size` tokens get a logit bias; `logprobs` adds the chosen
    token's log-probability as a second output, and `top_logprobs` K (at most
    20; it implies `logprobs`) the K most likely tokens and their
    log-probabilities at each step as third and fourth. `token_mask` (the
    default) adds the token bitmask input that structured output fills with
    a grammar's allowed tokens (docs/sampling.md step 1). A sampling program
    verifies up to `max_draft_tokens` draft tokens per call (speculative
    decoding, llm/export/speculative.py; 0: none; None (default): 8, or what
    a small context leaves room for). `max_batch` N > 1 writes a program that
    runs up to N sequences at once, each in its own cache row
    (llm/export/batched.py; it verifies no drafts).

    `external_weights` writes the weights to ExecuTorch's data file beside
    the program (model.pte: model.ptd), which the runners load with it."""

    max_context: int = 256
    dtype: str = "fp32"
    allow_longer_context: bool = False
    quantize: str | None = None
    group_size: int | None = None
    quantize_embedding: bool | None = None
    activations: str | None = None
    scales_dtype: str | None = None
    sampling: bool = True
    history_size: int = 64
    logit_bias_size: int = 16
    logprobs: bool = False
    top_logprobs: int = 0
    token_mask: bool = True
    max_draft_tokens: int | None = None
    max_batch: int = 1
    external_weights: bool = False

    def __post_init__(self) -> None:
        from ...custom_kernel_ops.quantized import check_activations

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if not _is_int(self.max_context) or not 2 <= self.max_context <= 1 << 20:
            raise ValueError(f"max_context must be in [2, 2**20], got {self.max_context!r}")
        if self.quant_format is None and self.quantize_embedding:  # (quant_format refuses a bad quantize)
            raise ValueError("quantize_embedding needs quantize (int2 ... int8, mxfp4)")
        if self.activations is not None:
            check_activations(self.activations)
        if self.scales_dtype not in (None, *SCALES_DTYPES):
            raise ValueError(f"scales_dtype must be one of {', '.join(SCALES_DTYPES)}, got {self.scales_dtype!r}")
        if self.scales_dtype is not None and (self.quantize is None or self.quantize == "mxfp4"):
            raise ValueError("scales_dtype needs quantize int2 ... int8 (mxfp4's scales are exponents)")
        if self.sampling and not (1 <= self.history_size <= 4096 and 1 <= self.logit_bias_size <= 4096):
            raise ValueError(f"history_size and logit_bias_size must be in [1, 4096], got {self.history_size} and "
                             f"{self.logit_bias_size}")
        if not _is_int(self.top_logprobs) or not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs!r}")
        if self.top_logprobs and not self.sampling:
            raise ValueError("top_logprobs needs a sampling program (a --no-sampling program returns the logits)")
        if not _is_int(self.max_batch) or not 1 <= self.max_batch <= MAX_BATCH:
            raise ValueError(f"max_batch must be in [1, {MAX_BATCH}], got {self.max_batch!r}")
        if self.max_batch > 1 and not self.sampling:
            raise ValueError("max_batch needs a sampling program (a --no-sampling program returns one row's logits)")
        if self.max_batch > 1 and self.max_draft_tokens:
            raise ValueError("a batched program verifies no drafts: give max_draft_tokens 0 (or leave it out) with "
                             "max_batch")
        most = min(MAX_DRAFT_TOKENS, self.max_context - 2)
        if self.max_draft_tokens is not None and (not _is_int(self.max_draft_tokens) or
                                                  not 0 <= self.max_draft_tokens <= most):
            raise ValueError(f"max_draft_tokens must be in [0, {most}] (a verify call fits in the context with the "
                             f"token before the drafts), got {self.max_draft_tokens!r}")

    @property
    def quant_format(self):
        """`quantize` and `group_size` as a QuantFormat, or None (no quantize)."""
        from .quantize import quantize_format

        if self.quantize is None:
            return None
        fmt = quantize_format(self.quantize, self.group_size)
        scales = self.scales_dtype or ("dtype" if self.dtype == "fp16" else "bf16")
        return replace(fmt, bf16_params=True) if fmt.mode == "affine" and scales == "bf16" else fmt

    @property
    def drafts(self) -> int:
        """The drafts one call verifies: max_draft_tokens, or its default."""
        if not self.sampling:
            return 0  # a logits program returns the last position only
        if self.max_draft_tokens is not None:
            return self.max_draft_tokens
        return 0 if self.max_batch > 1 else min(DEFAULT_DRAFT_TOKENS, self.max_context - 2)

    @property
    def with_logprobs(self) -> bool:
        """Whether the program returns log-probabilities (top_logprobs implies them)."""
        return self.sampling and (self.logprobs or bool(self.top_logprobs))
