// Rotary position embedding as transformers applies it (RopeNode), with a
// CPU kernel of ours: composed from MLX ops it is seven arrays (two slices, a
// negation, a concatenation, two products and a sum), each a task scheduled
// per call, twice per layer.
#pragma once

#include <mlx/mlx.h>

#include <cstdint>
#include <string>

namespace emlx {

// A run of floats `stride` elements apart.
struct Strided {
  const float* p;
  int64_t stride;
};

// One row of D values rotated: out = x * cos + rotate_half(x) * sin (the
// RopeNode kernel's arithmetic, shared by HeadsNode's so that both give the
// same bits).
void rotate_row(Strided x, Strided cos, Strided sin, int64_t D, float* out);

// Refuses cos and sin that do not broadcast to `x` (its last axis even,
// theirs the same), naming `node`.
void check_rotation(const mlx::core::Shape& x, const mlx::core::array& cos, const mlx::core::array& sin,
                    const std::string& node);

// x * cos + rotate_half(x) * sin; x [..., D] with D even, cos and sin
// broadcastable to x with last axis D. float32 on a CPU stream runs our
// kernel (the same products and sums, so the same bits); anything else the
// MLX ops.
mlx::core::array rope(const mlx::core::array& x, const mlx::core::array& cos, const mlx::core::array& sin,
                      mlx::core::StreamOrDevice s = {});

}  // namespace emlx
