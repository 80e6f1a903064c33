// y = x @ w^T (+ bias): the linear layer, with CPU kernels of ours for
// float32 and bfloat16 weights and for MLX's affine 4- and 8-bit quantized
// weights (MLX's CPU matmul calls a single-threaded reference BLAS, and its
// CPU quantized_matmul is a scalar loop). Quantized weights: integer dot
// products on the packed rows for any number of rows of x (quantized_dot.h).
// Float weights: up to kDotRows (16) rows of x, dot products on the stored
// weights; more (prefill), OpenBLAS sgemm on tiles of them. Either way, up to
// kDotRows rows each row is computed as a one-row call computes it.
#pragma once

#include <mlx/mlx.h>

#include <optional>

namespace emlx {

// x [..., K], w [N, K], bias [N] -> [..., N]. On a CPU stream with float32
// or bfloat16 operands of one dtype it runs our multi-threaded kernel;
// anywhere else (GPUs, other dtypes) it is mlx::core::matmul with the same
// semantics.
mlx::core::array linear(const mlx::core::array& x, const mlx::core::array& w,
                        const std::optional<mlx::core::array>& bias, mlx::core::StreamOrDevice s = {});

// The same with w in MLX's affine quantized layout (mlx::core::quantize):
// w [N, K * bits / 32] packed 32-bit words, scales and biases [N, K / group_size].
// Our kernel on a CPU stream when x, scales (and bias) share a float32 or
// bfloat16 dtype; mlx::core::quantized_matmul otherwise.
mlx::core::array quantized_linear(const mlx::core::array& x, const mlx::core::array& w,
                                  const mlx::core::array& scales, const mlx::core::array& biases,
                                  const std::optional<mlx::core::array>& bias, int group_size, int bits,
                                  mlx::core::StreamOrDevice s = {});

// Throws std::invalid_argument naming `node` unless (w, scales, biases) is a
// valid quantization of an [N, K] matrix with these bits and group size.
void check_quantization(const char* node, const mlx::core::array& w, const mlx::core::array& scales,
                        const mlx::core::array& biases, int group_size, int bits, int K);

}  // namespace emlx
