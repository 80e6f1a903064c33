#include "sampler.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "cpu_kernel.h"
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

// x with NaN as -inf (the penalties write into this copy).
void load_generic(const float* in, float* x, int V) {
  for (int i = 0; i < V; ++i) x[i] = in[i] != in[i] ? kNegInf : in[i];
}

// The largest x; NaN never wins.
float max_generic(const float* x, int V) {
  float m = kNegInf;
  for (int i = 0; i < V; ++i) m = x[i] > m ? x[i] : m;
  return m;
}

// z = (x - m) / T in float32 (docs/sampling.md step 3); -inf (and NaN) stay -inf.
inline float z_of(float x, float m, float T) { return x > kNegInf ? (x - m) / T : kNegInf; }

void scale_generic(const float* x, float* z, int V, float m, float T) {
  for (int i = 0; i < V; ++i) z[i] = z_of(x[i], m, T);
}

inline float mass_of(float z, float lo) { return z >= lo && z >= kExpFloor ? std::exp(z) : 0.0f; }

// Sum of exp(z) over z >= lo, and how many such z are finite.
double exp_sum_generic(const float* z, int V, float lo, int* count) {
  double s = 0;
  int n = 0;
  for (int i = 0; i < V; ++i) {
    if (z[i] >= lo && z[i] > kNegInf) ++n, s += mass_of(z[i], lo);
  }
  *count = n;
  return s;
}

// Per block of kBlock: the sum of exp(z) over z >= lo, z computed from x on
// the fly (x is only read). With `e`, also each token's mass.
void block_masses_generic(const float* x, int V, float m, float T, float lo, double* sums, float* e) {
  for (int b0 = 0, blk = 0; b0 < V; b0 += kBlock, ++blk) {
    float s = 0;
    for (int i = b0; i < std::min(V, b0 + kBlock); ++i) {
      const float w = mass_of(z_of(x[i], m, T), lo);
      if (e) e[i - b0] = w;
      s += w;
    }
    sums[blk] = s;
  }
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

EMLX_AVX2 void load_avx2(const float* in, float* x, int V) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  int i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(in + i);
    _mm256_storeu_ps(x + i, _mm256_blendv_ps(v, ninf, _mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  }
  load_generic(in + i, x + i, V - i);
}

EMLX_AVX2 float max_avx2(const float* x, int V) {
  __m256 m0 = _mm256_set1_ps(kNegInf), m1 = m0;
  int i = 0;
  // max_ps returns its second operand when either is NaN: the running max
  for (; i + 16 <= V; i += 16) {
    m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
    m1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), m1);
  }
  for (; i + 8 <= V; i += 8) m0 = _mm256_max_ps(_mm256_loadu_ps(x + i), m0);
  return std::max(hmax(_mm256_max_ps(m0, m1)), max_generic(x + i, V - i));
}

EMLX_AVX2 inline __m256 z256(__m256 v, __m256 vm, __m256 vt) {
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  const __m256 z = _mm256_div_ps(_mm256_sub_ps(v, vm), vt);
  return _mm256_blendv_ps(ninf, z, _mm256_cmp_ps(v, ninf, _CMP_GT_OQ));
}

EMLX_AVX2 inline __m256 mass256(__m256 z, __m256 vlo) {
  const __m256 floor = _mm256_set1_ps(kExpFloor);
  return _mm256_and_ps(exp256(_mm256_max_ps(z, floor)), _mm256_cmp_ps(z, vlo, _CMP_GE_OQ));
}

EMLX_AVX2 void scale_avx2(const float* x, float* z, int V, float m, float T) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(T);
  int i = 0;
  for (; i + 8 <= V; i += 8) _mm256_storeu_ps(z + i, z256(_mm256_loadu_ps(x + i), vm, vt));
  scale_generic(x + i, z + i, V - i, m, T);
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

