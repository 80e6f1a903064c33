#include "rope.h"

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// Inputs x, cos, sin (any strides, cos/sin broadcast to x); output x's shape,
// row-contiguous.
class Rope : public CpuKernel {
 public:
  using CpuKernel::CpuKernel;

  const char* name() const override { return "EmlxRope"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

 private:
  CpuTask task() const override {
    return [](const std::vector<mx::array>& inputs, mx::array& out) {
      const mx::Shape& shape = out.shape();
      const int nd = static_cast<int>(shape.size());
      const int64_t D = shape.back(), rows = out.size() / D;
      std::vector<int64_t> strides[3];
      const float* data[3];
      for (int i = 0; i < 3; ++i) {
        strides[i] = broadcast_strides(inputs[i], shape);
        data[i] = inputs[i].data<float>();
      }
      float* y = out.data<float>();
      parallel_rows(rows, 64, [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* p[3];
          for (int i = 0; i < 3; ++i) {
            int64_t at = 0, rest = r;
            for (int d = nd - 2; d >= 0; --d) at += (rest % shape[d]) * strides[i][d], rest /= shape[d];
            p[i] = data[i] + at;
          }
          rotate_row({p[0], strides[0][nd - 1]}, {p[1], strides[1][nd - 1]}, {p[2], strides[2][nd - 1]}, D,
                     y + r * D);
        }
      });
    };
  }
};

// The same as MLX ops: two slices, a negation, a concatenation, two products and a sum.
mx::array rope_ops(const std::vector<mx::array>& in, mx::Stream s) {
  const auto& x = in[0];
  const int half = x.shape(-1) / 2;
  mx::Shape zero(x.ndim(), 0), mid(x.ndim(), 0), head = x.shape();
  mid.back() = half, head.back() = half;
  auto x1 = mx::slice(x, zero, head, s);
  auto x2 = mx::slice(x, mid, x.shape(), s);
  auto rotated = mx::concatenate({mx::negative(x2, s), x1}, -1, s);
  return mx::add(mx::multiply(x, in[1], s), mx::multiply(rotated, in[2], s), s);
}

}  // namespace

void rotate_row(Strided x, Strided cos, Strided sin, int64_t D, float* out) {
  const int64_t half = D / 2;
  // As torch computes it: x * cos, then (+/-) the rotated x * sin, then the sum.
  for (int64_t d = 0; d < D; ++d) {
    const float a = x.p[d * x.stride] * cos.p[d * cos.stride];
    const float rot = d < half ? -x.p[(d + half) * x.stride] : x.p[(d - half) * x.stride];
    const float b = rot * sin.p[d * sin.stride];
    out[d] = a + b;
  }
}

void check_rotation(const mx::Shape& x, const mx::array& cos, const mx::array& sin, const std::string& node) {
  if (x.empty() || x.back() % 2 != 0) throw std::invalid_argument(node + ": the rotated axis must be even");
  for (const auto* t : {&cos, &sin}) {
    if (t->ndim() == 0 || t->ndim() > x.size() || t->shape(-1) != x.back()) {
      throw std::invalid_argument(node + ": cos and sin must broadcast to x with last axis D");
    }
    if (!broadcasts_to(*t, x)) throw std::invalid_argument(node + ": cos and sin must broadcast to x");
  }
}

mx::array rope(const mx::array& x, const mx::array& cos, const mx::array& sin, mx::StreamOrDevice s) {
  check_rotation(x.shape(), cos, sin, "RopeNode");
  const bool supported =
      x.dtype() == mx::float32 && cos.dtype() == mx::float32 && sin.dtype() == mx::float32 && x.size() > 0;
  return CpuKernel::build(s, supported, {x, cos, sin}, x.shape(), x.dtype(), rope_ops,
                          [](mx::Stream s) { return std::make_shared<Rope>(s); });
}

}  // namespace emlx
