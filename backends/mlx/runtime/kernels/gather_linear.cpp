#include "gather_linear.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "quantized_dot.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// The expert of each (row, expert) pair of ids [T, k] (any integer type and
// strides), clamped into [0, E), in pair order t * k + j.
std::vector<size_t> experts_of_pairs(const mx::array& ids, size_t E) {
  const size_t k = ids.shape(1);
  std::vector<size_t> out(ids.size());
  for (size_t p = 0; p < out.size(); ++p) {
    const int64_t at = (p / k) * ids.strides()[0] + (p % k) * ids.strides()[1];
    out[p] = static_cast<size_t>(std::clamp<int64_t>(integer_at(ids, at), 0, static_cast<int64_t>(E) - 1));
  }
  return out;
}

// The experts a call chose, each with the (row, expert) pairs routed to it
// (as t * k + j, in call order).
std::vector<std::pair<size_t, std::vector<size_t>>> experts_of(const std::vector<size_t>& ids, size_t E) {
  std::vector<std::vector<size_t>> of(E);
  for (size_t p = 0; p < ids.size(); ++p) of[ids[p]].push_back(p);
  std::vector<std::pair<size_t, std::vector<size_t>>> chosen;
  for (size_t e = 0; e < E; ++e) {
    if (!of[e].empty()) chosen.emplace_back(e, std::move(of[e]));
  }
  return chosen;
}

// x's rows as float32 (a copy when bfloat16 or strided, else x's own memory).
const float* float_rows_of(const mx::array& x, std::vector<uint8_t>& packed, std::vector<float>& converted) {
  const void* data = row_major_data<void>(x, packed);
  if (x.dtype() != mx::bfloat16) return static_cast<const float*>(data);
  converted = bf16_rows_to_f32(static_cast<const uint16_t*>(data), x.size());
  return converted.data();
}

// Where a call's pair rows go: straight into out ([T * k, N], float32 or
// bfloat16), or, weighted, into a float32 buffer that finish() combines into
// out [T, N] as MLX's multiply and sum over the experts' axis would.
class PairRows {
 public:
  PairRows(mx::array& out, const mx::array* weights, size_t pairs, size_t N)
      : out_(out), weights_(weights), N_(N), rows_(weights ? pairs * N : 0) {}

  // Pair p's row = row (+ bias [N], in out's dtype), rounded once, as the
  // dense kernels round.
  void write(size_t p, const float* row, const void* bias) {
    const bool bf16 = out_.dtype() == mx::bfloat16;
    auto value = [&](size_t n) { return bias ? row[n] + float_at(bias, n, bf16) : row[n]; };
    if (bf16) {
      uint16_t* dst = out_.data<uint16_t>() + p * N_;
      for (size_t n = 0; n < N_; ++n) dst[n] = f32_to_bf16(value(n));
    } else {
      float* dst = weights_ ? rows_.data() + p * N_ : out_.data<float>() + p * N_;
      for (size_t n = 0; n < N_; ++n) dst[n] = value(n);
    }
  }

  // out[t] = 0 + y[t, 0] * w[t, 0] + y[t, 1] * w[t, 1] + ..., in that order.
  void finish() {
    if (!weights_) return;
    const size_t T = weights_->shape(0), k = weights_->shape(1);
    const auto& ws = weights_->strides();
    const float* w = weights_->data<float>();
    float* dst = out_.data<float>();
    for (size_t t = 0; t < T; ++t) {
      float* o = dst + t * N_;
      std::fill(o, o + N_, 0.0f);
      for (size_t j = 0; j < k; ++j) {
        const float wj = w[t * ws[0] + j * ws[1]];
        const float* y = rows_.data() + (t * k + j) * N_;
        for (size_t n = 0; n < N_; ++n) o[n] += y[n] * wj;
      }
    }
  }

 private:
  mx::array& out_;
  const mx::array* weights_;
  size_t N_;
  std::vector<float> rows_;
};

// Expert e's bias row of a [E, N] bias input, or null.
const void* bias_row(const mx::array* bias, size_t e, size_t N) {
  return bias ? bias->data<uint8_t>() + e * N * bias->itemsize() : nullptr;
}