EMLX_AVX2 void block_masses_avx2(const float* x, int V, float m, float T, float lo, double* sums, float* e) {
  const __m256 vm = _mm256_set1_ps(m), vt = _mm256_set1_ps(T), vlo = _mm256_set1_ps(std::max(lo, kExpFloor));
  for (int b0 = 0, blk = 0; b0 < V; b0 += kBlock, ++blk) {
    const int b1 = std::min(V, b0 + kBlock);
    __m256 acc = _mm256_setzero_ps();
    int i = b0;
    for (; i + 8 <= b1; i += 8) {
      const __m256 w = mass256(z256(_mm256_loadu_ps(x + i), vm, vt), vlo);
      if (e) _mm256_storeu_ps(e + (i - b0), w);
      acc = _mm256_add_ps(acc, w);
    }
    float s = hsum(acc);
    for (; i < b1; ++i) {
      const float w = mass_of(z_of(x[i], m, T), lo);
      if (e) e[i - b0] = w;
      s += w;
    }
    sums[blk] = s;
  }
}

EMLX_AVX2 int next_above_avx2(const float* z, int from, int V, float t) {
  const __m256 vt = _mm256_set1_ps(t);
  for (; from + 8 <= V; from += 8) {
    const int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(z + from), vt, _CMP_GT_OQ));
    if (bits) return from + __builtin_ctz(bits);
  }
  return next_above_generic(z, from, V, t);
}

#endif

struct Passes {
  void (*load)(const float*, float*, int);
  float (*max)(const float*, int);
  void (*scale)(const float*, float*, int, float, float);
  double (*exp_sum)(const float*, int, float, int*);
  void (*block_masses)(const float*, int, float, float, float, double*, float*);
  int (*next_above)(const float*, int, int, float);
};

const Passes& passes() {
  static const Passes generic{load_generic, max_generic, scale_generic,
                              exp_sum_generic, block_masses_generic, next_above_generic};
#if defined(__x86_64__)
  static const Passes avx2{load_avx2, max_avx2, scale_avx2, exp_sum_avx2, block_masses_avx2, next_above_avx2};
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
  const uint32_t* mask;  // token bitmask, ceil(V/32) words, or nullptr
  double u;  // uniform in [0, 1) from the row's random words
};

// Whether the history's penalties change a token (each off at its neutral value).
bool history_penalizes(const Row& r) {
  return r.history_len && (r.repetition != 1.0f || r.frequency != 0.0f || r.presence != 0.0f);
}

