#include "quantized_dot.h"

#include <algorithm>
#include <cmath>

#include "cpu_arrays.h"
#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace emlx {

namespace {

constexpr float kLevels = 32767.0f;

// Where value k of a row goes in IntRows::q. A 4-bit chunk of 32 values is
// 16 bytes, each holding values 2j (low nibble) and 2j + 1 (high nibble):
// unpacking gives the even values, then the odd ones.
inline size_t slot(size_t k, int bits) {
  if (bits == 8) return k;
  const size_t chunk = k & ~size_t{31}, j = k & 31;
  return chunk + (j & 1) * 16 + j / 2;
}

// The sum over one group of q * xq, in plain C++ (any CPU).
template <int BITS>
inline int32_t group_sum_generic(const uint8_t* row, const int16_t* q, size_t k0, int group) {
  int32_t s = 0;
  for (size_t k = k0; k < k0 + group; k += 32) {
    if constexpr (BITS == 4) {
      for (size_t j = 0; j < 16; ++j) {
        const int b = row[k / 2 + j];
        s += (b & 15) * q[k + j] + (b >> 4) * q[k + 16 + j];
      }
    } else {
      for (size_t j = 0; j < 32; ++j) s += row[k + j] * q[k + j];
    }
  }
  return s;
}

template <int BITS>
void dots_generic(const IntRows& x, const uint8_t* w, const void* scales, const void* biases, bool bf16, size_t n0,
                  size_t n1, float* out, size_t ldo) {
  const size_t K = x.K, groups = K / x.group;
  for (size_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * K * BITS / 8;
    for (size_t m = 0; m < x.M; ++m) {
      const int16_t* q = x.q.data() + m * K;
      float y = 0;
      for (size_t g = 0; g < groups; ++g) {
        const size_t at = n * groups + g, xg = m * groups + g;
        const int32_t s = group_sum_generic<BITS>(row, q, g * x.group, x.group);
        y += static_cast<float>(s) * (float_at(scales, at, bf16) * x.scale[xg]) +
             float_at(biases, at, bf16) * x.sum[xg];
      }
      out[m * ldo + n] = y;
    }
  }
}

#if defined(__x86_64__)
// Eight float32 or bfloat16 values as float32.
template <bool BF16>
__attribute__((target("avx2,fma"))) inline __m256 load8(const void* p, size_t i) {
  if constexpr (BF16) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(p) + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(static_cast<const float*>(p) + i);
  }
}

// The sums over one group of CHUNKS * 32 values (weights from w, x from q;
// row i of x at q + i * K) of q * xq for XR rows of x as 8 int32 lanes each:
// 16 weights widen to int16 lanes in one instruction, once for all the rows,
// and vpmaddwd multiplies and pairs them with x.
template <int BITS, int XR, int CHUNKS>
__attribute__((target("avx2,fma"), always_inline)) inline void group_sums_avx2(const uint8_t* w, const int16_t* q,
                                                                               size_t K, __m256i (&s)[XR]) {
#pragma GCC unroll 2
  for (int i = 0; i < XR; ++i) s[i] = _mm256_setzero_si256();
  if constexpr (BITS == 4) {
    const __m256i low4 = _mm256_set1_epi16(15);
#pragma GCC unroll 4
    for (int c = 0; c < CHUNKS; ++c) {
      const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
      const __m256i even = _mm256_and_si256(v, low4), odd = _mm256_srli_epi16(v, 4);
#pragma GCC unroll 2
      for (int i = 0; i < XR; ++i) {
        const __m256i* xi = reinterpret_cast<const __m256i*>(q + i * K + 32 * c);
        s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(even, _mm256_loadu_si256(xi)));
        s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(odd, _mm256_loadu_si256(xi + 1)));
      }
    }
  } else {
#pragma GCC unroll 8
    for (int c = 0; c < 2 * CHUNKS; ++c) {
      const __m256i codes = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16 * c)));
#pragma GCC unroll 2
      for (int i = 0; i < XR; ++i) {
        const __m256i xi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + i * K + 16 * c));
        s[i] = _mm256_add_epi32(s[i], _mm256_madd_epi16(codes, xi));
      }
    }
  }
}

// How far ahead of the weights being read to prefetch (bytes).
constexpr size_t kAhead = 1024;

// Rows of x per pass over the weights: 64 rows of int16 at K = 1024 are
// 128 KiB, which stay in a core's L2 cache while a block of weights is read.
// (Which rows share a pass does not change any row's arithmetic.)
constexpr size_t kXBlock = 64;

