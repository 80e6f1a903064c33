#include "sampler.h"

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>
#include <mlx/primitives.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr float kPosInf = std::numeric_limits<float>::infinity();
// exp(z) below this counts as 0: such a token has < 1.7e-38 of the top
// token's probability, far below what a 53-bit uniform can resolve.
constexpr float kExpFloor = -87.0f;
// The draw walks per-block sums first, then one block.
constexpr int kBlock = 256;
// top-k up to this K keeps a heap of the K largest; above, nth_element.
constexpr int kHeapTopK = 1024;

// ------------------------------------------------------------ passes --
// The hot passes over a row of V floats, in portable C++ and (on x86-64
// machines that have it) AVX2.

float load_generic(const float* in, float* x, int V) {
  float m = kNegInf;
  for (int i = 0; i < V; ++i) {
    const float v = in[i] != in[i] ? kNegInf : in[i];  // NaN counts as -inf
    x[i] = v;
    m = v > m ? v : m;
  }
  return m;
}

float max_generic(const float* x, int V) {
  float m = kNegInf;
  for (int i = 0; i < V; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// z = (x - m) / T in float32 (SAMPLING.md step 3); -inf stays -inf.
void scale_generic(float* x, int V, float m, float T) {
  for (int i = 0; i < V; ++i) x[i] = x[i] > kNegInf ? (x[i] - m) / T : kNegInf;
}

// Sum of exp(z) over z >= lo, and how many such z are finite.
double exp_sum_generic(const float* z, int V, float lo, int* count) {
  double s = 0;
  int n = 0;
  for (int i = 0; i < V; ++i) {
    if (z[i] >= lo && z[i] > kNegInf) ++n, s += z[i] >= kExpFloor ? std::exp(z[i]) : 0.0f;
  }
  *count = n;
  return s;
}

// In place: e = exp(z) where z >= lo, else 0; per-block sums; the total.
double exp_blocks_generic(float* z, int V, float lo, double* sums) {
  lo = std::max(lo, kExpFloor);
  double total = 0;
  for (int b0 = 0, blk = 0; b0 < V; b0 += kBlock, ++blk) {
    float s = 0;
    for (int i = b0; i < std::min(V, b0 + kBlock); ++i) {
      z[i] = z[i] >= lo ? std::exp(z[i]) : 0.0f;
      s += z[i];
    }
    sums[blk] = s, total += s;
  }
  return total;
}

// The first index >= from whose z is > t (V if none).
int next_above_generic(const float* z, int from, int V, float t) {
  while (from < V && !(z[from] > t)) ++from;
  return from;
}

#if defined(__x86_64__)
#define EMLX_AVX2 __attribute__((target("avx2,fma")))

EMLX_AVX2 inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  return _mm_cvtss_f32(m);
}

EMLX_AVX2 inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// exp for x in [kExpFloor, 0] (Cephes' expf: range reduction by ln 2, then
// a degree-6 polynomial); relative error about 2e-7.
EMLX_AVX2 inline __m256 exp256(__m256 x) {
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

EMLX_AVX2 float load_avx2(const float* in, float* x, int V) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  __m256 m = ninf;
  int i = 0;
  for (; i + 8 <= V; i += 8) {
    __m256 v = _mm256_loadu_ps(in + i);
    v = _mm256_blendv_ps(v, ninf, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    _mm256_storeu_ps(x + i, v);
    m = _mm256_max_ps(m, v);
  }
  float r = hmax(m);
  for (; i < V; ++i) {
    x[i] = in[i] != in[i] ? kNegInf : in[i];
    r = x[i] > r ? x[i] : r;
  }
  return r;
}

EMLX_AVX2 float max_avx2(const float* x, int V) {
  __m256 m = _mm256_set1_ps(kNegInf);
  int i = 0;
  for (; i + 8 <= V; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
  float r = hmax(m);
  for (; i < V; ++i) r = x[i] > r ? x[i] : r;
  return r;
}

EMLX_AVX2 void scale_avx2(float* x, int V, float m, float T) {
  const __m256 ninf = _mm256_set1_ps(kNegInf), vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(T);
  int i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    const __m256 z = _mm256_div_ps(_mm256_sub_ps(v, vm), vt);
    _mm256_storeu_ps(x + i, _mm256_blendv_ps(ninf, z, _mm256_cmp_ps(v, ninf, _CMP_GT_OQ)));
  }
  scale_generic(x + i, V - i, m, T);
}

EMLX_AVX2 double exp_sum_avx2(const float* z, int V, float lo, int* count) {
  const __m256 vlo = _mm256_set1_ps(lo), floor = _mm256_set1_ps(kExpFloor), ninf = _mm256_set1_ps(kNegInf);
  double s = 0;
  int n = 0, i = 0;
  while (i + 8 <= V) {
    __m256 acc = _mm256_setzero_ps();
    for (const int end = std::min(V - 7, i + kBlock); i < end; i += 8) {
      const __m256 v = _mm256_loadu_ps(z + i);
      const __m256 keep = _mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GE_OQ), _mm256_cmp_ps(v, ninf, _CMP_GT_OQ));
      n += __builtin_popcount(_mm256_movemask_ps(keep));
      acc = _mm256_add_ps(acc, _mm256_and_ps(exp256(_mm256_max_ps(v, floor)),
                                             _mm256_and_ps(keep, _mm256_cmp_ps(v, floor, _CMP_GE_OQ))));
    }
    s += hsum(acc);
  }
  int tail = 0;
  s += exp_sum_generic(z + i, V - i, lo, &tail);
  *count = n + tail;
  return s;
}

