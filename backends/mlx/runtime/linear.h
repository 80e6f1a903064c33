// y = x @ w^T (+ bias): the linear layer, with a CPU kernel of ours for
// float32 (MLX's CPU matmul calls a single-threaded reference BLAS).
#pragma once

#include <mlx/mlx.h>

#include <optional>

namespace emlx {

// x [..., K], w [N, K], bias [N] -> [..., N]. On the CPU with float32
// operands it runs our multi-threaded kernel; anywhere else (GPUs, other
// dtypes) it is mlx::core::matmul with the same semantics.
mlx::core::array linear(const mlx::core::array& x, const mlx::core::array& w,
                        const std::optional<mlx::core::array>& bias);

// The MLX-ops path of linear(), always (for tests: both paths must agree).
mlx::core::array linear_reference(const mlx::core::array& x, const mlx::core::array& w,
                                  const std::optional<mlx::core::array>& bias);

}  // namespace emlx
