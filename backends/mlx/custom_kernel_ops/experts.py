"""Mixture-of-experts linear layers: each row through the experts it was routed to.

    torch.ops.mlx.gather_linear(x, weight, indices, bias=None) -> [T, k, N]
    torch.ops.mlx.gather_quantized_linear(x, weight, scales, biases, indices, bias=None,
                                          group_size, bits, mode="affine") -> [T, k, N]

`indices` (integer [T, k]) names row t's k experts; `x` is [T, K] (each of
a row's experts sees the row) or [T, k, K] (expert j of row t sees x[t, j]);
`weight` is [E, N, K], one nn.Linear weight per expert (quantized: MLX's
packed layout per expert, as custom_kernel_ops/quantized.py, with scales
(and biases) [E, N, K / group_size]); `bias` is [E, N]:

    out[t, j] = x[t (, j)] @ weight[indices[t, j]]^T + bias[indices[t, j]]

One op is one IR node (lowering/ops_experts.py) that the runtime runs with
MLX's `gather_mm` / `gather_qmm`, which read only the experts a row uses;
the references below gather whole expert matrices in torch.
"""

from __future__ import annotations

import torch

from .quantized import dequantize

torch.library.define("mlx::gather_linear", "(Tensor x, Tensor weight, Tensor indices, Tensor? bias) -> Tensor")
torch.library.define(
    "mlx::gather_quantized_linear",
    "(Tensor x, Tensor weight, Tensor scales, Tensor? biases, Tensor indices, Tensor? bias, int group_size, "
    "int bits, str mode=\"affine\") -> Tensor",
)


def _gathered(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, bias) -> torch.Tensor:
    """out[t, j] = x[t (, j)] @ weights[t, j]^T + bias[indices[t, j]], weights [T, k, N, K] gathered."""
    rows = x.unsqueeze(1).expand(-1, indices.shape[1], -1) if x.dim() == 2 else x
    out = torch.einsum("tjk,tjnk->tjn", rows, weights.to(x.dtype))
    return out if bias is None else out + bias[indices].to(out.dtype)


@torch.library.impl("mlx::gather_linear", "CompositeExplicitAutograd")
def gather_linear_reference(x, weight, indices, bias):
    return _gathered(x, weight[indices], indices, bias)


@torch.library.register_fake("mlx::gather_linear")
def _gather_linear_fake(x, weight, indices, bias):
    return x.new_empty((x.shape[0], indices.shape[1], weight.shape[1]))


@torch.library.impl("mlx::gather_quantized_linear", "CompositeExplicitAutograd")
def gather_quantized_linear_reference(x, weight, scales, biases, indices, bias, group_size, bits, mode="affine"):
    # only the experts the rows use are dequantized
    rows = dequantize(weight[indices], scales[indices], None if biases is None else biases[indices], group_size, bits,
                      mode, x.dtype)
    return _gathered(x, rows, indices, bias)


@torch.library.register_fake("mlx::gather_quantized_linear")
def _gather_quantized_linear_fake(x, weight, scales, biases, indices, bias, group_size, bits, mode="affine"):
    return x.new_empty((x.shape[0], indices.shape[1], weight.shape[1]))