EMLX_AVX2 double exp_blocks_avx2(float* z, int V, float lo, double* sums) {
  lo = std::max(lo, kExpFloor);
  const __m256 vlo = _mm256_set1_ps(lo), floor = _mm256_set1_ps(kExpFloor);
  double total = 0;
  for (int b0 = 0, blk = 0; b0 < V; b0 += kBlock, ++blk) {
    const int b1 = std::min(V, b0 + kBlock);
    __m256 acc = _mm256_setzero_ps();
    int i = b0;
    for (; i + 8 <= b1; i += 8) {
      const __m256 v = _mm256_loadu_ps(z + i);
      const __m256 e = _mm256_and_ps(exp256(_mm256_max_ps(v, floor)), _mm256_cmp_ps(v, vlo, _CMP_GE_OQ));
      _mm256_storeu_ps(z + i, e);
      acc = _mm256_add_ps(acc, e);
    }
    float s = hsum(acc);
    for (; i < b1; ++i) {
      z[i] = z[i] >= lo ? std::exp(z[i]) : 0.0f;
      s += z[i];
    }
    sums[blk] = s, total += s;
  }
  return total;
}

EMLX_AVX2 int next_above_avx2(const float* z, int from, int V, float t) {
  const __m256 vt = _mm256_set1_ps(t);
  for (; from + 8 <= V; from += 8) {
    const int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + from), vt, _CMP_GT_OQ));
    if (bits) return from + __builtin_ctz(bits);
  }
  return next_above_generic(z, from, V, t);
}

bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return yes;
}
#endif

struct Passes {
  float (*load)(const float*, float*, int);
  float (*max)(const float*, int);
  void (*scale)(float*, int, float, float);
  double (*exp_sum)(const float*, int, float, int*);
  double (*exp_blocks)(float*, int, float, double*);
  int (*next_above)(const float*, int, int, float);
};

const Passes& passes() {
  static const Passes generic{load_generic, max_generic, scale_generic,
                              exp_sum_generic, exp_blocks_generic, next_above_generic};
#if defined(__x86_64__)
  static const Passes avx2{load_avx2, max_avx2, scale_avx2, exp_sum_avx2, exp_blocks_avx2, next_above_avx2};
  if (has_avx2()) return avx2;
#endif
  return generic;
}

// --------------------------------------------------------------- rows --
struct Row {
  float temperature;
  int top_k;         // <= 0: off
  float top_p;       // >= 1 (or NaN): off
  float min_p;       // <= 0 (or NaN): off
  float repetition;  // 1: off
  float frequency, presence;
  const int32_t* history;
  int history_len;
  const int32_t* bias_ids;
  const float* bias_values;
  int bias_len;
  double u;  // uniform in [0, 1) from the row's random words
};

