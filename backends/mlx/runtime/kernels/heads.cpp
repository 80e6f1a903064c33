#include "heads.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "rope.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// Inputs x (any strides) and, rotated, cos and sin (broadcast to the
// output); output [B, H, L, D], row-contiguous.
class Heads : public CpuKernel {
 public:
  Heads(mx::Stream s, int start, bool rotated) : CpuKernel(s), start_(start), rotated_(rotated) {}

  const char* name() const override { return "EmlxHeads"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Heads&>(other);
    return start_ == o.start_ && rotated_ == o.rotated_;
  }

 private:
  CpuTask task() const override {
    return [start = start_, rotated = rotated_](const std::vector<mx::array>& inputs, mx::array& out) {
      const mx::Shape& shape = out.shape();
      const int64_t H = shape[1], L = shape[2], D = shape[3];
      const auto& xs = inputs[0].strides();
      const float* x = inputs[0].data<float>();
      std::vector<int64_t> cs, ss;
      if (rotated) cs = broadcast_strides(inputs[1], shape), ss = broadcast_strides(inputs[2], shape);
      float* y = out.data<float>();
      parallel_rows(static_cast<int64_t>(out.size() / D), 64, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const int64_t b = r / (H * L), h = r / L % H, l = r % L;
          const float* src = x + b * xs[0] + l * xs[1] + (start + h * D) * xs[2];
          float* row = y + r * D;
          if (!rotated) {
            for (int64_t d = 0; d < D; ++d) row[d] = src[d * xs[2]];
            continue;
          }
          const float* c = inputs[1].data<float>() + b * cs[0] + h * cs[1] + l * cs[2];
          const float* sn = inputs[2].data<float>() + b * ss[0] + h * ss[1] + l * ss[2];
          rotate_row({src, xs[2]}, {c, cs[3]}, {sn, ss[3]}, D, row);
        }
      });
    };
  }

  int start_;
  bool rotated_;
};

}  // namespace

mx::array heads(const mx::array& x, HeadColumns columns, const std::optional<mx::array>& cos,
                const std::optional<mx::array>& sin, mx::StreamOrDevice s) {
  const auto [start, count, D] = columns;
  if (x.ndim() != 3) throw std::invalid_argument("HeadsNode: x must be [B, L, C]");
  if (start < 0 || count < 1 || D < 1 || int64_t{start} + int64_t{count} * D > x.shape(2)) {
    throw std::invalid_argument("HeadsNode: heads * head_dim columns from start must lie within x's " +
                                std::to_string(x.shape(2)));
  }
  if (cos.has_value() != sin.has_value()) throw std::invalid_argument("HeadsNode: cos and sin go together");
  const int B = x.shape(0), L = x.shape(1);
  const mx::Shape shape = {B, count, L, D};
  const bool rotated = cos.has_value();
  if (rotated) check_rotation(shape, *cos, *sin, "HeadsNode");
  const bool supported = x.dtype() == mx::float32 && x.size() > 0 &&
                         (!rotated || (cos->dtype() == mx::float32 && sin->dtype() == mx::float32));
  std::vector<mx::array> in = {x};
  if (rotated) in.push_back(*cos), in.push_back(*sin);
  auto fallback = [start, count, D](const std::vector<mx::array>& in, mx::Stream s) {
    const auto& x = in[0];
    const int B = x.shape(0), L = x.shape(1);
    auto v = mx::slice(x, {0, 0, start}, {B, L, start + count * D}, s);
    v = mx::transpose(mx::reshape(v, {B, L, count, D}, s), {0, 2, 1, 3}, s);
    return in.size() > 1 ? rope(v, in[1], in[2], s) : v;
  };
  return CpuKernel::build(s, supported, std::move(in), shape, x.dtype(), fallback,
                          [&](mx::Stream s) { return std::make_shared<Heads>(s, start, rotated); });
}

}  // namespace emlx
