#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include "blas.h"
#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "thread_pool.h"
#include "vec8.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

// Queries per task: enough rows for a GEMM, few enough for every core to get work.
constexpr int kQueryBlock = 64;
// Fewer query rows than this: dot products instead of sgemm, each row's
// exactly as a one-row call's (kDotRows, cpu_kernel.h).
constexpr int64_t kGemmRows = kDotRows + 1;

// x . y over n floats, with eight independent partial sums.
inline float dot(const float* x, const float* y, int64_t n) {
  typedef float v8 __attribute__((vector_size(32)));
  v8 acc = {};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    v8 a, b;
    __builtin_memcpy(&a, x + i, sizeof a);
    __builtin_memcpy(&b, y + i, sizeof b);
    acc += a * b;
  }
  float s = 0;
  for (int k = 0; k < 8; ++k) s += acc[k];
  for (; i < n; ++i) s += x[i] * y[i];
  return s;
}

enum class MaskKind : int { None, Bool, Additive };

// Rows of a [.., rows, cols] float32 operand for one (batch, head): a pointer
// and a row stride. Rows whose elements are not adjacent are copied into
// `scratch` (a layout MLX views can have; slices of the cache do not).
const float* rows_of(const mx::array& a, int64_t b, int64_t h, std::vector<float>& scratch, int64_t& ld) {
  const auto& st = a.strides();
  const float* p = a.data<float>() + b * st[0] + h * st[1];
  const int64_t rows = a.shape(2), cols = a.shape(3);
  if (st[3] == 1) {
    ld = st[2];
    return p;
  }
  scratch.resize(rows * cols);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) scratch[r * cols + c] = p[r * st[2] + c * st[3]];
  }
  ld = cols;
  return scratch.data();
}

struct Task {
  const mx::array *q, *k, *v, *mask;
  MaskKind kind;
  float scale;
  int64_t S;                  // the key slots attended: k's first S
  int64_t mask_strides[4];    // the mask's element strides read as [B, H, L, k's slots] (broadcast axes 0)
  float* out;                 // [B, H, L, Dv] or, merged, [B, L, H, Dv]; contiguous
  int64_t out_head, out_row;  // strides of a head and of a query row in out
};

// Output row i of head h of batch b.
inline float* out_row(const Task& t, int64_t b, int64_t h, int64_t i) {
  const int64_t H = t.q->shape(1), L = t.q->shape(2);
  return t.out + b * H * L * t.v->shape(3) + h * t.out_head + i * t.out_row;
}

constexpr float kMasked = -std::numeric_limits<float>::infinity();

// The mask's [b, h] plane: boolean or additive (both null without a mask).
struct Plane {
  const uint8_t* bools = nullptr;
  const float* adds = nullptr;
};

Plane plane_of(const Task& t, int64_t b, int64_t h) {
  Plane p;
  if (t.kind == MaskKind::None) return p;
  const int64_t* st = t.mask_strides;
  const int64_t offset = b * st[0] + h * st[1];
  if (t.kind == MaskKind::Bool) p.bools = t.mask->data<uint8_t>() + offset;
  else p.adds = t.mask->data<float>() + offset;
  return p;
}

// Whether query row i may attend key column j (a mask given).
inline bool attends(const Task& t, const Plane& p, int64_t i, int64_t j) {
  const int64_t* st = t.mask_strides;
  if (t.kind == MaskKind::Bool) return p.bools[i * st[2] + j * st[3]] != 0;
  return p.adds[i * st[2] + j * st[3]] != kMasked;
}

// Widens [j0, j1) to the key columns that query rows [i0, i1) of plane p
// attend (S columns; a mask given).
void widen_to_attended(const Task& t, const Plane& p, int64_t i0, int64_t i1, int64_t S, int64_t& j0, int64_t& j1) {
  for (int64_t i = i0; i < i1; ++i) {
    int64_t first = 0, last = S;
    while (first < S && !attends(t, p, i, first)) ++first;
    while (last > first && !attends(t, p, i, last - 1)) --last;
    if (first < last) j0 = std::min(j0, first), j1 = std::max(j1, last);
  }
}

