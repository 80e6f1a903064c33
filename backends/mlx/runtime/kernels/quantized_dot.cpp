#include "quantized_dot.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "cpu_arrays.h"
#include "thread_pool.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace emlx {

namespace {

constexpr float kLevels = 127.0f;

// Where value k of a row goes in IntRows::q. 4-bit weights hold values 2j
// (low nibble) and 2j + 1 (high nibble) in byte j; the kernels unpack 64
// values (32 bytes) at a time into their even values, then their odd ones,
// and x is laid out so: per 64 values, the 32 even ones, then the 32 odd
// ones (per 32 values in groups of 32, which unpack 16 bytes at a time).
inline size_t slot(size_t k, int bits, int group) {
  if (bits == 8) return k;
  const size_t span = group == 32 ? 32 : 64, chunk = k & ~(span - 1), j = k & (span - 1);
  return chunk + (j & 1) * (span / 2) + j / 2;
}

// x's step for a group whose largest |x| is amax: amax / 127, rounded to the
// nearest half-precision value as llama.cpp stores its blocks' steps (so a
// GGUF file's layers compute what llama.cpp computes), unless that is not a
// normal half (tiny or huge x), where the float step loses nothing.
inline float group_step(float amax) {
  const float step = amax / kLevels;
  uint32_t b;
  std::memcpy(&b, &step, sizeof b);
  const uint32_t exponent = (b >> 23) & 0xFF;
  if (exponent < 127 - 14 || exponent > 127 + 15) return step;
  b += 0xFFF + ((b >> 13) & 1);  // to nearest, ties to even, at 10 mantissa bits
  b &= ~uint32_t{0x1FFF};
  float half;
  std::memcpy(&half, &b, sizeof half);
  return half <= 65504.0f ? half : step;
}

// The sum over one group of q * xq, in plain C++ (any CPU).
template <int BITS>
inline int32_t group_sum_generic(const uint8_t* row, const int8_t* q, size_t k0, int group) {
  int32_t s = 0;
  const size_t span = BITS == 4 && group > 32 ? 64 : 32;  // (slot)
  for (size_t k = k0; k < k0 + group; k += span) {
    if constexpr (BITS == 4) {
      for (size_t j = 0; j < span / 2; ++j) {
        const int b = row[k / 2 + j];
        s += (b & 15) * q[k + j] + (b >> 4) * q[k + span / 2 + j];
      }
    } else {
      for (size_t j = 0; j < 32; ++j) s += row[k + j] * q[k + j];
    }
  }
  return s;
}

// The arithmetic of every build: per weight row n, row m of x and group g,
// the exact integer sum s of code * xq, then y = fma(s, scale * x's step,
// y) and y = fma(bias, x's rounded sum, y), group after group. (The x86
// builds do it for 8 or 16 weight rows at once, one a lane.)
template <int BITS>
void dots_generic(const IntRows& x, const uint8_t* w, const void* scales, const void* biases, bool bf16, size_t n0,
                  size_t n1, float* out, size_t ldo) {
  const size_t K = x.K, groups = K / x.group;
  for (size_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * K * BITS / 8;
    for (size_t m = 0; m < x.M; ++m) {
      const int8_t* q = x.q.data() + m * K;
      float y = 0;
      for (size_t g = 0; g < groups; ++g) {
        const size_t at = n * groups + g, xg = m * groups + g;
        const int32_t s = group_sum_generic<BITS>(row, q, g * x.group, x.group);
        const float factor = float_at(scales, at, bf16) * x.scale[xg];
        y = std::fma(static_cast<float>(s), factor, y);
        y = std::fma(float_at(biases, at, bf16), x.sum[xg], y);
      }
      out[m * ldo + n] = y;
    }
  }
}

// The same on a tiled matrix: each whole tile written back in rows first.
template <int BITS>
void tiled_dots_generic(const IntRows& x, const uint8_t* w, const void* scales, const void* biases, bool bf16,
                        size_t n0, size_t n1, float* out, size_t ldo) {
  const size_t groups = x.K / x.group, row_bytes = x.K * BITS / 8, param = bf16 ? 2 : 4;
  std::vector<uint8_t> bytes[3];
  for (size_t n = n0; n < n1; n += kTileRows) {
    if (n + kTileRows > n1) {
      dots_generic<BITS>(x, w, scales, biases, bf16, n, n1, out, ldo);
      break;
    }
    const PackedRows tiled{w + n * row_bytes, static_cast<const uint8_t*>(scales) + n * groups * param,
                           static_cast<const uint8_t*>(biases) + n * groups * param, bf16, x.group, BITS};
    const PackedRows tile = untile_matrix(tiled, kTileRows, x.K, bytes);
    dots_generic<BITS>(x, tile.w, tile.scales, tile.biases, bf16, 0, kTileRows, out + n, ldo);
  }
}

#if defined(__x86_64__)
// The x86 kernels, built three times: for AVX2+FMA (vpmaddubsw then
// vpmaddwd); for CPUs with AVX-VNNI (one vpdpbusd multiplies four bytes,
// sums them and accumulates); and for AVX-512 VNNI (16 weight rows a
// 512-bit register). EMLX_DPBUSD names the VNNI instruction.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma")
#endif
namespace avx2 {
#include "quantized_dot_x86.inc"
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
#define EMLX_DPBUSD(s, w, x) _mm256_dpbusd_avx_epi32(s, w, x)
#include "quantized_dot_x86.inc"
#undef EMLX_DPBUSD
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
#define EMLX_DPBUSD(s, w, x) _mm256_dpbusd_epi32(s, w, x)
#define EMLX_DOT_ZMM
#include "quantized_dot_x86.inc"
#undef EMLX_DOT_ZMM
#undef EMLX_DPBUSD
}  // namespace avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif

// One group of x: false if it holds a NaN or an infinity, else its step
// and its rounded sum (quantized_dot.h), and q[slot(i)] = round(x[i] / amax
// * 127) for every i (llama.cpp rounds by that factor, not by 1 / step).
bool quantize_group_generic(const float* x, int group, int bits, int8_t* q, float& scale, float& sum) {
  float amax = 0;
  for (int i = 0; i < group; ++i) {
    if (!std::isfinite(x[i])) return false;
    amax = std::fmax(amax, std::fabs(x[i]));
  }
  const float to_int = amax > 0 ? kLevels / amax : 0.0f;
  int32_t total = 0;
  for (int i = 0; i < group; ++i) {
    const int v = static_cast<int>(std::nearbyint(x[i] * to_int));
    q[slot(i, bits, group)] = static_cast<int8_t>(v);
    total += v;
  }
  scale = group_step(amax);
  sum = scale * static_cast<float>(total);
  return true;
}

#if defined(__x86_64__)
// The same, 32 values at a time (groups are 32, 64 or 128). Rounding is the
// CPU's default, to nearest even, as std::nearbyint's.
__attribute__((target("avx2,fma"))) bool quantize_group_avx2(const float* x, int group, int bits, int8_t* q,
                                                             float& scale, float& sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f), inf = _mm256_set1_ps(INFINITY);
  __m256 amax = _mm256_setzero_ps(), bad = _mm256_setzero_ps();
  for (int i = 0; i < group; i += 8) {
    const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(x + i));
    bad = _mm256_or_ps(bad, _mm256_cmp_ps(a, inf, _CMP_NLT_UQ));  // inf or NaN
    amax = _mm256_max_ps(amax, a);
  }
  if (_mm256_movemask_ps(bad)) return false;
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  const float top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  const __m256 to_int = _mm256_set1_ps(top > 0 ? kLevels / top : 0.0f);
  // Within each 128-bit lane: the even bytes first, then the odd ones.
  const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                         0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  __m256i total = _mm256_setzero_si256(), first = _mm256_setzero_si256();
  for (int i = 0; i < group; i += 32) {
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      v[j] = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + i + 8 * j), to_int));
      total = _mm256_add_epi32(total, v[j]);
    }
    // int32 -> int8 in order: the packs interleave 128-bit lanes, the permute undoes it
    __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    bytes = _mm256_permutevar8x32_epi32(bytes, order);
    if (bits == 4) {
      // [evens, odds] of values 0-15 and of 16-31, then the evens of both, then the odds
      bytes = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(bytes, split), 0xD8);
      if (group > 32) {  // per 64 values (slot): the 16 + 16 evens of both halves, then their odds
        if (i % 64 == 0) {
          first = bytes;
          continue;
        }
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i - 32), _mm256_permute2x128_si256(first, bytes, 0x20));
        bytes = _mm256_permute2x128_si256(first, bytes, 0x31);
      }
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i), bytes);
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  scale = group_step(top);
  sum = scale * static_cast<float>(_mm_cvtsi128_si32(t));
  return true;
}
#endif

