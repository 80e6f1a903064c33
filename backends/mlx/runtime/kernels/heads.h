// Attention heads split out of a projection's output (HeadsNode): a model's
// slice, reshape, transpose and rotary embedding, four arrays and tasks per
// call for q and for k, as one kernel of ours.
#pragma once

#include <mlx/mlx.h>

#include <optional>

namespace emlx {

// Which columns of a projection's output hold the heads.
struct HeadColumns {
  int start = 0, heads = 0, head_dim = 0;
};

// What is done to each head: an RMS norm (weight [head_dim]), then a rotation.
struct HeadsOptions {
  std::optional<mlx::core::array> norm;
  float eps = 0.0f;
  std::optional<mlx::core::array> cos, sin;
};

// x [B, L, C] -> x[:, :, start:start + heads * head_dim] as [B, heads, L,
// head_dim], each head normalized as rms_norm() normalizes when a norm is
// given, then rotated as rope() rotates when cos and sin are (the same bits
// as those nodes). float32 on a CPU stream runs our kernel (a contiguous
// result); anything else MLX's views, rms_norm() and rope().
mlx::core::array heads(const mlx::core::array& x, HeadColumns columns, const HeadsOptions& options,
                       mlx::core::StreamOrDevice s = {});

}  // namespace emlx