// SAMPLING.md step 1, on the few tokens the history and the bias name.
void penalize(float* x, int V, const Row& r, std::vector<int32_t>& ids) {
  if (r.history_len && (r.repetition != 1.0f || r.frequency != 0.0f || r.presence != 0.0f)) {
    ids.assign(r.history, r.history + r.history_len);
    std::sort(ids.begin(), ids.end());
    for (size_t i = 0; i < ids.size();) {
      size_t j = i;
      while (j < ids.size() && ids[j] == ids[i]) ++j;
      const int32_t id = ids[i];
      if (id >= 0 && id < V) {
        float v = x[id];
        if (r.repetition != 1.0f) v = v > 0 ? v / r.repetition : v * r.repetition;
        v = (v - r.frequency * static_cast<float>(j - i)) - r.presence;
        x[id] = v != v ? kNegInf : v;
      }
      i = j;
    }
  }
  for (int j = 0; j < r.bias_len; ++j) {
    const int32_t id = r.bias_ids[j];
    if (id < 0 || id >= V) continue;
    const float v = x[id] + r.bias_values[j];
    x[id] = v != v ? kNegInf : v;  // +inf logit with a -inf bias: banned
  }
}

// The K-th largest z (tie-inclusive threshold of top-k), 0 < K < V.
float kth_largest(const float* z, int V, int K, const Passes& p, std::vector<float>& tmp) {
  if (K > kHeapTopK) {
    tmp.assign(z, z + V);
    std::nth_element(tmp.begin(), tmp.begin() + (K - 1), tmp.end(), std::greater<float>());
    return tmp[K - 1];
  }
  tmp.assign(z, z + K);
  std::make_heap(tmp.begin(), tmp.end(), std::greater<float>());  // min-heap of the K largest so far
  for (int i = p.next_above(z, K, V, tmp.front()); i < V; i = p.next_above(z, i + 1, V, tmp.front())) {
    std::pop_heap(tmp.begin(), tmp.end(), std::greater<float>());
    tmp.back() = z[i];
    std::push_heap(tmp.begin(), tmp.end(), std::greater<float>());
  }
  return tmp.front();
}

// One draw among candidate ids with masses e (any order: the draw is exact).
int64_t draw(const std::vector<int>& ids, const std::vector<double>& e, size_t n, double total, double u) {
  const double target = u * total;
  double cum = 0;
  int64_t last = -1;
  for (size_t j = 0; j < n; ++j) {
    if (e[j] <= 0) continue;
    cum += e[j], last = ids[j];
    if (cum > target) return ids[j];
  }
  return last;  // rounding carried the target past the end
}

