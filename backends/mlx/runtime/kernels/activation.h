// SiLU, x * sigmoid(x), alone or gating another tensor (a SwiGLU MLP's
// silu(gate) * up) with a CPU kernel of ours: MLX's CPU sigmoid is scalar
// there, and the composition is three arrays and tasks per call.
#pragma once

#include <mlx/mlx.h>

#include <optional>

namespace emlx {

// silu(a), times `b` (a's shape) when given. float32 on a CPU stream runs our
// kernel; anything else is MLX's ops.
mlx::core::array silu(const mlx::core::array& a, const std::optional<mlx::core::array>& b,
                      mlx::core::StreamOrDevice s = {});

// silu(a[..., :N]) * a[..., N:] for a [..., 2N] (gate and up side by side,
// a fused projection's output): the same values, bit for bit, as silu() of
// the two halves.
mlx::core::array silu_halves(const mlx::core::array& a, mlx::core::StreamOrDevice s = {});

}  // namespace emlx