// x against each chosen expert's weights in floats: an expert at a time,
// its rows of x (xf [T, K], a row shared by a token's experts, or [T * k, K])
// in one call of a dense float kernel, `multiply(e, rows, m, y)` (rows
// [m, K] -> y [m, N]); each pair's row written to out, its expert's bias added.
template <class Multiply>
void float_experts(const float* xf, size_t K, const std::vector<size_t>& ids, size_t k, bool shared, size_t E,
                   const mx::array* bias, PairRows& out, size_t N, Multiply&& multiply) {
  for (auto& [e, pairs] : experts_of(ids, E)) {
    std::vector<float> rows(pairs.size() * K), y(pairs.size() * N);
    for (size_t i = 0; i < pairs.size(); ++i) {
      std::memcpy(&rows[i * K], xf + (shared ? pairs[i] / k : pairs[i]) * K, K * sizeof(float));
    }
    multiply(e, rows.data(), pairs.size(), y.data());
    for (size_t i = 0; i < pairs.size(); ++i) out.write(pairs[i], &y[i * N], bias_row(bias, e, N));
  }
  out.finish();
}

// The fallbacks' end: each pair's expert's bias row added to y [T, k, N],
// then, weighted, the experts' rows combined.
mx::array finish_ops(const mx::array& y, const std::optional<mx::array>& bias,
                     const std::optional<mx::array>& weights, const mx::array& ids, mx::Stream s) {
  const auto biased = bias ? mx::add(y, mx::take(*bias, ids, 0, s), s) : y;
  return weights ? mx::sum(mx::multiply(biased, mx::expand_dims(*weights, 2, s), s), 1, false, s) : biased;
}

// A kernel's last inputs: the bias (when it has one), then the combining
// weights (when weighted).
struct Extras {
  const mx::array *bias, *weights;
};
Extras extras_of(const std::vector<mx::array>& inputs, bool has_bias, bool weighted) {
  const size_t last = inputs.size() - 1;
  return {has_bias ? &inputs[weighted ? last - 1 : last] : nullptr, weighted ? &inputs[last] : nullptr};
}

// Rows `rows` of `all` as one IntRows (each row's integers, scales and sums
// are its own: quantize_rows quantizes every row alone).
IntRows pick_rows(const IntRows& all, const std::vector<size_t>& rows) {
  IntRows out;
  out.M = rows.size(), out.K = all.K, out.group = all.group, out.bits = all.bits;
  const size_t G = all.K / all.group;
  out.q.resize(out.M * all.K);
  out.scale.resize(out.M * G);
  out.sum.resize(out.M * G);
  for (size_t i = 0; i < rows.size(); ++i) {
    std::memcpy(&out.q[i * all.K], &all.q[rows[i] * all.K], all.K * sizeof(int8_t));
    std::memcpy(&out.scale[i * G], &all.scale[rows[i] * G], G * sizeof(float));
    std::memcpy(&out.sum[i * G], &all.sum[rows[i] * G], G * sizeof(float));
  }
  return out;
}

// MLX primitive: inputs x [T, K] (shared by a row's experts) or [T, k, K],
// ids [T, k] integers (any strides; clamped into [0, E) here), w [E, N, K *
// bits / 32] words, scales and biases [E, N, K / group], row-contiguous, then
// the bias and the combining weights when given; output [T, k, N] (or,
// weighted, [T, N]) in x's dtype (float32 or bfloat16; the scales' and
// biases' float32 or bfloat16 too, not necessarily x's).
class GatherQuantizedLinear : public CpuKernel {
 public:
  GatherQuantizedLinear(mx::Stream s, int group, int bits, Activations activations, bool tiled, bool has_bias,
                        bool weighted)
      : CpuKernel(s), group_(group), bits_(bits), activations_(activations), tiled_(tiled), has_bias_(has_bias),
        weighted_(weighted) {}

  const char* name() const override { return "EmlxGatherQuantizedLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GatherQuantizedLinear&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && activations_ == o.activations_ && tiled_ == o.tiled_ &&
           has_bias_ == o.has_bias_ && weighted_ == o.weighted_;
  }