// tile_in_place and untile for elements of type T (a whole tile at a time:
// [16, C] <-> [C, 16])
template <typename T>
void tile_rows_of(T* data, size_t N, size_t C) {
  std::vector<T> tile(kTileRows * C);
  for (size_t n = 0; n + kTileRows <= N; n += kTileRows) {
    T* at = data + n * C;
    for (size_t c = 0; c < C; ++c) {
      for (size_t r = 0; r < kTileRows; ++r) tile[c * kTileRows + r] = at[r * C + c];
    }
    std::copy(tile.begin(), tile.end(), at);
  }
}

template <typename T>
void untile_rows_of(const T* from, size_t N, size_t C, T* to) {
  const size_t whole = N / kTileRows * kTileRows;
  for (size_t n = 0; n < whole; n += kTileRows) {
    const T* tile = from + n * C;
    for (size_t r = 0; r < kTileRows; ++r) {
      for (size_t c = 0; c < C; ++c) to[(n + r) * C + c] = tile[c * kTileRows + r];
    }
  }
  std::copy(from + whole * C, from + N * C, to + whole * C);
}
}  // namespace

void tile_in_place(void* data, size_t N, size_t C, size_t elem) {
  if (elem == 4) return tile_rows_of(static_cast<uint32_t*>(data), N, C);
  if (elem == 2) return tile_rows_of(static_cast<uint16_t*>(data), N, C);
  throw std::invalid_argument("tile_in_place: 2- or 4-byte elements");
}

