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
// The x86 kernels, built three times: for AVX2+FMA; for CPUs with AVX-VNNI
// too (one instruction for a multiply-add pair and its accumulation); and
// for AVX-512 VNNI (two groups at once in 512-bit registers, 32 of them).
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {
#define EMLX_DOT_ADD(s, a, b) _mm256_add_epi32(s, _mm256_madd_epi16(a, b))
#include "quantized_dot_x86.inc"
#undef EMLX_DOT_ADD
}  // namespace avx2
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,avxvnni"))), apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avxvnni")
#endif
namespace vnni {
#define EMLX_DOT_ADD(s, a, b) _mm256_dpwssd_avx_epi32(s, a, b)
#include "quantized_dot_x86.inc"
#undef EMLX_DOT_ADD
}  // namespace vnni
#if defined(__clang__)
#pragma clang attribute pop
#pragma clang attribute push(__attribute__((target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni"))), \
                             apply_to = function)
#else
#pragma GCC pop_options
#pragma GCC push_options
#pragma GCC target("avx2,fma,avx512f,avx512bw,avx512vl,avx512vnni")
#endif
namespace avx512 {
#define EMLX_DOT_ADD(s, a, b) _mm256_dpwssd_epi32(s, a, b)
#define EMLX_DOT_ZMM
#include "quantized_dot_x86.inc"
#undef EMLX_DOT_ZMM
#undef EMLX_DOT_ADD
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
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
  sum = avx2::hsum(total);
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

// Reorders each row's pairs of groups (g, g + 1) for the AVX-512 kernel: per
// 16 values, group g's then group g + 1's (4-bit: a chunk's 16 even values
// of each, then their 16 odd ones), so one register holds both groups'.
// An odd group count's last group keeps the plain layout.
void pair_layout(IntRows& rows) {
  const size_t group = rows.group, pairs = rows.K / group / 2;
  std::vector<int16_t> pair(2 * group);
  for (size_t m = 0; m < rows.M; ++m) {
    for (size_t p = 0; p < pairs; ++p) {
      int16_t* at = rows.q.data() + m * rows.K + 2 * p * group;
      for (size_t i = 0; i < 2 * group; i += 32) {  // 16 values of each group
        std::copy(at + i / 2, at + i / 2 + 16, pair.begin() + i);
        std::copy(at + group + i / 2, at + group + i / 2 + 16, pair.begin() + i + 16);
      }
      std::copy(pair.begin(), pair.end(), at);
    }
  }
}

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
#if defined(__x86_64__)
  if (has_avx512_vnni()) pair_layout(rows);  // the kernel quantized_dots picks reads it so
#endif
  return true;
}

void quantized_dots(const IntRows& x, const uint8_t* w, const void* scales, const void* biases, bool params_bf16,
                    size_t n0, size_t n1, float* out, size_t ldo) {
#if defined(__x86_64__)
  if (has_avx512_vnni()) return avx512::dots_for(x.bits, params_bf16, x.group)(x, w, scales, biases, n0, n1, out, ldo);
  if (has_avx_vnni()) return vnni::dots_for(x.bits, params_bf16, x.group)(x, w, scales, biases, n0, n1, out, ldo);
  if (has_avx2()) return avx2::dots_for(x.bits, params_bf16, x.group)(x, w, scales, biases, n0, n1, out, ldo);
#endif
  (x.bits == 4 ? dots_generic<4> : dots_generic<8>)(x, w, scales, biases, params_bf16, n0, n1, out, ldo);
}

}  // namespace emlx