__attribute__((target("avx2,fma"))) inline float hsum(__m256 a) {
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

// out[m * ldo + n] for XR rows of x from row m0 on, one weight row n, groups
// of CHUNKS * 32 values: each row's arithmetic is the same whatever XR (and
// M) is, so a row of a multi-row call is bit for bit the row of a one-row call.
template <int BITS, bool BF16, int XR, int CHUNKS>
__attribute__((target("avx2,fma"), always_inline)) inline void rows_dot_avx2(const IntRows& x, size_t m0,
                                                                             const uint8_t* row, size_t n,
                                                                             const void* scales, const void* biases,
                                                                             float* factors, float* out, size_t ldo) {
  constexpr size_t group = 32 * CHUNKS;
  const size_t K = x.K, groups = K / group;
  __m256 bias_term[XR];
  float bias_tail[XR];
#pragma GCC unroll 2
  for (int i = 0; i < XR; ++i) {
    // Per-group factors (factors + i * groups) and the biases' term, eight groups at a time.
    const float *xa = x.scale.data() + (m0 + i) * groups, *xs = x.sum.data() + (m0 + i) * groups;
    float* f = factors + i * groups;
    bias_term[i] = _mm256_setzero_ps();
    bias_tail[i] = 0;
    size_t g = 0;
    for (; g + 8 <= groups; g += 8) {
      _mm256_storeu_ps(f + g, _mm256_mul_ps(load8<BF16>(scales, n * groups + g), _mm256_loadu_ps(xa + g)));
      bias_term[i] = _mm256_fmadd_ps(load8<BF16>(biases, n * groups + g), _mm256_loadu_ps(xs + g), bias_term[i]);
    }
    for (; g < groups; ++g) {
      f[g] = float_at(scales, n * groups + g, BF16) * xa[g];
      bias_tail[i] += float_at(biases, n * groups + g, BF16) * xs[g];
    }
  }
  // Two float accumulators per row: one would wait on its own FMA latency.
  __m256 acc0[XR], acc1[XR];
#pragma GCC unroll 2
  for (int i = 0; i < XR; ++i) acc0[i] = acc1[i] = _mm256_setzero_ps();
  // Weights and x by pointers bumped a group at a time (indices would cost
  // address arithmetic per chunk); the weights of the rows ahead are
  // prefetched, a cache line per line read.
  constexpr size_t group_bytes = group * BITS / 8;
  const int16_t* q = x.q.data() + m0 * K;
  const uint8_t* w = row;
  size_t g = 0;
  for (; g + 2 <= groups; g += 2, w += 2 * group_bytes, q += 2 * group) {
#pragma GCC unroll 4
    for (size_t b = 0; b < 2 * group_bytes; b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(w + kAhead + b), _MM_HINT_T0);
    }
    __m256i s0[XR], s1[XR];
    group_sums_avx2<BITS, XR, CHUNKS>(w, q, K, s0);
    group_sums_avx2<BITS, XR, CHUNKS>(w + group_bytes, q + group, K, s1);
#pragma GCC unroll 2
    for (int i = 0; i < XR; ++i) {
      acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[i]), _mm256_broadcast_ss(&factors[i * groups + g]), acc0[i]);
      acc1[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1[i]), _mm256_broadcast_ss(&factors[i * groups + g + 1]),
                                acc1[i]);
    }
  }
  if (g < groups) {
    __m256i s0[XR];
    group_sums_avx2<BITS, XR, CHUNKS>(w, q, K, s0);
#pragma GCC unroll 2
    for (int i = 0; i < XR; ++i) {
      acc0[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0[i]), _mm256_broadcast_ss(&factors[i * groups + g]), acc0[i]);
    }
  }
#pragma GCC unroll 2
  for (int i = 0; i < XR; ++i) {
    out[(m0 + i) * ldo + n] = hsum(_mm256_add_ps(acc0[i], acc1[i])) + hsum(bias_term[i]) + bias_tail[i];
  }
}

template <int BITS, bool BF16, int CHUNKS>
__attribute__((target("avx2,fma"))) void dots_avx2(const IntRows& x, const uint8_t* w, const void* scales,
                                                   const void* biases, size_t n0, size_t n1, float* out, size_t ldo) {
  const size_t groups = x.K / x.group, row_bytes = x.K * BITS / 8;
  thread_local std::vector<float> per_group;  // per row and group: the weight scale times x's
  per_group.resize(2 * groups);
  float* factors = per_group.data();  // (each thread_local access is a call in a shared library)
  // A long prompt's x a block of rows at a time, each block against all of
  // [n0, n1): x's rows would not stay in cache from one weight row to the next.
  for (size_t m0 = 0; m0 < x.M; m0 += kXBlock) {
    const size_t m1 = std::min(x.M, m0 + kXBlock);
    for (size_t n = n0; n < n1; ++n) {
      const uint8_t* row = w + n * row_bytes;
      size_t m = m0;
      for (; m + 2 <= m1; m += 2) rows_dot_avx2<BITS, BF16, 2, CHUNKS>(x, m, row, n, scales, biases, factors, out, ldo);
      if (m < m1) rows_dot_avx2<BITS, BF16, 1, CHUNKS>(x, m, row, n, scales, biases, factors, out, ldo);
    }
  }
}

