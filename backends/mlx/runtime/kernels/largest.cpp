#include "largest.h"

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// One row's k best indices, largest first. Indices come in increasing
// order, so a value enters only when strictly larger than the kept k-th:
// ties keep the lower index, as the stable sort does.
void top_row(const void* row, bool bf16, int64_t n, int k, int32_t* out) {
  std::vector<float> kept(k);
  int size = 0;
  for (int64_t i = 0; i < n; ++i) {
    float v = float_at(row, i, bf16);
    if (std::isnan(v)) v = -std::numeric_limits<float>::infinity();
    if (size == k && !(v > kept[k - 1])) continue;
    int at = size < k ? size++ : k - 1;  // the slot it takes, then moved up past smaller ones
    for (; at > 0 && v > kept[at - 1]; --at) kept[at] = kept[at - 1], out[at] = out[at - 1];
    kept[at] = v, out[at] = static_cast<int32_t>(i);
  }
}

// Input a [..., n] (any strides); output int32 [..., k].
class LargestIndices : public CpuKernel {
 public:
  LargestIndices(mx::Stream s, int k) : CpuKernel(s), k_(k) {}

  const char* name() const override { return "EmlxLargestIndices"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return k_ == static_cast<const LargestIndices&>(other).k_;
  }

 private:
  CpuTask task() const override {
    return [k = k_](const std::vector<mx::array>& inputs, mx::array& out) {
      const auto& a = inputs[0];
      std::vector<uint8_t> packed;
      const auto* data = row_major_data<uint8_t>(a, packed);
      const bool bf16 = a.dtype() == mx::bfloat16;
      const int64_t n = a.shape(-1), rows = a.size() / n;
      auto* od = out.data<int32_t>();
      parallel_rows(rows, 8, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) top_row(data + r * n * a.itemsize(), bf16, n, k, od + r * k);
      });
    };
  }

  int k_;
};

}  // namespace

mx::array largest_indices(const mx::array& a, int k, mx::StreamOrDevice s) {
  const int last = static_cast<int>(a.ndim()) - 1;
  const bool supported = float32_or_bfloat16(a.dtype()) && a.ndim() > 0 && k >= 1 &&
                         k <= kMaxLargest && k <= a.shape(-1);
  auto fallback = [k, last](const std::vector<mx::array>& in, mx::Stream s) {
    // a stable sort of the negated values: largest first, ties in index order
    auto order = mx::argsort(mx::negative(in[0], s), last, s);
    auto stop = in[0].shape();
    stop[last] = k;
    return mx::astype(mx::slice(order, mx::Shape(in[0].ndim(), 0), stop, s), mx::int32, s);
  };
  mx::Shape shape = a.shape();
  if (!shape.empty()) shape.back() = k;
  return CpuKernel::build(s, supported, {a}, std::move(shape), mx::int32, fallback,
                          [&](mx::Stream s) { return std::make_shared<LargestIndices>(s, k); });
}

}  // namespace emlx
