#include "heads.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "cache_write.h"
#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "norm.h"
#include "rope.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// The heads of x's rows as the kernels read them: x (any strides), the
// norm's weight (row-contiguous) when normalized, cos and sin (broadcast to
// [B, H, L, D]) when rotated.
class HeadRows {
 public:
  HeadRows(const std::vector<mx::array>& inputs, size_t first, int start, bool normalized, float eps, bool rotated,
           const mx::Shape& shape)
      : x_(inputs[first].data<float>()), xs_(inputs[first].strides()), start_(start), eps_(eps) {
    size_t next = first + 1;
    if (normalized) weight_ = inputs[next++].data<float>();
    if (rotated) {
      cos_ = inputs[next].data<float>(), sin_ = inputs[next + 1].data<float>();
      cs_ = broadcast_strides(inputs[next], shape), ss_ = broadcast_strides(inputs[next + 1], shape);
    }
  }

  // Head h of x's row (b, l) into `row` (D floats): copied, normalized,
  // rotated as asked; `scratch` holds D floats when normalized.
  void write(int64_t b, int64_t h, int64_t l, int64_t D, float* scratch, float* row) const {
    const float* src = x_ + b * xs_[0] + l * xs_[1] + (start_ + h * D) * xs_[2];
    int64_t stride = xs_[2];
    if (weight_) {  // the norm reads a contiguous row, as RmsNormNode's kernel does
      for (int64_t d = 0; d < D; ++d) scratch[d] = src[d * stride];
      normalize_row(scratch, weight_, eps_, D, cos_ ? scratch : row);
      src = scratch, stride = 1;
    }
    if (cos_) {
      const float* c = cos_ + b * cs_[0] + h * cs_[1] + l * cs_[2];
      const float* sn = sin_ + b * ss_[0] + h * ss_[1] + l * ss_[2];
      rotate_row({src, stride}, {c, cs_[3]}, {sn, ss_[3]}, D, row);
    } else if (!weight_) {
      for (int64_t d = 0; d < D; ++d) row[d] = src[d * stride];
    }
  }

 private:
  const float* x_;
  mx::Strides xs_;
  int start_;
  float eps_;
  const float* weight_ = nullptr;
  const float *cos_ = nullptr, *sin_ = nullptr;
  std::vector<int64_t> cs_, ss_;
};

// What both heads kernels do to each head.
class HeadsKernel : public CpuKernel {
 public:
  HeadsKernel(mx::Stream s, int start, bool normalized, float eps, bool rotated)
      : CpuKernel(s), start_(start), normalized_(normalized), eps_(eps), rotated_(rotated) {}

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const HeadsKernel&>(other);
    return start_ == o.start_ && normalized_ == o.normalized_ && eps_ == o.eps_ && rotated_ == o.rotated_;
  }

 protected:
  int start_;
  bool normalized_;
  float eps_;
  bool rotated_;
};

// Inputs x, then the norm's weight and cos and sin as HeadRows reads them;
// output [B, H, L, D], row-contiguous.
class Heads : public HeadsKernel {
 public:
  using HeadsKernel::HeadsKernel;

  const char* name() const override { return "EmlxHeads"; }

 private:
  CpuTask task() const override {
    return [start = start_, normalized = normalized_, eps = eps_, rotated = rotated_](
               const std::vector<mx::array>& inputs, mx::array& out) {
      const mx::Shape& shape = out.shape();
      const int64_t H = shape[1], L = shape[2], D = shape[3];
      const HeadRows rows(inputs, 0, start, normalized, eps, rotated, shape);
      float* y = out.data<float>();
      parallel_rows(static_cast<int64_t>(out.size() / D), 64, [&](int64_t r0, int64_t r1) {
        std::vector<float> scratch(normalized ? D : 0);
        for (int64_t r = r0; r < r1; ++r) rows.write(r / (H * L), r / L % H, r % L, D, scratch.data(), y + r * D);
      });
    };
  }
};

// Inputs cache [B, H, S, D] float32, slots [L], then x and the rest as
// Heads takes them; the output takes the cache's buffer when CpuKernel could
// donate it, else starts as its copy. Each head goes straight to its slot.
class HeadsIntoCache : public HeadsKernel {
 public:
  using HeadsKernel::HeadsKernel;

  const char* name() const override { return "EmlxHeadsIntoCache"; }

