#include "cache_write.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// Inputs cache, slots, update; the output takes the cache's buffer when
// CpuKernel could donate it, else starts as a copy.
class CacheWrite : public CpuKernel {
 public:
  using CpuKernel::CpuKernel;

  const char* name() const override { return "EmlxCacheWrite"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

 private:
  bool updates_first_input() const override { return true; }

  CpuTask task() const override {
    return [](const std::vector<mx::array>& inputs, mx::array& out) {
      const auto &cache = inputs[0], &slots = inputs[1], &update = inputs[2];
      const size_t item = out.itemsize();
      copy_unless_donated(cache, out);
      uint8_t* dst = out.data<uint8_t>();
      const int64_t B = out.shape(0), H = out.shape(1), S = out.shape(2), D = out.shape(3), L = update.shape(2);
      const auto& us = update.strides();
      const uint8_t* src = update.data<uint8_t>();
      for (int64_t i = 0; i < L; ++i) {
        const int64_t slot = clamped_entry(slots, i, S);
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t h = 0; h < H; ++h) {
            uint8_t* to = dst + (((b * H + h) * S + slot) * D) * item;
            const int64_t from = b * us[0] + h * us[1] + i * us[2];
            if (us[3] == 1) {
              std::memcpy(to, src + from * item, D * item);
            } else {
              for (int64_t d = 0; d < D; ++d) std::memcpy(to + d * item, src + (from + d * us[3]) * item, item);
            }
          }
        }
      }
    };
  }
};

}  // namespace

mx::array cache_write(const mx::array& cache, const mx::array& slots, const mx::array& update, mx::StreamOrDevice s) {
  if (cache.ndim() != 4 || update.ndim() != 4 || slots.ndim() != 1) {
    throw std::invalid_argument("CacheWriteNode: cache and update must be [B, H, S, D] and [B, H, L, D], slots [L]");
  }
  if (update.shape(0) != cache.shape(0) || update.shape(1) != cache.shape(1) || update.shape(3) != cache.shape(3) ||
      update.shape(2) != slots.shape(0)) {
    throw std::invalid_argument("CacheWriteNode: update must be [B, H, L, D] of the cache's B, H and D, L slots");
  }
  if (!mx::issubdtype(slots.dtype(), mx::integer) && slots.dtype() != mx::bool_) {
    throw std::invalid_argument("CacheWriteNode: slots must be integers");
  }
  const auto values = update.dtype() == cache.dtype() ? update : mx::astype(update, cache.dtype(), s);
  if (update.size() == 0 || cache.shape(2) == 0) return cache;  // nothing to write
  auto fallback = [](const std::vector<mx::array>& in, mx::Stream s) {
    const auto& cache = in[0];
    const auto rows = mx::expand_dims(mx::transpose(in[2], {2, 0, 1, 3}, s), 3, s);
    return mx::scatter(cache, {clamped_indices(in[1], cache.shape(2), s)}, rows, {2}, s);
  };
  return CpuKernel::build(s, true, {cache, slots, values}, cache.shape(), cache.dtype(), fallback,
                          [](mx::Stream s) { return std::make_shared<CacheWrite>(s); });
}

}  // namespace emlx
