#include "linear.h"

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <algorithm>
#include <cstdlib>
#include <stdexcept>

#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

typedef float v8 __attribute__((vector_size(32)));

// Dot products of ROWS rows of w with one row of x (all K long).
template <int ROWS>
inline void dots(const float* x, const float* w, size_t K, float* out) {
  v8 acc[ROWS] = {};
  size_t k = 0;
  for (; k + 8 <= K; k += 8) {
    v8 xv;
    __builtin_memcpy(&xv, x + k, sizeof xv);
    for (int r = 0; r < ROWS; ++r) {
      v8 wv;
      __builtin_memcpy(&wv, w + r * K + k, sizeof wv);
      acc[r] += xv * wv;
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    float s = 0;
    for (int i = 0; i < 8; ++i) s += acc[r][i];
    for (size_t j = k; j < K; ++j) s += x[j] * w[r * K + j];
    out[r] = s;
  }
}

// out[m, n0:n1] for every row m of x: w's rows are read once per block and
// reused for all of x's rows while they are in cache.
__attribute__((always_inline)) inline void linear_block(const float* x, const float* w, const float* bias,
                                                        float* out, size_t M, size_t N, size_t K, size_t n0,
                                                        size_t n1) {
  constexpr size_t kRows = 4;
  size_t n = n0;
  for (; n + kRows <= n1; n += kRows) {
    for (size_t m = 0; m < M; ++m) {
      float r[kRows];
      dots<kRows>(x + m * K, w + n * K, K, r);
      for (size_t i = 0; i < kRows; ++i) out[m * N + n + i] = r[i] + (bias ? bias[n + i] : 0.0f);
    }
  }
  for (; n < n1; ++n) {
    for (size_t m = 0; m < M; ++m) {
      float r;
      dots<1>(x + m * K, w + n * K, K, &r);
      out[m * N + n] = r + (bias ? bias[n] : 0.0f);
    }
  }
}

void linear_block_generic(const float* x, const float* w, const float* bias, float* out, size_t M, size_t N,
                          size_t K, size_t n0, size_t n1) {
  linear_block(x, w, bias, out, M, N, K, n0, n1);
}

#if defined(__x86_64__)
// The same code compiled twice: for AVX2+FMA machines, and for any x86-64.
__attribute__((target("avx2,fma"))) void linear_block_avx2(const float* x, const float* w, const float* bias,
                                                            float* out, size_t M, size_t N, size_t K, size_t n0,
                                                            size_t n1) {
  linear_block(x, w, bias, out, M, N, K, n0, n1);
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#else
constexpr auto linear_block_avx2 = linear_block_generic;
bool has_avx2() { return false; }
#endif

// MLX primitive: inputs x [M, K], w [N, K] (+ bias [N]), all row-contiguous
// float32; output [M, N].
class Linear : public mx::UnaryPrimitive {
 public:
  explicit Linear(mx::Stream s) : mx::UnaryPrimitive(s) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    // The task owns references: MLX may drop its own before the task runs.
    enc.dispatch([inputs, out]() mutable {
      const auto &x = inputs[0], &w = inputs[1];
      const float* bias = inputs.size() > 2 ? inputs[2].data<float>() : nullptr;
      const size_t M = x.shape(0), K = x.shape(1), N = w.shape(0);
      const float *xp = x.data<float>(), *wp = w.data<float>();
      float* op = out.data<float>();
      // Blocks of about 64 KiB of w: enough to spread over the pool, small
      // enough to stay in cache while every row of x passes over them.
      const size_t rows = std::max<size_t>(4, (16384 / std::max<size_t>(K, 1)) / 4 * 4);
      const int blocks = static_cast<int>((N + rows - 1) / rows);
      const bool avx2 = has_avx2();
      parallel_for(blocks, [&](int b) {
        const size_t n0 = b * rows, n1 = std::min(N, n0 + rows);
        (avx2 ? linear_block_avx2 : linear_block_generic)(xp, wp, bias, op, M, N, K, n0, n1);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("emlx Linear: no GPU kernel (the graph uses mlx::core::matmul there)");
  }

  const char* name() const override { return "EmlxLinear"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
};

bool use_kernel(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  static const bool disabled = std::getenv("EMLX_DISABLE_CPU_KERNELS") != nullptr;
  return !disabled && mx::default_device() == mx::Device::cpu && x.dtype() == mx::float32 &&
         w.dtype() == mx::float32 && (!bias || bias->dtype() == mx::float32);
}

}  // namespace

mx::array linear_reference(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  auto y = mx::matmul(x, mx::transpose(w));
  return bias ? mx::add(y, *bias) : y;
}

mx::array linear(const mx::array& x, const mx::array& w, const std::optional<mx::array>& bias) {
  if (w.ndim() != 2 || x.ndim() < 1 || x.shape(-1) != w.shape(1)) {
    throw std::invalid_argument("LinearNode: x [..., K] and weight [N, K] expected");
  }
  if (bias && (bias->ndim() != 1 || bias->shape(0) != w.shape(0))) {
    throw std::invalid_argument("LinearNode: bias must be [N]");
  }
  if (!use_kernel(x, w, bias)) return linear_reference(x, w, bias);
  const int K = w.shape(1), N = w.shape(0);
  const int M = static_cast<int>(x.size() / std::max(K, 1));
  std::vector<mx::array> in = {mx::contiguous(mx::reshape(x, {M, K})), mx::contiguous(w)};
  if (bias) in.push_back(mx::contiguous(*bias));
  mx::Shape out_shape = x.shape();
  out_shape.back() = N;
  auto y = mx::array({M, N}, mx::float32, std::make_shared<Linear>(mx::default_stream(mx::Device::cpu)), in);
  return mx::reshape(y, out_shape);
}

}  // namespace emlx