 private:
  CpuTask task() const override {
    return [group = group_, bits = bits_, activations = activations_, tiled = tiled_, has_bias = has_bias_,
            weighted = weighted_](const std::vector<mx::array>& inputs, mx::array& out) {
      const auto &x = inputs[0], &ids_array = inputs[1], &w = inputs[2];
      const bool bf16 = inputs[3].dtype() == mx::bfloat16;  // the scales and biases
      const bool shared = x.ndim() == 2;
      const size_t T = ids_array.shape(0), k = ids_array.shape(1), K = x.shape(-1), N = out.shape(-1);
      const size_t E = w.shape(0), row_bytes = K * bits / 8, G = K / group;
      const size_t pairs = T * k;
      std::vector<uint8_t> packed;
      std::vector<float> converted;
      const float* xf = float_rows_of(x, packed, converted);
      const auto ids = experts_of_pairs(ids_array, E);
      const auto* wq = w.data<uint8_t>();
      const auto* scales = inputs[3].data<uint8_t>();
      const auto* biases = inputs[4].data<uint8_t>();
      const auto [bias, weights] = extras_of(inputs, has_bias, weighted);
      PairRows sink(out, weights, pairs, N);
      const size_t param_bytes = bf16 ? 2 : 4;
      auto x_row = [&](size_t p) { return shared ? p / k : p; };

      IntRows xq;
      if (activations == Activations::Float || !quantize_rows(xf, shared ? T : pairs, K, group, bits, xq)) {
        // x in floats (as asked, or because it holds a NaN or an infinity,
        // which float products propagate as gather_qmm does)
        float_experts(xf, K, ids, k, shared, E, bias, sink, N, [&](size_t e, const float* rows, size_t m, float* y) {
          const size_t at = e * N;
          PackedRows expert{wq + at * row_bytes, scales + at * G * param_bytes, biases + at * G * param_bytes,
                            bf16, group, bits};
          std::vector<uint8_t> bytes[3];  // a tiled expert back in rows, for this call
          if (tiled) expert = untile_matrix(expert, N, K, bytes);
          dequantized_linear_rows(rows, m, K, expert, N, y);
        });
        return;
      }
      // Each chosen expert's weights are read once per call, for all the
      // rows that chose it (a prefill's tokens share experts), and no other
      // expert's at all.
      struct Work {
        size_t expert;
        std::vector<size_t> pairs;
        IntRows x;
        std::vector<float> out;  // [pairs, N]
      };
      std::vector<Work> work;
      for (auto& [e, chosen] : experts_of(ids, E)) {
        std::vector<size_t> rows;
        for (size_t p : chosen) rows.push_back(x_row(p));
        work.push_back({e, std::move(chosen), pick_rows(xq, rows), std::vector<float>(rows.size() * N)});
      }
      // blocks of 16 weight rows or more, about 8 tasks a thread over all the chosen experts
      const size_t target = std::max<size_t>(1, 8 * pool_size() / work.size());
      const size_t block = std::max<size_t>(16, (N / target + 15) / 16 * 16);
      const int blocks = static_cast<int>((N + block - 1) / block);
      parallel_for(static_cast<int>(work.size()) * blocks, [&](int task) {
        Work& ew = work[task / blocks];
        const size_t n0 = (task % blocks) * block, n1 = std::min(N, n0 + block);
        const size_t at = ew.expert * N;
        quantized_dots(ew.x, wq + at * row_bytes, scales + at * G * param_bytes, biases + at * G * param_bytes, bf16,
                       tiled, n0, n1, ew.out.data(), N);
      });
      for (const auto& ew : work) {
        for (size_t i = 0; i < ew.pairs.size(); ++i) sink.write(ew.pairs[i], &ew.out[i * N], bias_row(bias, ew.expert, N));
      }
      sink.finish();
    };
  }

  int group_, bits_;
  Activations activations_;
  bool tiled_;  // each expert's matrix tiled (quantized_dot.h)
  bool has_bias_, weighted_;
};

// MLX primitive: inputs x [T, K] or [T, k, K], ids [T, k] integers (clamped
// into [0, E) here), w [E, N, K] (float32 or bfloat16, x's dtype),
// row-contiguous, then the bias and the combining weights when given; output
// [T, k, N] (or, weighted, [T, N]) in x's dtype.
class GatherLinear : public CpuKernel {
 public:
  GatherLinear(mx::Stream s, bool has_bias, bool weighted) : CpuKernel(s), has_bias_(has_bias), weighted_(weighted) {}

  const char* name() const override { return "EmlxGatherLinear"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const GatherLinear&>(other);
    return has_bias_ == o.has_bias_ && weighted_ == o.weighted_;
  }

 private:
  CpuTask task() const override {
    return [has_bias = has_bias_, weighted = weighted_](const std::vector<mx::array>& inputs, mx::array& out) {
      const auto &x = inputs[0], &ids_array = inputs[1], &w = inputs[2];
      const bool shared = x.ndim() == 2, bf16 = w.dtype() == mx::bfloat16;
      const size_t K = x.shape(-1), N = out.shape(-1), E = w.shape(0);
      std::vector<uint8_t> packed;
      std::vector<float> converted;
      const float* xf = float_rows_of(x, packed, converted);
      const auto* wb = w.data<uint8_t>();
      const auto [bias, weights] = extras_of(inputs, has_bias, weighted);
      PairRows sink(out, weights, ids_array.size(), N);
      const size_t expert_bytes = N * K * (bf16 ? 2 : 4);
      float_experts(xf, K, experts_of_pairs(ids_array, E), ids_array.shape(1), shared, E, bias, sink, N,
                    [&](size_t e, const float* rows, size_t m, float* y) {
                      float_linear_rows(rows, m, K, wb + e * expert_bytes, bf16, N, y);
                    });
    };
  }