void untile(const void* data, size_t N, size_t C, size_t elem, void* out) {
  if (elem == 4) return untile_rows_of(static_cast<const uint32_t*>(data), N, C, static_cast<uint32_t*>(out));
  if (elem == 2) return untile_rows_of(static_cast<const uint16_t*>(data), N, C, static_cast<uint16_t*>(out));
  throw std::invalid_argument("untile: 2- or 4-byte elements");
}

PackedRows untile_matrix(const PackedRows& tiled, size_t N, size_t K, std::vector<uint8_t> (&bytes)[3]) {
  const size_t words = K * tiled.bits / 32, groups = K / tiled.group, param = tiled.params_bf16 ? 2 : 4;
  bytes[0].resize(N * words * 4), bytes[1].resize(N * groups * param), bytes[2].resize(N * groups * param);
  untile(tiled.w, N, words, 4, bytes[0].data());
  untile(tiled.scales, N, groups, param, bytes[1].data());
  untile(tiled.biases, N, groups, param, bytes[2].data());
  return {bytes[0].data(), bytes[1].data(), bytes[2].data(), tiled.params_bf16, tiled.group, tiled.bits};
}

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
                    bool tiled, size_t n0, size_t n1, float* out, size_t ldo) {
#if defined(__x86_64__)
  if (has_avx512_vnni()) {
    return avx512::dots_for(x.bits, params_bf16, x.group)(x, w, scales, biases, tiled, n0, n1, out, ldo);
  }
  if (has_avx_vnni()) return vnni::dots_for(x.bits, params_bf16, x.group)(x, w, scales, biases, tiled, n0, n1, out, ldo);
  if (has_avx2()) return avx2::dots_for(x.bits, params_bf16, x.group)(x, w, scales, biases, tiled, n0, n1, out, ldo);
#endif
  if (tiled) return (x.bits == 4 ? tiled_dots_generic<4> : tiled_dots_generic<8>)(x, w, scales, biases, params_bf16, n0, n1, out, ldo);
  (x.bits == 4 ? dots_generic<4> : dots_generic<8>)(x, w, scales, biases, params_bf16, n0, n1, out, ldo);
}

}  // namespace emlx
