// Rotary position embedding as transformers applies it (RopeNode), with a
// CPU kernel of ours: composed from MLX ops it is seven arrays (two slices, a
// negation, a concatenation, two products and a sum), each a task scheduled
// per call, twice per layer.
#pragma once

#include <mlx/mlx.h>

namespace emlx {

// x * cos + rotate_half(x) * sin; x [..., D] with D even, cos and sin
// broadcastable to x with last axis D. float32 on a CPU stream runs our
// kernel (the same products and sums, so the same bits); anything else the
// MLX ops.
mlx::core::array rope(const mlx::core::array& x, const mlx::core::array& cos, const mlx::core::array& sin,
                      mlx::core::StreamOrDevice s = {});

}  // namespace emlx
