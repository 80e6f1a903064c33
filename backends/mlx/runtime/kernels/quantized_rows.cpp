#include "quantized_rows.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "quantized_dot.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// Inputs ids, weight, scales, biases.
class QuantizedRows : public CpuKernel {
 public:
  QuantizedRows(mx::Stream s, int group, int bits, bool tiled, bool round_bf16)
      : CpuKernel(s), group_(group), bits_(bits), tiled_(tiled), round_bf16_(round_bf16) {}

  const char* name() const override { return "EmlxQuantizedRows"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const QuantizedRows&>(other);
    return group_ == o.group_ && bits_ == o.bits_ && tiled_ == o.tiled_ && round_bf16_ == o.round_bf16_;
  }

 private:
  CpuTask task() const override {
    return [group = group_, bits = bits_, tiled = tiled_, round_bf16 = round_bf16_](
               const std::vector<mx::array>& in, mx::array& out) {
      const auto &ids = in[0], &w = in[1], &scales = in[2], &biases = in[3];
      const int64_t N = w.shape(0), words = w.shape(1), groups = scales.shape(1), K = out.shape(-1);
      const int64_t whole = tiled ? N / static_cast<int64_t>(kTileRows) * static_cast<int64_t>(kTileRows) : 0;
      const bool params_bf16 = scales.dtype() == mx::bfloat16, out_bf16 = out.dtype() == mx::bfloat16;
      const uint32_t mask = (1u << bits) - 1;
      const int per_word = 32 / bits;
      std::vector<float> row(K);
      // (the tables as stored: row-contiguous [N, C], see stored())
      for (int64_t i = 0; i < static_cast<int64_t>(ids.size()); ++i) {
        int64_t at = 0, rest = i;
        for (int d = static_cast<int>(ids.ndim()) - 1; d >= 0; --d) {
          at += (rest % ids.shape(d)) * ids.strides()[d];
          rest /= ids.shape(d);
        }
        const int64_t r = wrapped_row(integer_at(ids, at), N);
        // element c of row r: at r * C + c in rows, at c * 16 + r % 16 of its tile [C, 16] when tiled
        const int64_t lanes = static_cast<int64_t>(kTileRows), stride = r < whole ? lanes : 1;
        const auto first = [&](int64_t C) { return r < whole ? (r / lanes) * C * lanes + r % lanes : r * C; };
        const uint32_t* word = w.data<uint32_t>() + first(words);
        const int64_t params = first(groups);
        for (int64_t c = 0; c < words; ++c) {  // (a word's values lie in one group)
          const int64_t g = c * per_word / group;
          const float scale = float_at(scales.data<void>(), params + g * stride, params_bf16);
          const float bias = float_at(biases.data<void>(), params + g * stride, params_bf16);
          const uint32_t packed = word[c * stride];
          for (int k = 0; k < per_word; ++k) {
            // two roundings, as MLX's multiply and add (the product is exact in float32)
            float v = static_cast<float>((packed >> (k * bits)) & mask) * scale;
            if (round_bf16) v = bf16_to_f32(f32_to_bf16(v));
            v = v + bias;
            row[c * per_word + k] = round_bf16 ? bf16_to_f32(f32_to_bf16(v)) : v;
          }
        }
        if (out_bf16) {
          auto* dst = out.data<uint16_t>() + i * K;
          for (int64_t j = 0; j < K; ++j) dst[j] = f32_to_bf16(row[j]);
        } else {
          std::memcpy(out.data<float>() + i * K, row.data(), K * sizeof(float));
        }
      }
    };
  }

  int group_, bits_;
  bool tiled_, round_bf16_;
};

// The kernel reads the tables as stored [N, C] (constants are).
bool stored(const mx::array& a) { return a.is_available() && a.flags().row_contiguous; }

}  // namespace

mx::array quantized_rows(const QuantizedMatrix& q, const mx::array& ids, mx::Dtype dtype, mx::StreamOrDevice s) {
  const int N = q.w.shape(0);
  const int K = static_cast<int>(static_cast<int64_t>(q.w.shape(1)) * 32 / std::max(q.bits, 1));
  // what dequantize computes in: the scales' type, widened to float32 unless it is the output's
  const bool widen = q.scales.dtype() != dtype;
  const bool supported = q.mode == "affine" && q.biases && (q.bits == 2 || q.bits == 4 || q.bits == 8) &&
                         float32_or_bfloat16(dtype) && float32_or_bfloat16(q.scales.dtype()) &&
                         q.biases->dtype() == q.scales.dtype() && q.w.ndim() == 2 && stored(q.w) &&
                         stored(q.scales) && stored(*q.biases);
  std::vector<mx::array> inputs = {ids, q.w, q.scales};
  if (q.biases) inputs.push_back(*q.biases);
  auto fallback = [q, N, dtype, widen](const std::vector<mx::array>& in, mx::Stream s) {
    const auto clipped = mx::clip(in[0], mx::array(-N, in[0].dtype()), mx::array(N - 1, in[0].dtype()), s);
    auto rows = take_rows({in.begin() + 1, in.end()}, clipped, q.tiled, s);
    const bool affine = q.mode == "affine";
    auto param = [&](const mx::array& a) { return affine && widen ? mx::astype(a, mx::float32, s) : a; };
    auto biases = rows.size() > 2 ? std::optional<mx::array>(param(rows[2])) : std::nullopt;
    return mx::dequantize(mx::view(rows[0], mx::uint32, s), param(rows[1]), biases, q.group_size, q.bits, q.mode,
                          std::nullopt, dtype, s);
  };
  auto shape = ids.shape();
  shape.push_back(K);
  const bool round_bf16 = !widen && dtype == mx::bfloat16;
  return CpuKernel::build(s, supported, std::move(inputs), std::move(shape), dtype, fallback,
                          [&](mx::Stream s) {
                            return std::make_shared<QuantizedRows>(s, q.group_size, q.bits, q.tiled, round_bf16);
                          });
}

}  // namespace emlx