  bool has_bias_, weighted_;
};

}  // namespace

mx::array gather_quantized_linear(const mx::array& x, const mx::array& ids, const QuantizedMatrix& q,
                                  Activations activations, const ExpertsOptions& o, mx::StreamOrDevice s) {
  const int T = ids.shape(0), k = ids.shape(1), E = q.w.shape(0), N = q.w.shape(1);
  // Our kernel for what the dense one takes (affine 4 and 8 bits, x and
  // the scales float32 or bfloat16); MLX's gather_qmm for the rest.
  const bool supported = q.mode == "affine" && (q.bits == 4 || q.bits == 8) && q.biases &&
                         float32_or_bfloat16(x.dtype()) && float32_or_bfloat16(q.scales.dtype()) && x.size() > 0 &&
                         ids.size() > 0 && N > 0 &&  // (empty calls: MLX's ops)
                         (!o.weights || (x.dtype() == mx::float32 && o.weights->dtype() == mx::float32));
  auto fallback = [q, o, E](const std::vector<mx::array>& in, mx::Stream s) {
    const auto& x = in[0];
    const auto ids = clamped_indices(in[1], E, s);
    // x as gather_qmm's left operand [T, 1 or k, 1, K] (its batch index is the position: row t, or row t's expert j)
    auto left = x.ndim() == 2 ? mx::expand_dims(x, {1, 2}, s) : mx::expand_dims(x, 2, s);
    auto rows = [&](const mx::array& a) { return q.tiled ? untiled(a, s) : a; };
    // (affine scales and biases in x's dtype: MLX's kernels compute in one type)
    auto param = [&](const mx::array& a) { return q.mode == "affine" ? mx::astype(rows(a), x.dtype(), s) : rows(a); };
    auto biases = q.biases ? std::optional(param(*q.biases)) : std::nullopt;
    auto y = mx::gather_qmm(left, mx::view(rows(q.w), mx::uint32, s), param(q.scales), biases, std::nullopt, ids,
                            /*transpose=*/true, q.group_size, q.bits, q.mode, std::nullopt, false, s);
    return finish_ops(mx::squeeze(y, 2, s), o.bias, o.weights, ids, s);
  };
  std::vector<mx::array> in = {x, ids};
  if (supported) {
    in.push_back(row_contiguous(q.w));
    in.push_back(row_contiguous(q.scales));
    in.push_back(row_contiguous(*q.biases));
    if (o.bias) in.push_back(row_contiguous(*o.bias));
    if (o.weights) in.push_back(*o.weights);
  }
  const mx::Shape shape = o.weights ? mx::Shape{T, N} : mx::Shape{T, k, N};
  return CpuKernel::build(s, supported, std::move(in), shape, x.dtype(), fallback, [&](mx::Stream s) {
    return std::make_shared<GatherQuantizedLinear>(s, q.group_size, q.bits, activations, q.tiled, o.bias.has_value(),
                                                   o.weights.has_value());
  });
}

mx::array gather_linear(const mx::array& x, const mx::array& ids, const mx::array& w, const ExpertsOptions& o,
                        mx::StreamOrDevice s) {
  const int T = ids.shape(0), k = ids.shape(1), E = w.shape(0), N = w.shape(1);
  const bool supported = float32_or_bfloat16(w.dtype()) && x.dtype() == w.dtype() && x.size() > 0 && ids.size() > 0 &&
                         w.size() > 0 &&  // (empty calls: MLX's ops)
                         (!o.weights || (x.dtype() == mx::float32 && o.weights->dtype() == mx::float32));
  auto fallback = [o, E](const std::vector<mx::array>& in, mx::Stream s) {
    const auto &x = in[0], &w = in[2];
    const auto ids = clamped_indices(in[1], E, s);
    auto left = x.ndim() == 2 ? mx::expand_dims(x, {1, 2}, s) : mx::expand_dims(x, 2, s);
    auto y = mx::gather_mm(left, mx::swapaxes(w, 1, 2, s), std::nullopt, ids, false, s);
    return finish_ops(mx::squeeze(y, 2, s), o.bias, o.weights, ids, s);
  };
  std::vector<mx::array> in = {x, ids, supported ? row_contiguous(w) : w};
  if (supported && o.bias) in.push_back(row_contiguous(*o.bias));
  if (supported && o.weights) in.push_back(*o.weights);
  const mx::Shape shape = o.weights ? mx::Shape{T, N} : mx::Shape{T, k, N};
  return CpuKernel::build(s, supported, std::move(in), shape, x.dtype(), fallback, [&](mx::Stream s) {
    return std::make_shared<GatherLinear>(s, o.bias.has_value(), o.weights.has_value());
  });
}

}  // namespace emlx
