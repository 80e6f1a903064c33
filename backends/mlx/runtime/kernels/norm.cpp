#include "norm.h"

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

// One row: float32 sums of squares (eight partial sums), as MLX: x * r, then
// the weight.
void normalize_row(const float* x, const float* weight, float eps, int64_t D, float* out) {
  float part[8] = {};
  int64_t d = 0;
  for (; d + 8 <= D; d += 8) {
    for (int i = 0; i < 8; ++i) part[i] += x[d + i] * x[d + i];
  }
  float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (d = 0; d < D; ++d) out[d] = weight ? (x[d] * r) * weight[d] : x[d] * r;
}

namespace {

// Inputs x [..., D] (any strides), weight [D] row-contiguous if given.
class RmsNorm : public CpuKernel {
 public:
  RmsNorm(mx::Stream s, float eps, bool has_weight) : CpuKernel(s), eps_(eps), has_weight_(has_weight) {}

  const char* name() const override { return "EmlxRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RmsNorm&>(other);
    return eps_ == o.eps_ && has_weight_ == o.has_weight_;
  }

 private:
  CpuTask task() const override {
    return [eps = eps_, has_weight = has_weight_](const std::vector<mx::array>& inputs, mx::array& out) {
      const auto& x = inputs[0];
      std::vector<uint8_t> packed;
      const float* xd = row_major_data<float>(x, packed);
      const float* w = has_weight ? inputs[1].data<float>() : nullptr;
      const int64_t D = x.shape(-1), rows = x.size() / D;
      float* od = out.data<float>();
      parallel_rows(rows, 32, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) normalize_row(xd + r * D, w, eps, D, od + r * D);
      });
    };
  }

  float eps_;
  bool has_weight_;
};

}  // namespace

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps, mx::StreamOrDevice s) {
  const bool supported = x.dtype() == mx::float32 && (!weight || weight->dtype() == mx::float32) && x.ndim() > 0 &&
                         x.shape(-1) > 0;
  std::vector<mx::array> in = {x};
  if (weight) in.push_back(supported ? row_contiguous(*weight) : *weight);
  auto fallback = [eps](const std::vector<mx::array>& in, mx::Stream s) {
    return mx::fast::rms_norm(in[0], in.size() > 1 ? std::optional(in[1]) : std::nullopt, eps, s);
  };
  return CpuKernel::build(s, supported, std::move(in), x.shape(), x.dtype(), fallback,
                          [&](mx::Stream s) { return std::make_shared<RmsNorm>(s, eps, weight.has_value()); });
}

}  // namespace emlx
