#include "heads.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "norm.h"
#include "rope.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// Inputs x (any strides), then the norm's weight (row-contiguous) when
// normalized, then cos and sin (broadcast to the output) when rotated;
// output [B, H, L, D], row-contiguous.
class Heads : public CpuKernel {
 public:
  Heads(mx::Stream s, int start, bool normalized, float eps, bool rotated)
      : CpuKernel(s), start_(start), normalized_(normalized), eps_(eps), rotated_(rotated) {}

  const char* name() const override { return "EmlxHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Heads&>(other);
    return start_ == o.start_ && normalized_ == o.normalized_ && eps_ == o.eps_ && rotated_ == o.rotated_;
  }

 private:
  CpuTask task() const override {
    return [start = start_, normalized = normalized_, eps = eps_, rotated = rotated_](
               const std::vector<mx::array>& inputs, mx::array& out) {
      const mx::Shape& shape = out.shape();
      const int64_t H = shape[1], L = shape[2], D = shape[3];
      const auto& xs = inputs[0].strides();
      const float* x = inputs[0].data<float>();
      const float* weight = normalized ? inputs[1].data<float>() : nullptr;
      const mx::array* rotation = rotated ? &inputs[normalized ? 2 : 1] : nullptr;
      std::vector<int64_t> cs, ss;
      if (rotated) cs = broadcast_strides(rotation[0], shape), ss = broadcast_strides(rotation[1], shape);
      float* y = out.data<float>();
      parallel_rows(static_cast<int64_t>(out.size() / D), 64, [&](int64_t r0, int64_t r1) {
        std::vector<float> row_in(normalized ? D : 0);
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t b = r / (H * L), h = r / L % H, l = r % L;
          const float* src = x + b * xs[0] + l * xs[1] + (start + h * D) * xs[2];
          int64_t stride = xs[2];
          float* row = y + r * D;
          if (normalized) {  // the norm reads a contiguous row, as RmsNormNode's kernel does
            for (int64_t d = 0; d < D; ++d) row_in[d] = src[d * stride];
            normalize_row(row_in.data(), weight, eps, D, rotated ? row_in.data() : row);
            src = row_in.data(), stride = 1;
          }
          if (rotated) {
            const float* c = rotation[0].data<float>() + b * cs[0] + h * cs[1] + l * cs[2];
            const float* sn = rotation[1].data<float>() + b * ss[0] + h * ss[1] + l * ss[2];
            rotate_row({src, stride}, {c, cs[3]}, {sn, ss[3]}, D, row);
          } else if (!normalized) {
            for (int64_t d = 0; d < D; ++d) row[d] = src[d * stride];
          }
        }
      });
    };
  }

  int start_;
  bool normalized_;
  float eps_;
  bool rotated_;
};

}  // namespace

mx::array heads(const mx::array& x, HeadColumns columns, const HeadsOptions& o, mx::StreamOrDevice s) {
  const auto [start, count, D] = columns;
  if (x.ndim() != 3) throw std::invalid_argument("HeadsNode: x must be [B, L, C]");
  if (start < 0 || count < 1 || D < 1 || int64_t{start} + int64_t{count} * D > x.shape(2)) {
    throw std::invalid_argument("HeadsNode: heads * head_dim columns from start must lie within x's " +
                                std::to_string(x.shape(2)));
  }
  if (o.cos.has_value() != o.sin.has_value()) throw std::invalid_argument("HeadsNode: cos and sin go together");
  if (o.norm && (o.norm->ndim() != 1 || o.norm->shape(0) != D)) {
    throw std::invalid_argument("HeadsNode: the norm's weight must be [head_dim]");
  }
  const int B = x.shape(0), L = x.shape(1);
  const mx::Shape shape = {B, count, L, D};
  const bool rotated = o.cos.has_value(), normalized = o.norm.has_value();
  if (rotated) check_rotation(shape, *o.cos, *o.sin, "HeadsNode");
  const auto f32 = [](const std::optional<mx::array>& a) { return !a || a->dtype() == mx::float32; };
  const bool supported = x.dtype() == mx::float32 && x.size() > 0 && f32(o.norm) && f32(o.cos) && f32(o.sin);
  std::vector<mx::array> in = {x};
  if (normalized) in.push_back(supported ? row_contiguous(*o.norm) : *o.norm);
  if (rotated) in.push_back(*o.cos), in.push_back(*o.sin);
  const float eps = o.eps;
  auto fallback = [start, count, D, normalized, eps, rotated](const std::vector<mx::array>& in, mx::Stream s) {
    const auto& x = in[0];
    const int B = x.shape(0), L = x.shape(1);
    auto v = mx::reshape(mx::slice(x, {0, 0, start}, {B, L, start + count * D}, s), {B, L, count, D}, s);
    if (normalized) v = rms_norm(v, in[1], eps, s);
    v = mx::transpose(v, {0, 2, 1, 3}, s);
    return rotated ? rope(v, in[in.size() - 2], in.back(), s) : v;
  };
  return CpuKernel::build(s, supported, std::move(in), shape, x.dtype(), fallback, [&](mx::Stream s) {
    return std::make_shared<Heads>(s, start, normalized, eps, rotated);
  });
}

}  // namespace emlx