// Scores s of query row i for key columns c0, c0 + 1, ... (width of them):
// -inf outside [j0, j1) and where the mask forbids, the additive mask added.
inline void mask_scores(const Task& t, const Plane& p, int64_t i, float* s, int64_t c0, int64_t width, int64_t j0,
                        int64_t j1) {
  for (int64_t c = 0; c < width; ++c) {
    const int64_t j = c0 + c;
    if (j < j0 || j >= j1) {
      s[c] = kMasked;
    } else if (t.kind == MaskKind::Bool) {
      if (!attends(t, p, i, j)) s[c] = kMasked;
    } else if (t.kind == MaskKind::Additive) {
      const int64_t* st = t.mask_strides;
      s[c] += p.adds[i * st[2] + j * st[3]];
    }
  }
}

// Softmax of a score row in place (width a multiple of 8; lane l sums the
// columns l, l + 8, ...). False, s untouched, when every score is -inf.
EMLX_INLINE bool softmax_in_place(float* s, int64_t width) {
  v8 top8 = splat(kMasked);
  for (int64_t c = 0; c < width; c += 8) top8 = top8 > load8(s + c) ? top8 : load8(s + c);
  float top = kMasked;
  for (int l = 0; l < 8; ++l) top = std::max(top, top8[l]);
  if (top == kMasked) return false;
  v8 sum8 = {};
  for (int64_t c = 0; c < width; c += 8) {
    const v8 e = exp_nonpositive(load8(s + c) - top);
    store8(s + c, e);
    sum8 += e;
  }
  const float inv = 1.0f / sum_lanes(sum8);
  for (int64_t c = 0; c < width; c += 8) store8(s + c, load8(s + c) * inv);
  return true;
}

EMLX_INLINE void attend_block(const Task& t, int64_t b, int64_t h, int64_t i0, int64_t i1) {
  const mx::array &q = *t.q, &k = *t.k, &v = *t.v;
  const int64_t H = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int64_t Hkv = k.shape(1), S = t.S, Dv = v.shape(3);
  const int64_t g = h / (H / Hkv), rows = i1 - i0;
  thread_local std::vector<float> qs, ks, vs, scores;
  int64_t ldq, ldk, ldv;
  const float* qp = rows_of(q, b, h, qs, ldq) + i0 * ldq;
  const float* kp = rows_of(k, b, g, ks, ldk);
  const float* vp = rows_of(v, b, g, vs, ldv);
  float* out = out_row(t, b, h, i0);
  const int64_t ldo = t.out_row;
  const Plane plane = plane_of(t, b, h);
  // The key columns any query of the block attends: [j0, j1). A causal
  // mask leaves the later columns of early blocks out entirely.
  int64_t j0 = 0, j1 = S;
  if (t.kind != MaskKind::None) j0 = S, j1 = 0, widen_to_attended(t, plane, i0, i1, S, j0, j1);
  if (j1 <= j0) {  // a query that attends nothing gets zeros, as in torch
    for (int64_t r = 0; r < rows; ++r) std::fill(out + r * ldo, out + r * ldo + Dv, 0.0f);
    return;
  }
  // A decoding step has one query row: sgemm would first pack (copy) the
  // keys and values it reads once.
  const bool few = rows < kGemmRows;
  // Few rows: softmax lanes tied to absolute key columns, as in attend_few
  // (the columns added are masked for every row of the block).
  const int64_t c0 = few ? j0 & ~int64_t{7} : j0;
  // Score rows padded to whole vectors with -inf (e^-inf = 0).
  const int64_t cols = j1 - c0, ld = (cols + 7) & ~int64_t{7};
  scores.assign(rows * ld, kMasked);
  if (few) {
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) scores[r * ld + c] = t.scale * dot(qp + r * ldq, kp + (c0 + c) * ldk, D);
    }
  } else {
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, rows, cols, D, t.scale, qp, ldq, kp + c0 * ldk, ldk,
                      0.0f, scores.data(), ld);
  }
  for (int64_t r = 0; r < rows; ++r) {
    float* s = scores.data() + r * ld;
    if (t.kind != MaskKind::None) mask_scores(t, plane, i0 + r, s, c0, cols, j0, j1);
    if (!softmax_in_place(s, ld)) std::fill(s, s + ld, 0.0f);
  }
  if (few) {
    for (int64_t r = 0; r < rows; ++r) {
      float* o = out + r * ldo;
      std::fill(o, o + Dv, 0.0f);
      for (int64_t c = 0; c < cols; ++c) {
        const float p = scores[r * ld + c];
        const float* vr = vp + (c0 + c) * ldv;
        for (int64_t d = 0; d < Dv; ++d) o[d] += p * vr[d];
      }
    }
  } else {
    scipy_cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, Dv, cols, 1.0f, scores.data(), ld,
                      vp + c0 * ldv, ldv, 0.0f, out, ldo);
  }
}

