// RMS normalization, x * rsqrt(mean(x^2 over the last axis) + eps) (* weight),
// with a CPU kernel of ours: MLX's CPU backend has no fused rms_norm
// (mlx::core::fast::rms_norm falls back to seven ops there, each an array and
// a scheduled task per call), and a decoder runs two per layer.
#pragma once

#include <mlx/mlx.h>

#include <cstdint>
#include <optional>

namespace emlx {

// x [..., D], weight [D] or none. float32 on a CPU stream runs our kernel
// (models in bfloat16 normalize in float32 too); anything else is
// mlx::core::fast::rms_norm.
// One contiguous row of D values normalized into `out` (weight [D] or
// null): the kernel's arithmetic, shared by HeadsNode's so that both give
// the same bits.
void normalize_row(const float* x, const float* weight, float eps, int64_t D, float* out);

mlx::core::array rms_norm(const mlx::core::array& x, const std::optional<mlx::core::array>& weight, float eps,
                          mlx::core::StreamOrDevice s = {});

}  // namespace emlx
