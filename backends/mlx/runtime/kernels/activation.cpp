#include "activation.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "thread_pool.h"
#include "vec8.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// x * sigmoid(x) from e = e^-|x| in (0, 1]: sigmoid is 1 / (1 + e) for x >= 0
// and e / (1 + e) below; large |x| gives x or (-)0, NaN stays NaN.
EMLX_INLINE v8 silu8(v8 x) {
  const v8 e = exp_nonpositive(x > 0.0f ? -x : x);
  const v8 num = x >= 0.0f ? splat(1.0f) : e;
  return x * (num / (1.0f + e));
}

EMLX_INLINE void silu_range(const float* a, const float* b, float* out, int64_t i0, int64_t i1) {
  int64_t i = i0;
  for (; i + 8 <= i1; i += 8) store8(out + i, b ? silu8(load8(a + i)) * load8(b + i) : silu8(load8(a + i)));
  if (i < i1) {  // the tail through a padded vector
    float pa[8] = {}, pb[8] = {}, po[8];
    for (int64_t j = i; j < i1; ++j) pa[j - i] = a[j], pb[j - i] = b ? b[j] : 0.0f;
    store8(po, b ? silu8(load8(pa)) * load8(pb) : silu8(load8(pa)));
    for (int64_t j = i; j < i1; ++j) out[j] = po[j - i];
  }
}

void silu_range_generic(const float* a, const float* b, float* out, int64_t i0, int64_t i1) {
  silu_range(a, b, out, i0, i1);
}

#if defined(__x86_64__)
__attribute__((target("avx2,fma"))) void silu_range_avx2(const float* a, const float* b, float* out, int64_t i0,
                                                         int64_t i1) {
  silu_range(a, b, out, i0, i1);
}
#else
constexpr auto silu_range_avx2 = silu_range_generic;
#endif

// Elements per task: enough to be worth a thread's wake-up.
constexpr int64_t kChunk = 16384;

// How a Silu kernel finds its gate: none, a second input, or the second
// half of each row of its one input.
enum class Gate : int { None, Input, Halves };

class Silu : public CpuKernel {
 public:
  Silu(mx::Stream s, Gate gate) : CpuKernel(s), gate_(gate) {}

  const char* name() const override { return "EmlxSilu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return gate_ == static_cast<const Silu&>(other).gate_;
  }

 private:
  CpuTask task() const override {
    return [gate = gate_](const std::vector<mx::array>& inputs, mx::array& out) {
      std::vector<uint8_t> packed[2];
      const float* in[2] = {nullptr, nullptr};
      for (int k = 0; k < (gate == Gate::Input ? 2 : 1); ++k) in[k] = row_major_data<float>(inputs[k], packed[k]);
      const auto range = has_avx2() ? silu_range_avx2 : silu_range_generic;
      float* od = out.data<float>();
      if (gate == Gate::Halves) {  // row r: silu(a[r, :N]) * a[r, N:], element by element as with two inputs
        const int64_t N = out.shape(-1), rows = out.size() / N;
        parallel_rows(rows, std::max<int64_t>(1, kChunk / N), [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) range(in[0] + 2 * N * r, in[0] + 2 * N * r + N, od + N * r, 0, N);
        });
        return;
      }
      parallel_rows(static_cast<int64_t>(out.size()), kChunk,
                    [&](int64_t i0, int64_t i1) { range(in[0], in[1], od, i0, i1); });
    };
  }

  Gate gate_;
};

}  // namespace

mx::array silu(const mx::array& a, const std::optional<mx::array>& b, mx::StreamOrDevice s) {
  const bool supported = a.dtype() == mx::float32 && (!b || b->dtype() == mx::float32);
  std::vector<mx::array> in = {a};
  if (b) in.push_back(*b);
  auto fallback = [](const std::vector<mx::array>& in, mx::Stream s) {
    const auto act = mx::multiply(in[0], mx::sigmoid(in[0], s), s);
    return in.size() > 1 ? mx::multiply(act, in[1], s) : act;
  };
  return CpuKernel::build(s, supported, std::move(in), a.shape(), a.dtype(), fallback, [&](mx::Stream s) {
    return std::make_shared<Silu>(s, b.has_value() ? Gate::Input : Gate::None);
  });
}

mx::array silu_halves(const mx::array& a, mx::StreamOrDevice s) {
  if (a.ndim() == 0 || a.shape(-1) % 2 != 0) throw std::invalid_argument("SiluNode: halves needs an even last axis");
  mx::Shape shape = a.shape();
  shape.back() /= 2;
  auto fallback = [](const std::vector<mx::array>& in, mx::Stream s) {
    const auto halves = mx::split(in[0], 2, -1, s);
    return mx::multiply(mx::multiply(halves[0], mx::sigmoid(halves[0], s), s), halves[1], s);
  };
  return CpuKernel::build(s, a.dtype() == mx::float32 && a.size() > 0, {a}, std::move(shape), a.dtype(), fallback,
                          [](mx::Stream s) { return std::make_shared<Silu>(s, Gate::Halves); });
}

}  // namespace emlx