void attend_block_generic(const Task& t, int64_t b, int64_t h, int64_t i0, int64_t i1) {
  attend_block(t, b, h, i0, i1);
}

// ---- Few query rows (decode steps, verify calls), in 8-float vectors ------
//
// Every (head, row) is computed by the same instructions whatever the other
// rows and heads of the call: a row's output is the one-row call's, bit for
// bit (kDotRows). Lanes of the softmax sums belong to absolute key columns
// (the range starts at a multiple of 8), so a wider range of key columns, which
// other rows of the call may need, only adds exact zeros.

// out[0, 8 NV) = sum over columns c in [c0, c1) of p[c - c0] * v row c.
template <int NV>
EMLX_INLINE void weighted_rows(const float* p, const float* vp, int64_t ldv, int64_t c0, int64_t c1, float* out) {
  v8 acc[NV] = {};
  for (int64_t c = c0; c < c1; ++c) {
    const v8 pc = splat(p[c - c0]);
    const float* vr = vp + c * ldv;
    for (int i = 0; i < NV; ++i) acc[i] += pc * load8(vr + 8 * i);
  }
  for (int i = 0; i < NV; ++i) store8(out + 8 * i, acc[i]);
}

// Query heads [h0, h1) of batch b, all of kv head g's group, every query row;
// D and Dv multiples of 8.
EMLX_INLINE void attend_few(const Task& t, int64_t b, int64_t g, int64_t h0, int64_t h1) {
  const mx::array &q = *t.q, &k = *t.k, &v = *t.v;
  const int64_t H = q.shape(1), L = q.shape(2), D = q.shape(3);
  const int64_t S = t.S, Dv = v.shape(3), heads = h1 - h0, nq = heads * L;
  thread_local std::vector<float> qbuf, ks, vs, scores;
  qbuf.resize(nq * D);
  for (int64_t h = h0; h < h1; ++h) {  // query rows, contiguous
    const auto& st = q.strides();
    const float* p = q.data<float>() + b * st[0] + h * st[1];
    for (int64_t r = 0; r < L; ++r) {
      float* dst = qbuf.data() + ((h - h0) * L + r) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = p[r * st[2] + d * st[3]];
    }
  }
  int64_t ldk, ldv;
  const float* kp = rows_of(k, b, g, ks, ldk);
  const float* vp = rows_of(v, b, g, vs, ldv);
  // The key columns any query attends: [j0, j1).
  int64_t j0 = 0, j1 = S;
  if (t.kind != MaskKind::None) {
    j0 = S, j1 = 0;
    for (int64_t h = h0; h < h1; ++h) widen_to_attended(t, plane_of(t, b, h), 0, L, S, j0, j1);
  }
  // query n: head h0 + n / L, row n % L
  auto out_of = [&](int64_t n) { return out_row(t, b, h0 + n / L, n % L); };
  if (j1 <= j0) {
    for (int64_t n = 0; n < nq; ++n) std::fill(out_of(n), out_of(n) + Dv, 0.0f);
    return;
  }
  const int64_t c0 = j0 & ~int64_t{7}, cols = (j1 - c0 + 7) & ~int64_t{7};
  scores.resize(nq * cols);
  for (int64_t c = 0; c < cols; c += 8) {  // 8 keys, read once for every query
    const float* key[8];
    for (int i = 0; i < 8; ++i) key[i] = kp + std::min(c0 + c + i, j1 - 1) * ldk;  // past j1: discarded
    for (int64_t n = 0; n < nq; ++n) {
      const float* qn = qbuf.data() + n * D;
      v8 acc[8] = {};
      for (int64_t d = 0; d < D; d += 8) {
        const v8 qv = load8(qn + d);
        for (int i = 0; i < 8; ++i) acc[i] += qv * load8(key[i] + d);
      }
      store8(scores.data() + n * cols + c, lane_sums(acc) * t.scale);
    }
  }
  for (int64_t n = 0; n < nq; ++n) {
    float* s = scores.data() + n * cols;
    mask_scores(t, plane_of(t, b, h0 + n / L), n % L, s, c0, cols, j0, j1);
    float* out = out_of(n);
    if (!softmax_in_place(s, cols)) {  // a query that attends nothing gets zeros, as in torch
      std::fill(out, out + Dv, 0.0f);
      continue;
    }
    int64_t d = 0;
    for (; d + 64 <= Dv; d += 64) weighted_rows<8>(s, vp + d, ldv, c0, j1, out + d);
    switch ((Dv - d) / 8) {
      case 7: weighted_rows<7>(s, vp + d, ldv, c0, j1, out + d); break;
      case 6: weighted_rows<6>(s, vp + d, ldv, c0, j1, out + d); break;
      case 5: weighted_rows<5>(s, vp + d, ldv, c0, j1, out + d); break;
      case 4: weighted_rows<4>(s, vp + d, ldv, c0, j1, out + d); break;
      case 3: weighted_rows<3>(s, vp + d, ldv, c0, j1, out + d); break;
      case 2: weighted_rows<2>(s, vp + d, ldv, c0, j1, out + d); break;
      case 1: weighted_rows<1>(s, vp + d, ldv, c0, j1, out + d); break;
      default: break;
    }
  }
}

