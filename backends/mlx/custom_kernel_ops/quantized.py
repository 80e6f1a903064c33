"""Weight-only quantized linear and embedding in MLX's affine layout.

    torch.ops.mlx.quantized_linear(x[..., K], weight, scales, biases, bias=None,
                                   group_size, bits) -> [..., N]
    torch.ops.mlx.quantized_embedding(ids[...], weight, scales, biases,
                                      group_size, bits) -> [..., K]

`weight` is int32 [N, K * bits / 32]: the packed uint32 words of
`mlx.core.quantize`, a little-endian stream of bits per row (value i at
bits i * bits .. (i + 1) * bits - 1; for 2, 4 and 8 bits each word holds
whole values, for 3, 5 and 6 bits values cross bytes), reinterpreted as
int32 because torch has no uint32 arithmetic. `scales` and `biases` are [N, K / group_size];
w = q * scale + bias per group. The CPU references below dequantize in
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

import torch

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)

torch.library.define(
    "mlx::quantized_linear",
    "(Tensor x, Tensor weight, Tensor scales, Tensor biases, Tensor? bias, int group_size, int bits) -> Tensor",
)
torch.library.define(
    "mlx::quantized_embedding",
    "(Tensor ids, Tensor weight, Tensor scales, Tensor biases, int group_size, int bits) -> Tensor",
)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, group_size: int,
               bits: int) -> torch.Tensor:
    """[..., K] in scales' dtype from packed [..., K * bits / 32] words (as mlx.core.dequantize)."""
    if 32 % bits == 0:
        shifts = torch.arange(32 // bits, dtype=torch.int32) * bits
        q = (weight.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # the mask undoes int32 sign extension
    else:  # values cross bytes: read the row's bit stream
        stream = (weight.contiguous().view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1
        stream = stream.reshape(*weight.shape[:-1], -1, bits).to(torch.int32)
        q = (stream << torch.arange(bits, dtype=torch.int32)).sum(-1)
    q = q.reshape(*weight.shape[:-1], -1, group_size).to(torch.float32)
    w = q * scales.to(torch.float32).unsqueeze(-1) + biases.to(torch.float32).unsqueeze(-1)
    return w.flatten(-2).to(scales.dtype)


def _in_features(weight: torch.Tensor, bits: int) -> int:
    return weight.shape[-1] * 32 // bits


@torch.library.impl("mlx::quantized_linear", "CompositeExplicitAutograd")
def quantized_linear_reference(x, weight, scales, biases, bias, group_size, bits):
    w = dequantize(weight, scales, biases, group_size, bits).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


@torch.library.register_fake("mlx::quantized_linear")
def _quantized_linear_fake(x, weight, scales, biases, bias, group_size, bits):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


@torch.library.impl("mlx::quantized_embedding", "CompositeExplicitAutograd")
def quantized_embedding_reference(ids, weight, scales, biases, group_size, bits):
    return dequantize(weight[ids], scales[ids], biases[ids], group_size, bits)


@torch.library.register_fake("mlx::quantized_embedding")
def _quantized_embedding_fake(ids, weight, scales, biases, group_size, bits):
    return scales.new_empty((*ids.shape, _in_features(weight, bits)))
