// The sampler of docs/sampling.md as one graph node: penalties, logit bias,
// greedy, top-k / min-p / top-p and an exact draw. On the CPU a native MLX
// primitive of ours does each row in a few passes; anywhere else (Apple and
// CUDA GPUs) the same semantics run as MLX ops.
#pragma once

#include <mlx/mlx.h>

#include <optional>

#include "generated/sample_inputs.h"  // SampleInputs, Param: from schema.fbs

namespace emlx {

// int64 [B], built on the thread's default stream: the native kernel on a
// CPU stream (unless EMLX_DISABLE_CPU_KERNELS is set), the MLX ops elsewhere
// (tests hold both to docs/sampling.md). Throws std::invalid_argument on
// shapes or dtypes that do not fit.
mlx::core::array sample(const SampleInputs& in);

}  // namespace emlx