using Dots = void (*)(const IntRows&, const uint8_t*, const void*, const void*, size_t, size_t, float*, size_t);

template <int BITS, bool BF16>
Dots dots_avx2_for(int group) {
  return group == 32 ? dots_avx2<BITS, BF16, 1> : group == 64 ? dots_avx2<BITS, BF16, 2> : dots_avx2<BITS, BF16, 4>;
}
#endif

// One group of x: false if it holds a NaN or an infinity, else its scale
// and sum, and q[slot(i)] = round(x[i] / scale) for every i.
bool quantize_group_generic(const float* x, int group, int bits, int16_t* q, float& scale, float& sum) {
  float amax = 0;
  sum = 0;
  for (int i = 0; i < group; ++i) {
    if (!std::isfinite(x[i])) return false;
    amax = std::fmax(amax, std::fabs(x[i]));
    sum += x[i];
  }
  const float to_int = amax > 0 ? kLevels / amax : 0.0f;
  scale = amax / kLevels;
  for (int i = 0; i < group; ++i) q[slot(i, bits)] = static_cast<int16_t>(std::nearbyint(x[i] * to_int));
  return true;
}

#if defined(__x86_64__)
// The same, 32 values at a time (groups are 32, 64 or 128). Rounding is the
// CPU's default, to nearest even, as std::nearbyint's.
__attribute__((target("avx2,fma"))) bool quantize_group_avx2(const float* x, int group, int bits, int16_t* q,
                                                             float& scale, float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 amax = _mm256_setzero_ps(), total = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < group; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i), a = _mm256_andnot_ps(sign, v);
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // inf or NaN
    amax = _mm256_max_ps(amax, a);
    total = _mm256_add_ps(total, v);
  }
  if (_mm256_movemask_ps(bad)) return false;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  sum = hsum(total);
  scale = top / kLevels;
  const __m256 to_int = _mm256_set1_ps(top > 0 ? kLevels / top : 0.0f);
  // Within each 128-bit lane: the even int16 values first, then the odd ones.
  const __m256i split = _mm256_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15,
                                         0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
  for (int i = 0; i < group; i += 32) {
    __m256i half[2];  // values i .. i + 15 and i + 16 .. i + 31 as int16, in order
    for (int h = 0; h < 2; ++h) {
      const __m256i a = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16 * h), to_int));
      const __m256i b = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 16 * h + 8), to_int));
      half[h] = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
    }
    if (bits == 4) {
      // [evens, odds] of each half, then the evens of both, then the odds
      const __m256i h0 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(half[0], split), 0xD8);
      const __m256i h1 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(half[1], split), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), _mm256_permute2x128_si256(h0, h1, 0x20));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i + 16), _mm256_permute2x128_si256(h0, h1, 0x31));
    } else {
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), half[0]);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i + 16), half[1]);
    }
  }
  return true;
}
#endif

}  // namespace

bool quantize_rows(const float* x, size_t M, size_t K, int group, int bits, IntRows& rows) {
  const size_t groups = K / group;
  rows.M = M, rows.K = K, rows.group = group, rows.bits = bits;
  rows.q.resize(M * K);
  rows.scale.resize(M * groups);
  rows.sum.resize(M * groups);
#if defined(__x86_64__)
  const auto quantize_group = has_avx2() ? quantize_group_avx2 : quantize_group_generic;
#else
  const auto quantize_group = quantize_group_generic;
#endif
  for (size_t m = 0; m < M; ++m) {
    for (size_t g = 0; g < groups; ++g) {
      const size_t at = m * groups + g;
      if (!quantize_group(x + m * K + g * group, group, bits, rows.q.data() + m * K + g * group, rows.scale[at],
                          rows.sum[at])) {
        return false;
      }
    }
  }
  return true;
}

void quantized_dots(const IntRows& x, const uint8_t* w, const void* scales, const void* biases, bool params_bf16,
                    size_t n0, size_t n1, float* out, size_t ldo) {
#if defined(__x86_64__)
  if (has_avx2()) {
    const Dots dots = x.bits == 4 ? (params_bf16 ? dots_avx2_for<4, true> : dots_avx2_for<4, false>)(x.group)
                                  : (params_bf16 ? dots_avx2_for<8, true> : dots_avx2_for<8, false>)(x.group);
    return dots(x, w, scales, biases, n0, n1, out, ldo);
  }
#endif
  (x.bits == 4 ? dots_generic<4> : dots_generic<8>)(x, w, scales, biases, params_bf16, n0, n1, out, ldo);
}

}  // namespace emlx
