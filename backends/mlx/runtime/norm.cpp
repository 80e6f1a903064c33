#include "norm.h"

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "cpu_arrays.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// One row: float32 sums of squares (eight partial sums), as MLX: x * r, then
// the weight.
void normalize_row(const float* x, const float* weight, float eps, size_t D, float* out) {
  float part[8] = {};
  size_t d = 0;
  for (; d + 8 <= D; d += 8) {
    for (int i = 0; i < 8; ++i) part[i] += x[d + i] * x[d + i];
  }
  float ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
  for (; d < D; ++d) ss += x[d] * x[d];
  const float r = 1.0f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (d = 0; d < D; ++d) out[d] = weight ? (x[d] * r) * weight[d] : x[d] * r;
}

// Inputs x [..., D] (any strides), weight [D] row-contiguous if given.
class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream s, float eps, bool has_weight) : mx::UnaryPrimitive(s), eps_(eps), has_weight_(has_weight) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    // The task owns references: MLX may drop its own before the task runs.
    enc.dispatch([inputs, out, eps = eps_, has_weight = has_weight_]() mutable {
      const auto& x = inputs[0];
      std::vector<uint8_t> packed;
      const float* xd = x.data<float>();
      if (!x.flags().row_contiguous) {
        packed = row_major_bytes(x);
        xd = reinterpret_cast<const float*>(packed.data());
      }
      const float* w = has_weight ? inputs[1].data<float>() : nullptr;
      const size_t D = x.shape(-1), rows = x.size() / D;
      float* od = out.data<float>();
      auto run_rows = [&](size_t r0, size_t r1) {
        for (size_t r = r0; r < r1; ++r) normalize_row(xd + r * D, w, eps, D, od + r * D);
      };
      // A decode step's one row is not worth waking the pool.
      constexpr size_t kRowsPerTask = 32;
      if (rows <= kRowsPerTask) return run_rows(0, rows);
      parallel_for(static_cast<int>((rows + kRowsPerTask - 1) / kRowsPerTask), [&](int t) {
        run_rows(t * kRowsPerTask, std::min(rows, (t + 1) * kRowsPerTask));
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("emlx RmsNorm: no GPU kernel (the graph uses MLX's rms_norm there)");
  }

  const char* name() const override { return "EmlxRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const RmsNorm&>(other);
    return eps_ == o.eps_ && has_weight_ == o.has_weight_;
  }

 private:
  float eps_;
  bool has_weight_;
};

}  // namespace

mx::array rms_norm_reference(const mx::array& x, const std::optional<mx::array>& weight, float eps) {
  return mx::fast::rms_norm(x, weight, eps);
}

mx::array rms_norm(const mx::array& x, const std::optional<mx::array>& weight, float eps) {
  const bool kernel = cpu_kernels_enabled() && x.dtype() == mx::float32 && (!weight || weight->dtype() == mx::float32) &&
                      x.ndim() > 0 && x.shape(-1) > 0;
  if (!kernel) return rms_norm_reference(x, weight, eps);
  std::vector<mx::array> in = {x};
  if (weight) in.push_back(row_contiguous(*weight));
  auto prim = std::make_shared<RmsNorm>(mx::default_stream(mx::Device::cpu), eps, weight.has_value());
  return mx::array(x.shape(), x.dtype(), prim, in);
}

}  // namespace emlx