// docs/sampling.md step 1, on the few tokens the history and the bias name,
// then the token mask on every token.
void penalize(float* x, int V, const Row& r, std::vector<int32_t>& ids) {
  if (history_penalizes(r)) {
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
  if (r.mask) {
    for (int w = 0; w * 32 < V; ++w) {
      const uint32_t word = r.mask[w];
      if (word == ~0u) continue;
      for (int i = w * 32; i < std::min(V, w * 32 + 32); ++i) {
        if (!((word >> (i - w * 32)) & 1u)) x[i] = kNegInf;
      }
    }
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

// Whether penalize() would change a token of the row: penalties off (their
// neutral values), bias entries all padding and no mask leave it as it is.
bool rewrites(const Row& r, int V) {
  if (r.mask || history_penalizes(r)) return true;
  for (int j = 0; j < r.bias_len; ++j) {
    if (r.bias_ids[j] >= 0 && r.bias_ids[j] < V) return true;
  }
  return false;
}

int64_t sample_row(const float* logits, int V, const Row& r, const Passes& p) {
  thread_local std::vector<float> copy, zs, tmp;
  thread_local std::vector<double> sums, mass;
  thread_local std::vector<int> cand;
  thread_local std::vector<int32_t> ids;
  // The row is only read, except when penalties, a bias or a mask rewrite
  // tokens: then a copy (NaN as -inf) takes them.
  const float* x = logits;
  if (rewrites(r, V)) {
    copy.resize(V);
    p.load(logits, copy.data(), V);
    penalize(copy.data(), V, r, ids);
    x = copy.data();
  }
  const float m = p.max(x, V);
  if (!(m > kNegInf)) return -1;  // no finite logit and no +inf
  if (!(r.temperature > 0)) {     // greedy: the lowest index of the max
    return std::find(x, x + V, m) - x;
  }
  if (m == kPosInf) {  // the draw is uniform among the +inf tokens
    cand.clear();
    for (int i = 0; i < V; ++i) {
      if (x[i] == kPosInf) cand.push_back(i);
    }
    return cand[std::min(cand.size() - 1, static_cast<size_t>(r.u * cand.size()))];
  }
  const bool top_k = r.top_k > 0 && r.top_k < V, top_p = r.top_p < 1;
  float thr = kNegInf;  // in z: tokens below it are filtered out
  if (r.min_p > 0) thr = std::min(0.0f, std::log(r.min_p));  // the max always stays
  if (!top_k && !top_p) {
    // temperature and min-p: per-block masses in one read of the row, then
    // the block the draw lands in, recomputed
    const int blocks = (V + kBlock - 1) / kBlock;
    sums.resize(blocks), tmp.resize(kBlock);
    p.block_masses(x, V, m, r.temperature, thr, sums.data(), nullptr);
    double total = 0;
    for (double b : sums) total += b;
    const double target = r.u * total;
    double cum = 0;
    int last = -1;
    for (int b = 0; b < blocks; ++b) {
      if (sums[b] <= 0) continue;
      if (cum + sums[b] <= target) {
        cum += sums[b];
        last = b;
        continue;
      }
      const int n = std::min(kBlock, V - b * kBlock);
      p.block_masses(x + b * kBlock, n, m, r.temperature, thr, &sums[b], tmp.data());
      for (int i = 0; i < n; ++i) {
        cum += tmp[i];
        if (cum > target && tmp[i] > 0) return b * kBlock + i;
      }
      last = b;
    }
    if (last < 0) return std::find(x, x + V, m) - x;
    // rounding carried the target past the end: the last token with mass
    p.block_masses(x + last * kBlock, std::min(kBlock, V - last * kBlock), m, r.temperature, thr, &sums[last],
                   tmp.data());
    for (int i = std::min(kBlock, V - last * kBlock) - 1; i >= 0; --i) {
      if (tmp[i] > 0) return last * kBlock + i;
    }
    return std::find(x, x + V, m) - x;
  }
  zs.resize(V);
  float* z = zs.data();
  p.scale(x, z, V, m, r.temperature);
  if (top_k) thr = std::max(thr, kth_largest(z, V, r.top_k, p, tmp));
  const bool few = top_k && r.top_k <= kHeapTopK;  // survivors: about K, collected directly
  // Candidates: the survivors of top-k / min-p; for top-p without a small
  // K, only tokens that can be in the nucleus. A token whose probability is
  // below (1 - P) / n (n survivors) has at least P of the mass above it.
  float lo = thr;
  double total = 0;
  if (top_p && !few) {
    int n = 0;
    total = p.exp_sum(z, V, thr, &n);
    const double outside = 1.0 - std::max(0.0, static_cast<double>(r.top_p));
    lo = std::max(thr, static_cast<float>(std::log(outside * total / std::max(n, 1))) - 1e-3f);
  }
  cand.clear();
  const float below = lo > kNegInf ? std::nextafter(lo, kNegInf) : kNegInf;  // z > below: z >= lo (and finite)
  for (int i = p.next_above(z, 0, V, below); i < V; i = p.next_above(z, i + 1, V, below)) cand.push_back(i);
  // top-p: by decreasing z; keep a tie group while the mass strictly above it is < P
  if (top_p) std::sort(cand.begin(), cand.end(), [z](int a, int b) { return z[a] > z[b] || (z[a] == z[b] && a < b); });
  mass.resize(cand.size());
  double s = 0;
  for (size_t j = 0; j < cand.size(); ++j) s += mass[j] = mass_of(z[cand[j]], kNegInf);
  if (!top_p) return draw(cand, mass, cand.size(), s, r.u);  // top-k (and min-p)
  if (few || !(total > 0)) total = s;
  const double limit = static_cast<double>(r.top_p) * total;
  double above = 0;
  size_t kept = 0;
  while (kept < cand.size() && (kept == 0 || above < limit)) {
    size_t j = kept;
    while (j < cand.size() && z[cand[j]] == z[cand[kept]]) above += mass[j++];
    kept = j;
  }
  // the draw walks the nucleus in token order, as the MLX-ops path's CDF
  // does: the same random words then give the same token on every device
  std::vector<size_t> order(kept);
  for (size_t j = 0; j < kept; ++j) order[j] = j;
  std::sort(order.begin(), order.end(), [](size_t a, size_t b) { return cand[a] < cand[b]; });
  std::vector<int> nucleus(kept);
  std::vector<double> masses(kept);
  double kept_mass = 0;
  for (size_t j = 0; j < kept; ++j) nucleus[j] = cand[order[j]], kept_mass += masses[j] = mass[order[j]];
  return draw(nucleus, masses, kept, kept_mass, r.u);
}

// ---------------------------------------------------------- primitive --
constexpr unsigned kSeeded = 1u << kNumParams;  // inputs[2], [3] are seed and position, not random words

// A row's (seed, position) as one 64-bit key seed (RandomBitsNode does the
// same with MLX ops).
uint64_t stream_seed(uint64_t seed, uint64_t position) {
  auto lit = [](uint64_t v) { return v; };
  return mix64(seed ^ mix64(position, lit), lit);
}

// Threefry-2x32 with 20 rounds (Salmon et al., "Parallel random numbers: as
// easy as 1, 2, 3", SC 2011), the counter-based hash behind MLX's
// random::bits: bits({2}, 4, key) is the hash of the counter (0, 1).
std::pair<uint32_t, uint32_t> threefry2x32(uint32_t k0, uint32_t k1, uint32_t x0, uint32_t x1) {
  static constexpr int kRot[8] = {13, 15, 26, 6, 17, 29, 16, 24};
  const uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  x0 += ks[0], x1 += ks[1];
  for (int i = 0; i < 5; ++i) {  // five groups of four rounds, a key injection after each
    for (int j = 0; j < 4; ++j) {
      const int r = kRot[4 * (i % 2) + j];
      x0 += x1;
      x1 = ((x1 << r) | (x1 >> (32 - r))) ^ x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<uint32_t>(i + 1);
  }
  return {x0, x1};
}

uint64_t element_u64(const mx::array& a, int64_t b) {
  const int64_t off = a.ndim() >= 1 ? b * a.strides()[0] : 0;
  switch (a.dtype()) {
    case mx::int64: return static_cast<uint64_t>(a.data<int64_t>()[off]);
    case mx::uint64: return a.data<uint64_t>()[off];
    case mx::int32: return static_cast<uint64_t>(static_cast<int64_t>(a.data<int32_t>()[off]));
    default: throw std::invalid_argument("SampleNode: seed and position must be 64-bit integers");
  }
}

// Element (b, j) of a [], [B] or [B, N] array of any real dtype and strides
// (the parameters reach the kernel as they are: no conversion ops).
double element(const mx::array& a, int64_t b, int64_t j = 0) {
  int64_t off = 0;
  if (a.ndim() >= 1) off += b * a.strides()[0];
  if (a.ndim() >= 2) off += j * a.strides()[1];
  switch (a.dtype()) {
    case mx::float32: return a.data<float>()[off];
    case mx::float16: return static_cast<float>(a.data<mx::float16_t>()[off]);
    case mx::bfloat16: return static_cast<float>(a.data<mx::bfloat16_t>()[off]);
    case mx::float64: return a.data<double>()[off];
    case mx::int64: return static_cast<double>(a.data<int64_t>()[off]);
    case mx::int32: return a.data<int32_t>()[off];
    case mx::int16: return a.data<int16_t>()[off];
    case mx::int8: return a.data<int8_t>()[off];
    case mx::uint32: return a.data<uint32_t>()[off];
    case mx::uint16: return a.data<uint16_t>()[off];
    case mx::uint8: return a.data<uint8_t>()[off];
    case mx::uint64: return static_cast<double>(a.data<uint64_t>()[off]);
    default: throw std::invalid_argument("SampleNode: unsupported parameter dtype");
  }
}

// Inputs: logits [B, V] float32 (rows may be strided), temperature, random
// [B, 2] uint32 (or, kSeeded, seed and position), then the present
// parameters in Param order, each as given ([] or [B]; history and bias
// [B, N]). Output: int64 [B].
class Sampler : public CpuKernel {
 public:
  Sampler(mx::Stream s, unsigned present) : CpuKernel(s), present_(present) {}

  const char* name() const override { return "EmlxSampler"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return present_ == static_cast<const Sampler&>(other).present_;
  }

 private:
  CpuTask task() const override {
    return [present = present_](const std::vector<mx::array>& inputs, mx::array& out) {
      const mx::array* param[kNumParams] = {};
      for (int k = 0, next = (present & kSeeded) ? 4 : 3; k < kNumParams; ++k) {
        if (present & (1u << k)) param[k] = &inputs[next++];
      }
      const auto& logits = inputs[0];
      const int B = logits.shape(0), V = logits.shape(1);
      // an absent parameter is off
      auto get = [&](Param k, int b) { return param[k] ? element(*param[k], b) : kSamplerInputs[kNumControls + k].off; };
      int64_t* ids = out.data<int64_t>();
      const Passes& p = passes();
      parallel_for(B, [&](int b) {
        thread_local std::vector<float> row;
        thread_local std::vector<int32_t> history, bias_ids;
        thread_local std::vector<float> bias_values;
        thread_local std::vector<uint32_t> mask;
        Row r{};
        r.temperature = static_cast<float>(element(inputs[1], b));
        const double k = get(kTopK, b);
        r.top_k = k >= 0 ? static_cast<int>(std::min<double>(k, V)) : 0;
        r.top_p = static_cast<float>(get(kTopP, b)), r.min_p = static_cast<float>(get(kMinP, b));
        r.repetition = static_cast<float>(get(kRepetitionPenalty, b));
        r.frequency = static_cast<float>(get(kFrequencyPenalty, b)), r.presence = static_cast<float>(get(kPresencePenalty, b));
        // ids outside [0, V) (the -1 pads) are skipped by penalize()
        auto token = [V](double id) { return id >= 0 && id < V ? static_cast<int32_t>(id) : -1; };
        if (param[kHistory]) {
          history.resize(param[kHistory]->shape(1));
          for (size_t j = 0; j < history.size(); ++j) history[j] = token(element(*param[kHistory], b, j));
          r.history = history.data(), r.history_len = static_cast<int>(history.size());
        }
        if (param[kLogitBiasIds]) {
          bias_ids.resize(param[kLogitBiasIds]->shape(1)), bias_values.resize(bias_ids.size());
          for (size_t j = 0; j < bias_ids.size(); ++j) {
            bias_ids[j] = token(element(*param[kLogitBiasIds], b, j));
            bias_values[j] = static_cast<float>(element(*param[kLogitBiasValues], b, j));
          }
          r.bias_ids = bias_ids.data(), r.bias_values = bias_values.data();
          r.bias_len = static_cast<int>(bias_ids.size());
        }
        if (param[kTokenBitmask]) {
          mask.resize(param[kTokenBitmask]->shape(1));
          bool all_set = true;
          for (size_t j = 0; j < mask.size(); ++j) {
            mask[j] = static_cast<uint32_t>(static_cast<int64_t>(element(*param[kTokenBitmask], b, j)));
            all_set = all_set && mask[j] == ~0u;
          }
          r.mask = all_set ? nullptr : mask.data();  // every token allowed: the row is read in place
        }
        uint64_t w0, w1;
        if (present & kSeeded) {  // random::bits({2}, 4, random::key(stream_seed(seed, position)))
          const uint64_t key = stream_seed(element_u64(inputs[2], b), element_u64(inputs[3], b));
          std::tie(w0, w1) = threefry2x32(static_cast<uint32_t>(key >> 32), static_cast<uint32_t>(key), 0, 1);
        } else {
          w0 = static_cast<uint64_t>(element(inputs[2], b, 0)), w1 = static_cast<uint64_t>(element(inputs[2], b, 1));
        }
        // 53 bits: the top 32 of the first word and 21 of the second
        r.u = static_cast<double>((w0 << 21) | (w1 >> 11)) * 0x1.0p-53;
        const float* x = logits.data<float>() + static_cast<int64_t>(b) * logits.strides()[0];
        if (logits.strides()[1] != 1) {  // a strided row: gathered once
          row.resize(V);
          for (int i = 0; i < V; ++i) row[i] = x[static_cast<int64_t>(i) * logits.strides()[1]];
          x = row.data();
        }
        ids[b] = sample_row(x, V, r, p);
      });
    };
  }

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
  check_row_param("seed", in.seed, B);
  check_row_param("position", in.position, B);
  for (const auto* a : {&in.seed, &in.position}) {
    if (*a && (*a)->dtype() != mx::int64 && (*a)->dtype() != mx::uint64) {
      throw std::invalid_argument("SampleNode: seed and position must be 64-bit integers");
    }
  }
  if (in.seed.has_value() != in.position.has_value()) {
    throw std::invalid_argument("SampleNode: seed and position come together");
  }
  const auto params = params_of(in);
  if (in.token_bitmask && in.token_bitmask->shape(1) != (l.shape(1) + 31) / 32) {
    throw std::invalid_argument("SampleNode: token_bitmask must be [B, ceil(V/32)]");
  }
  auto given = [&](int input) { return input >= kNumControls && params[input - kNumControls]->has_value(); };
  for (int k = 0; k < kNumParams; ++k) {
    const SamplerInputInfo& info = kSamplerInputs[kNumControls + k];
    if (info.kind == 'r') {
      check_row_param(info.name, *params[k], B);
    } else {
      check_table(info.name, *params[k], B, info.integer);
    }
    if (!params[k]->has_value()) continue;
    if (info.needs >= 0 && !given(info.needs)) {
      throw std::invalid_argument(std::string("SampleNode: parameters that need a ") + kSamplerInputs[info.needs].name +
                                  " were given without one (" + info.name + ")");
    }
    if (info.together >= 0) {
      const auto& other = *params[info.together - kNumControls];
      if (!other) {
        throw std::invalid_argument(std::string("SampleNode: ") + info.name + " and " +
                                    kSamplerInputs[info.together].name + " come together");
      }
      if (other->shape() != (*params[k])->shape()) {
        throw std::invalid_argument(std::string("SampleNode: ") + info.name + " and " +
                                    kSamplerInputs[info.together].name + " must have one shape");
      }
    }
  }
}

// Token ids into int32, anything outside [0, V) as -1 (ignored by both paths).
mx::array ids_or_minus_one(const mx::array& ids, int V) {
  auto valid = mx::logical_and(mx::greater_equal(ids, mx::array(0, ids.dtype())),
                               mx::less(ids, mx::array(V, ids.dtype())));
  return mx::where(valid, mx::astype(ids, mx::int32), mx::array(-1, mx::int32));
}

// The sampler as MLX ops, on the thread's default stream (checked inputs).
mx::array sample_ops(const SampleInputs& in) {
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
  if (in.token_bitmask) {  // bit j of word w allows token 32w + j
    auto ids = mx::arange(V, mx::uint32);
    auto words = mx::take(mx::view(mx::astype(*in.token_bitmask, mx::int32), mx::uint32),
                          mx::right_shift(ids, mx::array(5u, mx::uint32)), 1);
    auto bit = mx::bitwise_and(mx::right_shift(words, mx::bitwise_and(ids, mx::array(31u, mx::uint32))),
                               mx::array(1u, mx::uint32));
    x = mx::where(mx::greater(bit, mx::array(0u, mx::uint32)), x, ninf);
  }

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

}  // namespace

mx::array sample(const SampleInputs& in) {
  check(in);
  const int B = in.logits.shape(0);
  std::vector<mx::array> inputs = {mx::astype(in.logits, mx::float32), in.temperature};
  unsigned present = 0;
  if (in.seed && in.position) {  // `random` is then never evaluated
    present |= kSeeded, inputs.push_back(*in.seed), inputs.push_back(*in.position);
  } else {
    inputs.push_back(in.random);
  }
  const auto params = params_of(in);
  for (int k = 0; k < kNumParams; ++k) {
    if (*params[k]) present |= 1u << k, inputs.push_back(**params[k]);
  }
  // The ops read `in` as it came, not the kernel's operands.
  auto fallback = [&in](const std::vector<mx::array>&, mx::Stream) { return sample_ops(in); };
  return CpuKernel::build({}, true, std::move(inputs), {B}, mx::int64, fallback,
                          [&](mx::Stream s) { return std::make_shared<Sampler>(s, present); });
}

}  // namespace emlx