void attend_few_generic(const Task& t, int64_t b, int64_t g, int64_t h0, int64_t h1) { attend_few(t, b, g, h0, h1); }

#if defined(__x86_64__)
// The same code for AVX2+FMA machines.
__attribute__((target("avx2,fma"))) void attend_few_avx2(const Task& t, int64_t b, int64_t g, int64_t h0, int64_t h1) {
  attend_few(t, b, g, h0, h1);
}

__attribute__((target("avx2,fma"))) void attend_block_avx2(const Task& t, int64_t b, int64_t h, int64_t i0,
                                                           int64_t i1) {
  attend_block(t, b, h, i0, i1);
}
#else
constexpr auto attend_few_avx2 = attend_few_generic;
constexpr auto attend_block_avx2 = attend_block_generic;
#endif

class Attention : public CpuKernel {
 public:
  Attention(mx::Stream s, float scale, MaskKind kind, bool keys, bool merge_heads)
      : CpuKernel(s), scale_(scale), kind_(kind), keys_(keys), merge_heads_(merge_heads) {}

  const char* name() const override { return "EmlxAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Attention&>(other);
    return scale_ == o.scale_ && kind_ == o.kind_ && keys_ == o.keys_ && merge_heads_ == o.merge_heads_;
  }

 private:
  CpuTask task() const override {
    return [scale = scale_, kind = kind_, keys = keys_, merge = merge_heads_](const std::vector<mx::array>& inputs,
                                                                             mx::array& out) {
      use_single_threaded_blas();
      const auto &q = inputs[0], &k = inputs[1], &v = inputs[2];
      const int64_t B = q.shape(0), H = q.shape(1), L = q.shape(2), Dv = v.shape(3);
      const int64_t Hkv = k.shape(1), G = H / Hkv, slots = k.shape(2);
      const mx::array* mask = kind == MaskKind::None ? nullptr : &inputs[3];
      // (read here, where it is computed: no wait for it while the graph is built)
      const int64_t S = keys ? std::clamp<int64_t>(integer_at(inputs.back(), 0), 0, slots) : slots;
      Task t{&q, &k, &v, mask, kind, scale, S, {}, out.data<float>(), merge ? Dv : L * Dv, merge ? H * Dv : Dv};
      if (mask) {
        const auto st = broadcast_strides(*mask, {static_cast<int>(B), static_cast<int>(H), static_cast<int>(L),
                                                  static_cast<int>(slots)});
        std::copy(st.begin(), st.end(), t.mask_strides);
      }
      if (L < kGemmRows && q.shape(3) % 8 == 0 && Dv % 8 == 0) {
        // A kv head's query heads together (its keys read once), split when
        // there are fewer kv heads than threads.
        const int64_t chunks = std::min(G, std::max<int64_t>(1, (pool_size() + B * Hkv - 1) / (B * Hkv)));
        const int64_t per = (G + chunks - 1) / chunks;
        const auto few = has_avx2() ? attend_few_avx2 : attend_few_generic;
        parallel_for(static_cast<int>(B * Hkv * chunks), [&](int task) {
          const int64_t bg = task / chunks, g = bg % Hkv, h0 = g * G + task % chunks * per;
          if (h0 < g * G + G) few(t, bg / Hkv, g, h0, std::min(g * G + G, h0 + per));
        });
        return;
      }
      const int64_t blocks = (L + kQueryBlock - 1) / kQueryBlock;
      const auto block_of = has_avx2() ? attend_block_avx2 : attend_block_generic;
      parallel_for(static_cast<int>(B * H * blocks), [&](int task) {
        const int64_t block = task % blocks, bh = task / blocks;
        const int64_t i0 = block * kQueryBlock;
        block_of(t, bh / H, bh % H, i0, std::min(L, i0 + kQueryBlock));
      });
    };
  }

