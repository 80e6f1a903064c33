// Float32 matrix products for the compositions of our kernels (the state
// scans' chunked forms). MLX's CPU matmul calls the single-threaded
// reference BLAS it links: the gated delta rule's chunked form spent 69% of
// a Qwen3.5-shaped prefill in it. Ours calls OpenBLAS's sgemm per matrix of
// the batch, the batch spread over our pool.
#pragma once

#include <mlx/mlx.h>

namespace emlx {

// a [..., M, K] @ b [..., K, N] (batch dims broadcast, as mlx::core::matmul).
// Our kernel on a CPU stream for float32 operands of rank >= 2; any strides
// (a transposed last pair of dims is read transposed, other layouts copied);
// mlx::core::matmul otherwise.
mlx::core::array matmul(const mlx::core::array& a, const mlx::core::array& b, mlx::core::StreamOrDevice s = {});

}  // namespace emlx