 private:
  bool updates_first_input() const override { return true; }

  CpuTask task() const override {
    return [start = start_, normalized = normalized_, eps = eps_, rotated = rotated_](
               const std::vector<mx::array>& inputs, mx::array& out) {
      const auto &cache = inputs[0], &slots = inputs[1];
      copy_unless_donated(cache, out);
      float* dst = out.data<float>();
      const int64_t B = out.shape(0), H = out.shape(1), S = out.shape(2), D = out.shape(3), L = slots.shape(0);
      const HeadRows rows(inputs, 2, start, normalized, eps, rotated, {static_cast<int>(B), static_cast<int>(H),
                                                                        static_cast<int>(L), static_cast<int>(D)});
      std::vector<float> scratch(normalized ? D : 0);
      for (int64_t l = 0; l < L; ++l) {
        const int64_t slot = clamped_entry(slots, l, S);
        for (int64_t b = 0; b < B; ++b) {
          for (int64_t h = 0; h < H; ++h) rows.write(b, h, l, D, scratch.data(), dst + ((b * H + h) * S + slot) * D);
        }
      }
    };
  }
};

// Checks the arguments; whether our kernels take them (float32).
bool check_heads(const mx::array& x, HeadColumns columns, const HeadsOptions& o) {
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
  if (o.cos) check_rotation({x.shape(0), count, x.shape(1), D}, *o.cos, *o.sin, "HeadsNode");
  const auto f32 = [](const std::optional<mx::array>& a) { return !a || a->dtype() == mx::float32; };
  return x.dtype() == mx::float32 && x.size() > 0 && f32(o.norm) && f32(o.cos) && f32(o.sin);
}

// The options' arrays after a kernel's leading inputs, in the order HeadRows
// reads them (the norm's weight made row-contiguous for our kernel).
void append_head_operands(std::vector<mx::array>& in, const HeadsOptions& o, bool supported) {
  if (o.norm) in.push_back(supported ? row_contiguous(*o.norm) : *o.norm);
  if (o.cos) in.push_back(*o.cos), in.push_back(*o.sin);
}

}  // namespace

mx::array heads(const mx::array& x, HeadColumns columns, const HeadsOptions& o, mx::StreamOrDevice s) {
  const auto [start, count, D] = columns;
  const bool supported = check_heads(x, columns, o);
  const bool rotated = o.cos.has_value(), normalized = o.norm.has_value();
  const mx::Shape shape = {x.shape(0), count, x.shape(1), D};
  std::vector<mx::array> in = {x};
  append_head_operands(in, o, supported);
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

mx::array heads_into_cache(const mx::array& x, HeadColumns columns, const HeadsOptions& o, const HeadsCache& target,
                           mx::StreamOrDevice s) {
  const auto& [cache, slots] = target;
  const auto [start, count, D] = columns;
  bool supported = check_heads(x, columns, o);
  if (cache.ndim() != 4 || cache.shape(0) != x.shape(0) || cache.shape(1) != count || cache.shape(3) != D) {
    throw std::invalid_argument("HeadsNode: the cache must be [B, heads, S, head_dim]");
  }
  if (slots.ndim() != 1 || slots.shape(0) != x.shape(1) || !mx::issubdtype(slots.dtype(), mx::integer)) {
    throw std::invalid_argument("HeadsNode: slots must be [L] integers");
  }
  supported = supported && cache.dtype() == mx::float32 && cache.shape(2) > 0;
  std::vector<mx::array> in = {cache, slots, x};
  append_head_operands(in, o, supported);
  const bool rotated = o.cos.has_value(), normalized = o.norm.has_value();
  const float eps = o.eps;
  auto fallback = [columns, normalized, eps, rotated](const std::vector<mx::array>& in, mx::Stream s) {
    HeadsOptions o{std::nullopt, eps, std::nullopt, std::nullopt};
    if (normalized) o.norm = in[3];
    if (rotated) o.cos = in[in.size() - 2], o.sin = in.back();
    return cache_write(in[0], in[1], heads(in[2], columns, o, s), s);
  };
  return CpuKernel::build(s, supported, std::move(in), cache.shape(), cache.dtype(), fallback, [&](mx::Stream s) {
    return std::make_shared<HeadsIntoCache>(s, start, normalized, eps, rotated);
  });
}

}  // namespace emlx
