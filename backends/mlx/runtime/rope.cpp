#include "rope.h"

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// Element strides of `a` read as an array of `shape` (a right-aligned
// broadcast: a missing or size-1 axis has stride 0).
std::vector<int64_t> broadcast_strides(const mx::array& a, const mx::Shape& shape) {
  std::vector<int64_t> st(shape.size(), 0);
  const int lead = static_cast<int>(shape.size()) - static_cast<int>(a.ndim());
  for (int i = 0; i < static_cast<int>(a.ndim()); ++i) {
    if (a.shape(i) != 1) st[lead + i] = a.strides()[i];
  }
  return st;
}

// Inputs x, cos, sin (any strides, cos/sin broadcast to x); output x's shape,
// row-contiguous.
class Rope : public mx::UnaryPrimitive {
 public:
  explicit Rope(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    // The task owns references: MLX may drop its own before the task runs.
    enc.dispatch([inputs, out]() mutable {
      const mx::Shape& shape = out.shape();
      const int nd = static_cast<int>(shape.size());
      const int64_t D = shape.back(), half = D / 2, rows = out.size() / D;
      std::vector<int64_t> strides[3];
      const float* data[3];
      for (int i = 0; i < 3; ++i) {
        strides[i] = broadcast_strides(inputs[i], shape);
        data[i] = inputs[i].data<float>();
      }
      float* y = out.data<float>();
      auto run_rows = [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* p[3];
          for (int i = 0; i < 3; ++i) {
            int64_t at = 0, rest = r;
            for (int d = nd - 2; d >= 0; --d) at += (rest % shape[d]) * strides[i][d], rest /= shape[d];
            p[i] = data[i] + at;
          }
          const int64_t sx = strides[0][nd - 1], sc = strides[1][nd - 1], ss = strides[2][nd - 1];
          float* row = y + r * D;
          // As torch computes it: x * cos, then (+/-) the rotated x * sin, then the sum.
          for (int64_t d = 0; d < D; ++d) {
            const float a = p[0][d * sx] * p[1][d * sc];
            const float rot = d < half ? -p[0][(d + half) * sx] : p[0][(d - half) * sx];
            const float b = rot * p[2][d * ss];
            row[d] = a + b;
          }
        }
      };
      // A decode step's few rows are not worth waking the pool.
      constexpr int64_t kRowsPerTask = 64;
      if (rows <= kRowsPerTask) return run_rows(0, rows);
      parallel_for(static_cast<int>((rows + kRowsPerTask - 1) / kRowsPerTask),
                   [&](int t) { run_rows(t * kRowsPerTask, std::min(rows, (t + 1) * kRowsPerTask)); });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("emlx Rope: no GPU kernel (the graph uses MLX ops there)");
  }

  const char* name() const override { return "EmlxRope"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

}  // namespace

mx::array rope_reference(const mx::array& x, const mx::array& cos, const mx::array& sin) {
  const int D = x.shape(-1), half = D / 2;
  auto x1 = mx::slice(x, mx::Shape(x.ndim(), 0), [&] { auto e = x.shape(); e.back() = half; return e; }());
  auto x2 = mx::slice(x, [&] { mx::Shape s(x.ndim(), 0); s.back() = half; return s; }(), x.shape());
  auto rotated = mx::concatenate({mx::negative(x2), x1}, -1);
  return mx::add(mx::multiply(x, cos), mx::multiply(rotated, sin));
}

mx::array rope(const mx::array& x, const mx::array& cos, const mx::array& sin) {
  if (x.ndim() == 0 || x.shape(-1) % 2 != 0) throw std::invalid_argument("RopeNode: x must be [..., D] with D even");
  for (const auto* t : {&cos, &sin}) {
    if (t->ndim() == 0 || t->ndim() > x.ndim() || t->shape(-1) != x.shape(-1)) {
      throw std::invalid_argument("RopeNode: cos and sin must broadcast to x with last axis D");
    }
    for (int i = 1; i <= static_cast<int>(t->ndim()); ++i) {
      if (t->shape(-i) != 1 && t->shape(-i) != x.shape(-i)) {
        throw std::invalid_argument("RopeNode: cos and sin must broadcast to x");
      }
    }
  }
  const bool kernel = cpu_kernels_enabled() && x.dtype() == mx::float32 && cos.dtype() == mx::float32 &&
                      sin.dtype() == mx::float32 && x.size() > 0;
  if (!kernel) return rope_reference(x, cos, sin);
  auto prim = std::make_shared<Rope>(mx::default_stream(mx::Device::cpu));
  return mx::array(x.shape(), mx::float32, prim, {x, cos, sin});
}

}  // namespace emlx
