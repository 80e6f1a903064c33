// Scaled dot-product attention with a CPU kernel of ours: MLX's CPU path
// composes it from matmuls on a single-threaded reference BLAS, which makes a
// long prompt's prefill spend most of its time in attention.
#pragma once

#include <mlx/mlx.h>

#include <optional>

namespace emlx {

struct AttentionOptions {
  float scale = 1.0f;
  bool causal = false;
  // Broadcastable to [B, H, L, S]: boolean (true = attend) or additive.
  std::optional<mlx::core::array> mask;
  // A 0-d integer n: only the first n slots of k and v (and of the mask's
  // last axis) are attended, clamped into [0, S]. The kernel reads it when
  // it runs, so building the graph never waits for it.
  std::optional<mlx::core::array> keys;
  // The output as [B, L, H * Dv] (heads side by side), not [B, H, L, Dv].
  bool merge_heads = false;
};

// q [B, H, L, D], k [B, Hkv, S, D], v [B, Hkv, S, Dv] (H a multiple of Hkv).
// float32 without `causal` on a CPU stream runs our kernel (OpenBLAS GEMMs per
// block of queries, key columns that no query of the block attends skipped;
// up to kDotRows queries, vectorized dot products, a kv head's keys read once
// for all its query heads);
// a query that attends no key gets zeros, as in torch (MLX's own path gives
// NaN). Anything else is mlx::core::fast::scaled_dot_product_attention.
mlx::core::array attention(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                           const AttentionOptions& options, mlx::core::StreamOrDevice s = {});

}  // namespace emlx