  float scale_;
  MaskKind kind_;
  bool keys_, merge_heads_;
};

// MLX's attention over the first `keys` slots (read on the host: a wait for
// it), heads merged when asked.
mx::array attention_ops(const std::vector<mx::array>& in, const AttentionOptions& o, mx::Stream s) {
  auto k = in[1], v = in[2];
  std::optional<mx::array> mask = o.mask ? std::optional(in[3]) : std::nullopt;
  const int B = in[0].shape(0), H = in[0].shape(1), L = in[0].shape(2), Dv = v.shape(3);
  if (o.keys) {
    const int slots = k.shape(2);
    const int n = static_cast<int>(std::clamp<int64_t>(mx::astype(in.back(), mx::int64).item<int64_t>(), 0, slots));
    if (n == 0) {  // nothing attended: zeros, as the kernel gives
      return o.merge_heads ? mx::zeros({B, L, H * Dv}, v.dtype(), s) : mx::zeros({B, H, L, Dv}, v.dtype(), s);
    }
    k = mx::slice(k, {0, 0, 0, 0}, {k.shape(0), k.shape(1), n, k.shape(3)}, s);
    v = mx::slice(v, {0, 0, 0, 0}, {v.shape(0), v.shape(1), n, Dv}, s);
    if (mask && mask->ndim() > 0 && mask->shape(-1) == slots) {
      mx::Shape stop = mask->shape();
      stop.back() = n;
      mask = mx::slice(*mask, mx::Shape(mask->ndim(), 0), stop, s);
    }
  }
  auto out = mx::fast::scaled_dot_product_attention(in[0], k, v, o.scale, o.causal ? "causal" : "", mask, {}, false, s);
  return o.merge_heads ? mx::reshape(mx::transpose(out, {0, 2, 1, 3}, s), {B, L, H * Dv}, s) : out;
}

}  // namespace

mx::array attention(const mx::array& q, const mx::array& k, const mx::array& v, const AttentionOptions& o,
                    mx::StreamOrDevice s) {
  const bool f32 = q.dtype() == mx::float32 && k.dtype() == mx::float32 && v.dtype() == mx::float32;
  const bool mask_ok = !o.mask || o.mask->dtype() == mx::bool_ || o.mask->dtype() == mx::float32;
  const bool supported = !o.causal && f32 && mask_ok && q.size() > 0 && k.shape(2) > 0;
  const int B = q.shape(0), H = q.shape(1), L = q.shape(2), S = k.shape(2), Dv = v.shape(3);
  if (o.mask && !broadcasts_to(*o.mask, {B, H, L, S})) {
    throw std::invalid_argument("ScaledDotProductAttentionNode: the mask must broadcast to [B, H, L, S]");
  }
  if (o.keys && (o.keys->ndim() != 0 || !(mx::issubdtype(o.keys->dtype(), mx::integer)))) {
    throw std::invalid_argument("ScaledDotProductAttentionNode: keys must be a 0-d integer");
  }
  std::vector<mx::array> in = {q, k, v};
  MaskKind kind = MaskKind::None;
  if (o.mask) {
    in.push_back(*o.mask);  // (the kernel reads it broadcast: stride 0 on broadcast axes)
    kind = o.mask->dtype() == mx::bool_ ? MaskKind::Bool : MaskKind::Additive;
  }
  if (o.keys) in.push_back(*o.keys);
  const mx::Shape shape = o.merge_heads ? mx::Shape{B, L, H * Dv} : mx::Shape{B, H, L, Dv};
  return CpuKernel::build(
      s, supported, std::move(in), shape, mx::float32,
      [o](const std::vector<mx::array>& in, mx::Stream s) { return attention_ops(in, o, s); },
      [&](mx::Stream s) { return std::make_shared<Attention>(s, o.scale, kind, o.keys.has_value(), o.merge_heads); });
}

}  // namespace emlx
