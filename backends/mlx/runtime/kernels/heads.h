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

// A KV cache the heads are written into: cache [B, heads, S, head_dim],
// slots [L] (clamped into [0, S)).
struct HeadsCache {
  mlx::core::array cache, slots;
};

// cache_write(cache, slots, heads(x, columns, options)) (cache_write.h),
// the same values: on a CPU stream with a float32 cache one kernel of ours
// that writes each head into its slot (in place when nothing else holds
// the cache); anything else those two ops.
mlx::core::array heads_into_cache(const mlx::core::array& x, HeadColumns columns, const HeadsOptions& options,
                                  const HeadsCache& target, mlx::core::StreamOrDevice s = {});

}  // namespace emlx