int64_t sample_row(const float* logits, int V, const Row& r, const Passes& p) {
  thread_local std::vector<float> x, tmp;
  thread_local std::vector<double> sums, mass;
  thread_local std::vector<int> cand;
  thread_local std::vector<int32_t> ids;
  x.resize(V);
  float m = p.load(logits, x.data(), V);
  if (r.history_len || r.bias_len) {
    penalize(x.data(), V, r, ids);
    m = p.max(x.data(), V);
  }
  if (!(m > kNegInf)) return -1;  // no finite logit and no +inf
  if (!(r.temperature > 0)) {     // greedy: the lowest index of the max
    return std::find(x.begin(), x.end(), m) - x.begin();
  }
  if (m == kPosInf) {  // the draw is uniform among the +inf tokens
    cand.clear();
    for (int i = 0; i < V; ++i) {
      if (x[i] == kPosInf) cand.push_back(i);
    }
    return cand[std::min(cand.size() - 1, static_cast<size_t>(r.u * cand.size()))];
  }
  float* z = x.data();
  p.scale(z, V, m, r.temperature);
  float thr = kNegInf;
  const bool top_k = r.top_k > 0 && r.top_k < V;
  if (top_k) thr = kth_largest(z, V, r.top_k, p, tmp);
  if (r.min_p > 0) thr = std::max(thr, std::min(0.0f, std::log(r.min_p)));  // the max always stays
  const bool few = top_k && r.top_k <= kHeapTopK;  // survivors: about K, collected directly
  if (!(r.top_p < 1) && !few) {                     // temperature and min-p: one pass, then a walk
    sums.resize((V + kBlock - 1) / kBlock);
    const double total = p.exp_blocks(z, V, thr, sums.data());
    const double target = r.u * total;
    double cum = 0;
    for (size_t b = 0; b < sums.size(); ++b) {
      if (cum + sums[b] <= target) {
        cum += sums[b];
        continue;
      }
      for (int i = b * kBlock; i < std::min<int>(V, (b + 1) * kBlock); ++i) {
        cum += z[i];
        if (cum > target && z[i] > 0) return i;
      }
    }
    for (int i = V - 1; i >= 0; --i) {
      if (z[i] > 0) return i;  // rounding carried the target past the end
    }
    return std::max_element(z, z + V) - z;
  }
  // Candidates: the survivors of top-k / min-p; for top-p without a small
  // K, only tokens that can be in the nucleus. A token whose probability is
  // below (1 - P) / n (n survivors) has at least P of the mass above it.
  float lo = thr;
  double total = 0;
  if (!few) {
    int n = 0;
    total = p.exp_sum(z, V, thr, &n);
    const double outside = 1.0 - std::max(0.0, static_cast<double>(r.top_p));
    lo = std::max(thr, static_cast<float>(std::log(outside * total / std::max(n, 1))) - 1e-3f);
  }
  cand.clear();
  for (int i = p.next_above(z, 0, V, kNegInf); i < V; i = p.next_above(z, i + 1, V, kNegInf)) {
    if (z[i] >= lo) cand.push_back(i);
  }
  if (!(r.top_p < 1)) {  // top-k alone (or with min-p)
    mass.resize(cand.size());
    double s = 0;
    for (size_t j = 0; j < cand.size(); ++j) s += mass[j] = z[cand[j]] >= kExpFloor ? std::exp(z[cand[j]]) : 0.0;
    return draw(cand, mass, cand.size(), s, r.u);
  }
  // top-p: by decreasing z; keep a tie group while the mass strictly above it is < P
  std::sort(cand.begin(), cand.end(), [z](int a, int b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  mass.resize(cand.size());
  double s = 0;
  for (size_t j = 0; j < cand.size(); ++j) s += mass[j] = z[cand[j]] >= kExpFloor ? std::exp(z[cand[j]]) : 0.0;
  if (few) total = s;
  const double limit = static_cast<double>(r.top_p) * total;
  double above = 0;
  size_t kept = 0;
  while (kept < cand.size() && (kept == 0 || above < limit)) {
    size_t j = kept;
    while (j < cand.size() && z[cand[j]] == z[cand[kept]]) above += mass[j++];
    kept = j;
  }
  double kept_mass = 0;
  for (size_t j = 0; j < kept; ++j) kept_mass += mass[j];
  return draw(cand, mass, kept, kept_mass, r.u);
}

// ---------------------------------------------------------- primitive --
enum Param { kTopK, kTopP, kMinP, kRepetition, kFrequency, kPresence, kHistory, kBiasIds, kBiasValues, kNumParams };

// Inputs: logits [B, V] float32, temperature [B] float32, random [B, 2]
// uint32, then the present parameters in Param order: per-row ones [B]
// (top_k int32, the rest float32), history and bias ids [B, *] int32, bias
// values [B, N] float32. Output: int64 [B].
class Sampler : public mx::UnaryPrimitive {
 public:
  Sampler(mx::Stream s, unsigned present) : mx::UnaryPrimitive(s), present_(present) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& enc = mx::cpu::get_command_encoder(stream());
    for (const auto& in : inputs) enc.set_input_array(in);
    enc.set_output_array(out);
    enc.dispatch([inputs, out, present = present_]() mutable {
      const mx::array* param[kNumParams] = {};
      for (int k = 0, next = 3; k < kNumParams; ++k) {
        if (present & (1u << k)) param[k] = &inputs[next++];
      }
      const int B = inputs[0].shape(0), V = inputs[0].shape(1);
      const float* logits = inputs[0].data<float>();
      const float* temperature = inputs[1].data<float>();
      const uint32_t* bits = inputs[2].data<uint32_t>();
      auto f32 = [&](Param k, int b, float off) { return param[k] ? param[k]->data<float>()[b] : off; };
      int64_t* ids = out.data<int64_t>();
      const Passes& p = passes();
      parallel_for(B, [&](int b) {
        Row r{};
        r.temperature = temperature[b];
        r.top_k = param[kTopK] ? param[kTopK]->data<int32_t>()[b] : 0;
        r.top_p = f32(kTopP, b, 1.0f), r.min_p = f32(kMinP, b, 0.0f);
        r.repetition = f32(kRepetition, b, 1.0f);
        r.frequency = f32(kFrequency, b, 0.0f), r.presence = f32(kPresence, b, 0.0f);
        if (param[kHistory]) {
          r.history_len = param[kHistory]->shape(1);
          r.history = param[kHistory]->data<int32_t>() + static_cast<size_t>(b) * r.history_len;
        }
        if (param[kBiasIds]) {
          r.bias_len = param[kBiasIds]->shape(1);
          r.bias_ids = param[kBiasIds]->data<int32_t>() + static_cast<size_t>(b) * r.bias_len;
          r.bias_values = param[kBiasValues]->data<float>() + static_cast<size_t>(b) * r.bias_len;
        }
        // 53 bits: the top 32 of the first word and 21 of the second
        const uint64_t u53 = (static_cast<uint64_t>(bits[2 * b]) << 21) | (bits[2 * b + 1] >> 11);
        r.u = static_cast<double>(u53) * 0x1.0p-53;
        ids[b] = sample_row(logits + static_cast<size_t>(b) * V, V, r, p);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("emlx Sampler: no GPU kernel (the graph uses MLX ops there)");
  }

  const char* name() const override { return "EmlxSampler"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return present_ == static_cast<const Sampler&>(other).present_;
  }

 private:
  unsigned present_;
};

// ---------------------------------------------------------- checking --
void check_row_param(const char* name, const std::optional<mx::array>& a, int B) {
  if (!a) return;
  if (a->ndim() > 1 || (a->ndim() == 1 && a->shape(0) != B)) {
    throw std::invalid_argument(std::string("SampleNode: ") + name + " must be [] or [" + std::to_string(B) + "]");
  }
  if (!mx::issubdtype(a->dtype(), mx::number) || a->dtype() == mx::complex64) {
    throw std::invalid_argument(std::string("SampleNode: ") + name + " must be a real number");
  }
}

void check_table(const char* name, const std::optional<mx::array>& a, int B, bool integer) {
  if (!a) return;
  if (a->ndim() != 2 || a->shape(0) != B) {
    throw std::invalid_argument(std::string("SampleNode: ") + name + " must be [" + std::to_string(B) + ", N]");
  }
  if (integer != mx::issubdtype(a->dtype(), mx::integer) || (!integer && !mx::issubdtype(a->dtype(), mx::floating))) {
    throw std::invalid_argument(std::string("SampleNode: ") + name + (integer ? " must be integer" : " must be float"));
  }
}

void check(const SampleInputs& in) {
  const auto& l = in.logits;
  if (l.ndim() != 2 || !mx::issubdtype(l.dtype(), mx::floating) || l.shape(1) < 1) {
    throw std::invalid_argument("SampleNode: logits must be a floating point [B, V] array with V >= 1");
  }
  const int B = l.shape(0);
  if (in.random.dtype() != mx::uint32 || in.random.shape() != mx::Shape{B, 2}) {
    throw std::invalid_argument("SampleNode: random must be uint32 [B, 2]");
  }
  check_row_param("temperature", in.temperature, B);
  check_row_param("top_k", in.top_k, B);
  check_row_param("top_p", in.top_p, B);
  check_row_param("min_p", in.min_p, B);
  check_row_param("repetition_penalty", in.repetition_penalty, B);
  check_row_param("frequency_penalty", in.frequency_penalty, B);
  check_row_param("presence_penalty", in.presence_penalty, B);
  if ((in.repetition_penalty || in.frequency_penalty || in.presence_penalty) && !in.history) {
    throw std::invalid_argument("SampleNode: penalties need a history");
  }
  check_table("history", in.history, B, true);
  if (in.logit_bias_ids.has_value() != in.logit_bias_values.has_value()) {
    throw std::invalid_argument("SampleNode: logit_bias_ids and logit_bias_values come together");
  }
  check_table("logit_bias_ids", in.logit_bias_ids, B, true);
  check_table("logit_bias_values", in.logit_bias_values, B, false);
  if (in.logit_bias_ids && in.logit_bias_ids->shape() != in.logit_bias_values->shape()) {
    throw std::invalid_argument("SampleNode: logit_bias_ids and logit_bias_values must have one shape");
  }
}

bool kernels_enabled() {
  static const bool disabled = std::getenv("EMLX_DISABLE_CPU_KERNELS") != nullptr;
  return !disabled && mx::default_device() == mx::Device::cpu;
}

// Token ids into int32, anything outside [0, V) as -1 (ignored by both paths).
mx::array ids_or_minus_one(const mx::array& ids, int V) {
  auto valid = mx::logical_and(mx::greater_equal(ids, mx::array(0, ids.dtype())),
                               mx::less(ids, mx::array(V, ids.dtype())));
  return mx::where(valid, mx::astype(ids, mx::int32), mx::array(-1, mx::int32));
}

}  // namespace

mx::array sample(const SampleInputs& in) {
  check(in);
  if (!kernels_enabled()) return sample_reference(in);
  const int B = in.logits.shape(0), V = in.logits.shape(1);
  auto row = [B](const mx::array& a, mx::Dtype t) { return mx::contiguous(mx::broadcast_to(mx::astype(a, t), {B})); };
  std::vector<mx::array> inputs = {mx::contiguous(mx::astype(in.logits, mx::float32)),
                                   row(in.temperature, mx::float32), mx::contiguous(in.random)};
  unsigned present = 0;
  auto add = [&](Param k, mx::array a) { present |= 1u << k, inputs.push_back(std::move(a)); };
  if (in.top_k) {  // K >= V is off: clip into int32 first
    add(kTopK, row(mx::clip(*in.top_k, mx::array(0, in.top_k->dtype()), mx::array(V, in.top_k->dtype())), mx::int32));
  }
  if (in.top_p) add(kTopP, row(*in.top_p, mx::float32));
  if (in.min_p) add(kMinP, row(*in.min_p, mx::float32));
  if (in.repetition_penalty) add(kRepetition, row(*in.repetition_penalty, mx::float32));
  if (in.frequency_penalty) add(kFrequency, row(*in.frequency_penalty, mx::float32));
  if (in.presence_penalty) add(kPresence, row(*in.presence_penalty, mx::float32));
  if (in.history) add(kHistory, mx::contiguous(ids_or_minus_one(*in.history, V)));
  if (in.logit_bias_ids) {
    add(kBiasIds, mx::contiguous(ids_or_minus_one(*in.logit_bias_ids, V)));
    add(kBiasValues, mx::contiguous(mx::astype(*in.logit_bias_values, mx::float32)));
  }
  auto prim = std::make_shared<Sampler>(mx::default_stream(mx::Device::cpu), present);
  return mx::array({B}, mx::int64, prim, inputs);
}

mx::array sample_reference(const SampleInputs& in) {
  check(in);
  const int B = in.logits.shape(0), V = in.logits.shape(1);
  const auto f32 = mx::float32;
  const mx::array ninf(kNegInf), pinf(kPosInf), zero(0.0f);
  auto column = [B](const mx::array& a, mx::Dtype t) {
    return mx::reshape(mx::broadcast_to(mx::astype(a, t), {B}), {B, 1});
  };
  auto clean = [&](const mx::array& a) { return mx::where(mx::isnan(a), ninf, a); };
  // Sums `values` at `ids` (-1: nowhere) per row, through a spill column V.
  auto scatter_rows = [&](const mx::array& ids, const mx::array& values) {
    auto at = ids_or_minus_one(ids, V);
    at = mx::where(mx::less(at, mx::array(0, mx::int32)), mx::array(V, mx::int32), at);
    auto sums = mx::scatter_add_axis(mx::zeros({B, V + 1}, f32), at, mx::astype(values, f32), 1);
    return mx::slice(sums, {0, 0}, {B, V});
  };

  auto x = clean(mx::astype(in.logits, f32));
  if (in.history) {
    auto counts = scatter_rows(*in.history, mx::ones(in.history->shape(), f32));
    auto seen = mx::greater(counts, zero);
    if (in.repetition_penalty) {
      auto r = column(*in.repetition_penalty, f32);
      x = mx::where(seen, mx::where(mx::greater(x, zero), mx::divide(x, r), mx::multiply(x, r)), x);
    }
    if (in.frequency_penalty) x = mx::subtract(x, mx::multiply(column(*in.frequency_penalty, f32), counts));
    if (in.presence_penalty) {
      x = mx::subtract(x, mx::multiply(column(*in.presence_penalty, f32), mx::astype(seen, f32)));
    }
    x = clean(x);
  }
  if (in.logit_bias_ids) x = clean(mx::add(x, scatter_rows(*in.logit_bias_ids, *in.logit_bias_values)));

  auto row_max = mx::max(x, 1, true);
  auto greedy = mx::astype(mx::argmax(x, 1), mx::int64);
  auto t = column(in.temperature, f32);
  auto z = mx::where(mx::greater(x, ninf), mx::divide(mx::subtract(x, row_max), t), ninf);
  z = mx::where(mx::equal(row_max, pinf), mx::where(mx::isposinf(x), zero, ninf), z);

  auto thr = mx::full({B, 1}, kNegInf);
  if (in.top_k) {
    auto k = column(mx::clip(*in.top_k, mx::array(0, in.top_k->dtype()), mx::array(V, in.top_k->dtype())), mx::int32);
    auto kth = mx::take_along_axis(mx::sort(z, 1), mx::clip(mx::subtract(mx::array(V, mx::int32), k),
                                                             mx::array(0, mx::int32), mx::array(V - 1, mx::int32)), 1);
    auto on = mx::logical_and(mx::greater(k, mx::array(0, mx::int32)), mx::less(k, mx::array(V, mx::int32)));
    thr = mx::where(on, kth, thr);
  }
  if (in.min_p) {
    auto mp = column(*in.min_p, f32);
    thr = mx::maximum(thr, mx::where(mx::greater(mp, zero), mx::minimum(mx::log(mp), zero), ninf));
  }
  z = mx::where(mx::greater_equal(z, thr), z, ninf);
  if (in.top_p) {
    // decreasing z; a position stays while the mass strictly before it is < P
    auto sorted = mx::negative(mx::sort(mx::negative(z), 1));
    auto e = mx::exp(sorted);
    auto before = mx::cumsum(e, 1, false, false);
    auto limit = mx::multiply(column(*in.top_p, f32), mx::sum(e, 1, true));
    auto kept = mx::sum(mx::astype(mx::less(before, limit), mx::int32), 1, true);
    auto last = mx::take_along_axis(sorted, mx::maximum(mx::subtract(kept, mx::array(1, mx::int32)),
                                                        mx::array(0, mx::int32)), 1);
    auto on = mx::less(column(*in.top_p, f32), mx::array(1.0f));  // P >= 1 (or NaN) is off
    z = mx::where(mx::logical_or(mx::logical_not(on), mx::greater_equal(z, last)), z, ninf);
  }
  // inverse CDF with 24 bits of the row's first word
  auto u = mx::multiply(mx::astype(mx::right_shift(mx::slice(in.random, {0, 0}, {B, 1}), mx::array(8u, mx::uint32)), f32),
                        mx::array(0x1.0p-24f));
  auto cdf = mx::cumsum(mx::exp(z), 1);
  auto target = mx::multiply(u, mx::slice(cdf, {0, V - 1}, {B, V}));
  auto past = mx::greater(cdf, target);
  auto drawn = mx::where(mx::any(past, 1), mx::argmax(mx::astype(past, mx::int32), 1), mx::argmax(z, 1));
  auto token = mx::where(mx::greater(mx::reshape(t, {B}), zero), mx::astype(drawn, mx::int64), greedy);
  return mx::where(mx::greater(mx::reshape(row_max, {B}), ninf), token, mx::array(int64_t{-1}));
}

}  // namespace emlx
