#include "matmul.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "blas.h"
#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// One operand as sgemm reads it: a base pointer, its stride per batch dim
// of the output (0 where broadcast), and its matrices' layout.
struct Operand {
  const float* data;
  std::vector<int64_t> batch_strides;
  bool transposed;  // each matrix column-major (the last two dims swapped)
  int64_t ld;
};

// `x` ([..., rows, cols]) for an output of `batch_ndim` batch dims; strided
// layouts sgemm cannot read are copied into `packed`.
Operand operand(const mx::array& x, int batch_ndim, std::vector<uint8_t>& packed) {
  const int nd = x.ndim();
  const int64_t rows = x.shape(nd - 2), cols = x.shape(nd - 1);
  std::vector<int64_t> strides(x.strides().begin(), x.strides().end());
  const float* data = x.data<float>();
  bool transposed = false;
  int64_t ld = 0;
  if (strides[nd - 1] == 1 && strides[nd - 2] >= cols) {
    ld = std::max<int64_t>(strides[nd - 2], 1);
  } else if (strides[nd - 2] == 1 && strides[nd - 1] >= rows) {
    transposed = true, ld = std::max<int64_t>(strides[nd - 1], 1);
  } else if (rows == 1 && strides[nd - 1] == 1) {
    ld = cols;
  } else {
    data = row_major_data<float>(x, packed);
    int64_t step = 1;
    for (int d = nd - 1; d >= 0; --d) strides[d] = step, step *= x.shape(d);
    ld = cols;
  }
  Operand op{data, std::vector<int64_t>(batch_ndim, 0), transposed, ld};
  for (int d = 0; d < nd - 2; ++d) {
    if (x.shape(d) != 1) op.batch_strides[batch_ndim - (nd - 2) + d] = strides[d];
  }
  return op;
}

class Matmul : public CpuKernel {
 public:
  using CpuKernel::CpuKernel;

  const char* name() const override { return "EmlxMatmul"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }

 private:
  CpuTask task() const override {
    return [](const std::vector<mx::array>& inputs, mx::array& out) {
      use_single_threaded_blas();
      const int nd = out.ndim(), batch_ndim = nd - 2;
      const int64_t M = out.shape(nd - 2), N = out.shape(nd - 1), K = inputs[0].shape(-1);
      std::vector<uint8_t> packed_a, packed_b;
      const Operand a = operand(inputs[0], batch_ndim, packed_a), b = operand(inputs[1], batch_ndim, packed_b);
      const int64_t batches = static_cast<int64_t>(out.size() / std::max<int64_t>(M * N, 1));
      float* c = out.data<float>();
      // the offsets of batch i's matrices in a and b
      auto offsets = [&](int64_t i) {
        int64_t at_a = 0, at_b = 0;
        for (int d = batch_ndim - 1; d >= 0; --d) {
          const int64_t index = i % out.shape(d);
          i /= out.shape(d);
          at_a += index * a.batch_strides[d], at_b += index * b.batch_strides[d];
        }
        return std::pair{at_a, at_b};
      };
      parallel_for(static_cast<int>(batches), [&](int i) {
        const auto [at_a, at_b] = offsets(i);
        scipy_cblas_sgemm(CblasRowMajor, a.transposed ? CblasTrans : CblasNoTrans,
                          b.transposed ? CblasTrans : CblasNoTrans, M, N, K, 1.0f, a.data + at_a, a.ld,
                          b.data + at_b, b.ld, 0.0f, c + i * M * N, N);
      });
    };
  }
};

}  // namespace

mx::array matmul(const mx::array& a, const mx::array& b, mx::StreamOrDevice s) {
  const bool supported = a.dtype() == mx::float32 && b.dtype() == mx::float32 && a.ndim() >= 2 && b.ndim() >= 2 &&
                         a.shape(-1) == b.shape(-2) && a.size() > 0 && b.size() > 0;
  if (!supported) return mx::matmul(a, b, s);
  // the output's shape: the batch dims broadcast, then [M, N]
  mx::Shape batch_a(a.shape().begin(), a.shape().end() - 2), batch_b(b.shape().begin(), b.shape().end() - 2);
  mx::Shape shape = mx::broadcast_shapes(batch_a, batch_b);
  shape.push_back(a.shape(-2));
  shape.push_back(b.shape(-1));
  auto fallback = [](const std::vector<mx::array>& in, mx::Stream s) { return mx::matmul(in[0], in[1], s); };
  return CpuKernel::build(s, true, {a, b}, std::move(shape), mx::float32, fallback,
                          [](mx::Stream s) { return std::make_shared<Matmul>(s); });
}

}  // namespace emlx
