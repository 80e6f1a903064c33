// New tokens' keys or values written into a KV cache (CacheWriteNode): a
// model's index_copy, which MLX's scatter takes only after a transpose and
// an added axis (three arrays and tasks per call, twice a layer), as one
// kernel of ours that writes the cache in place.
#pragma once

#include <mlx/mlx.h>

namespace emlx {

// cache [B, H, S, D] with cache[:, :, slots[i]] = update[:, :, i]; update
// [B, H, L, D] of the cache's type, slots [L] integers (clamped into [0, S)).
// On a CPU stream our kernel (any type; the cache's buffer reused when
// nothing else holds it); elsewhere MLX's scatter.
mlx::core::array cache_write(const mlx::core::array& cache, const mlx::core::array& slots,
                             const mlx::core::array& update, mlx::core::StreamOrDevice s = {});

}  // namespace emlx
