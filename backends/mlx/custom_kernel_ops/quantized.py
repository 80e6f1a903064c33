"""Weight-only quantized linear and embedding in MLX's quantized layouts.

    torch.ops.mlx.quantized_linear(x[..., K], weight, scales, biases, bias=None,
                                   group_size, bits, mode="affine") -> [..., N]
    torch.ops.mlx.quantized_embedding(ids[...], weight, scales, biases,
                                      group_size, bits, mode="affine", dtype=None) -> [..., K]

`weight` is int32 [N, K * bits / 32]: the packed uint32 words of
`mlx.core.quantize`, a little-endian stream of bits per row (value i at
bits i * bits .. (i + 1) * bits - 1; for 2, 4 and 8 bits each word holds
whole values, for 3, 5 and 6 bits values cross bytes), reinterpreted as
int32 because torch has no uint32 arithmetic. `scales` and `biases` are [N, K / group_size].
`mode` is how the values decode (mlx.core.quantize's modes):
  affine: w = q * scale + bias per group, scales and biases in the model's float type;
  mxfp4: 4-bit E2M1 floats in groups of 32 (the OCP microscaling format
    gpt-oss ships), w = fp4 * 2^(scale - 127), scales uint8 (E8M0), biases None;
    the embedding's rows come out in `dtype`.
The CPU references below dequantize in
torch; the lowering (`lowering/ops_quantized.py`) emits one IR node each,
which the runtime runs with our CPU kernel or `mlx::core::quantized_matmul`
/ `dequantize`.

Why custom ops rather than torchao's quantized patterns: one op is one node
in the exported graph, so torch.export, the partitioner and the handler see
the whole layer at once (no pattern of unpack/dequantize/matmul to match
and keep from being decomposed), and the packed layout is MLX's own, so the
runtime never repacks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
# mode -> the (group size, bits) it fixes; affine takes any of the above
MODES = {"affine": None, "mxfp4": (32, 4)}
# the 16 E2M1 codes: sign bit, 2 exponent bits, 1 mantissa bit
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

torch.library.define(
    "mlx::quantized_linear",
    "(Tensor x, Tensor weight, Tensor scales, Tensor? biases, Tensor? bias, int group_size, int bits, "
    "str mode=\"affine\") -> Tensor",
)
torch.library.define(
    "mlx::quantized_embedding",
    "(Tensor ids, Tensor weight, Tensor scales, Tensor? biases, int group_size, int bits, str mode=\"affine\", "
    "ScalarType? dtype=None) -> Tensor",
)


# How the runtime's CPU kernel meets x in a 4- or 8-bit affine layer (a
# choice made at export, QuantizedLinearNode's float_activations): "int8"
# rounds each group of x to 8 bits and multiplies in integers (llama.cpp's
# way, the faster); "float" multiplies x by the dequantized weights
# (mlx.core.quantized_matmul's way, so mlx-lm's, and the references' below).
ACTIVATIONS = ("int8", "float")


def check_activations(activations: str) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"activations must be one of {', '.join(ACTIVATIONS)}, got {activations!r}")


def check_mode(mode: str, group_size: int, bits: int) -> None:
    """A quantization the ops (and MLX) have: a known mode, and the group size and bits it allows."""
    if mode not in MODES:
        raise ValueError(f"quantization mode must be one of {', '.join(MODES)}, got {mode!r}")
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    fixed = MODES[mode]
    if fixed is not None and (group_size, bits) != fixed:
        raise ValueError(f"{mode} is {fixed[1]}-bit in groups of {fixed[0]}, got {bits} bits in groups of {group_size}")


@dataclass(frozen=True)
class QuantFormat:
    """How a matrix is stored: MLX's mode, bits per value, values per scale;
    `bf16_params`: affine scales and biases stored as bfloat16 (else in the
    quantized weight's dtype)."""

    bits: int
    group_size: int
    mode: str = "affine"
    bf16_params: bool = False

    def __post_init__(self):
        check_mode(self.mode, self.group_size, self.bits)
        if self.bf16_params and self.mode != "affine":
            raise ValueError(f"{self.mode} has no float scales to store as bfloat16")

    def __str__(self) -> str:
        return self.mode if self.mode != "affine" else f"int{self.bits} group {self.group_size}"


def dequantize(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor | None, group_size: int,
               bits: int, mode: str = "affine", dtype: torch.dtype | None = None) -> torch.Tensor:
    """[..., K] from packed [..., K * bits / 32] words (as mlx.core.dequantize), in
    `dtype` (default: affine, the scales' dtype; mxfp4, float32), computed in float32."""
    check_mode(mode, group_size, bits)
    if 32 % bits == 0:
        shifts = torch.arange(32 // bits, dtype=torch.int32) * bits
        q = (weight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # the mask undoes int32 sign extension
    else:  # values cross bytes: read the row's bit stream
        stream = (weight.contiguous().view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        stream = stream.reshape(*weight.shape[:-1], -1, bits).to(torch.int32)
        q = (stream << torch.arange(bits, dtype=torch.int32)).sum(-1)
    q = q.reshape(*weight.shape[:-1], -1, group_size)
    if mode == "mxfp4":
        scale = torch.ldexp(torch.ones(scales.shape), scales.to(torch.int32) - 127).unsqueeze(-1)  # exact powers of 2
        return (torch.tensor(FP4_VALUES)[q] * scale).flatten(-2).to(dtype or torch.float32)
    w = q.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1) + biases.to(torch.float32).unsqueeze(-1)
    return w.flatten(-2).to(dtype or scales.dtype)


def _in_features(weight: torch.Tensor, bits: int) -> int:
    return weight.shape[-1] * 32 // bits


@torch.library.impl("mlx::quantized_linear", "CompositeExplicitAutograd")
def quantized_linear_reference(x, weight, scales, biases, bias, group_size, bits, mode="affine"):
    w = dequantize(weight, scales, biases, group_size, bits, mode, x.dtype).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


@torch.library.register_fake("mlx::quantized_linear")
def _quantized_linear_fake(x, weight, scales, biases, bias, group_size, bits, mode="affine"):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.impl("mlx::quantized_embedding", "CompositeExplicitAutograd")
def quantized_embedding_reference(ids, weight, scales, biases, group_size, bits, mode="affine", dtype=None):
    return dequantize(weight[ids], scales[ids], None if biases is None else biases[ids], group_size, bits, mode,
                      dtype)


@torch.library.register_fake("mlx::quantized_embedding")
def _quantized_embedding_fake(ids, weight, scales, biases, group_size, bits, mode="affine", dtype=None):
    out = dtype or (scales.dtype if mode == "affine" else torch.float32)
    return scales.new_empty((*ids.shape, _in_features(weight, bits)), dtype=out)
