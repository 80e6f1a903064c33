// The sampler of SAMPLING.md as one graph node: penalties, logit bias,
// greedy, top-k / min-p / top-p and an exact draw. On the CPU a native MLX
// primitive of ours does each row in a few passes; anywhere else (Apple and
// CUDA GPUs) the same semantics run as MLX ops.
#pragma once

#include <mlx/mlx.h>

#include <optional>

namespace emlx {

struct SampleInputs {
  mlx::core::array logits;       // [B, V] floating point
  mlx::core::array temperature;  // [] or [B]; <= 0 or NaN: greedy
  mlx::core::array random;       // [B, 2] uint32: the row's random words
  // What `random` was drawn from, when seeded ([] or [B] int64 each): the
  // native kernel derives the same words (MLX's threefry) without it.
  std::optional<mlx::core::array> seed, position;
  std::optional<mlx::core::array> top_k, top_p, min_p;  // [] or [B] each
  std::optional<mlx::core::array> repetition_penalty, frequency_penalty, presence_penalty;
  std::optional<mlx::core::array> history;                        // [B, H] token ids, -1 padding
  std::optional<mlx::core::array> logit_bias_ids, logit_bias_values;  // [B, N] each, -1 padding
};

// int64 [B]: the native kernel on the CPU (unless EMLX_DISABLE_CPU_KERNELS
// is set), sample_reference() elsewhere. Throws std::invalid_argument on
// shapes or dtypes that do not fit.
mlx::core::array sample(const SampleInputs& in);

// The MLX-ops path of sample(), always (tests run both against SAMPLING.md).
mlx::core::array sample_reference(const SampleInputs& in);

}  // namespace emlx
