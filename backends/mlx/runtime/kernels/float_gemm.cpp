#include "float_gemm.h"

#include <algorithm>
#include <stdexcept>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace emlx {

#if defined(__x86_64__)
namespace {

// r[i] lane j becomes r[j] lane i (a 16 x 16 transpose in registers).
__attribute__((target("avx512f"), always_inline)) inline void transpose16(__m512 (&r)[16]) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
#pragma GCC unroll 2
    for (int j = 0; j < 2; ++j) {
      const __m512d a = _mm512_castps_pd(t[4 * i + j]), b = _mm512_castps_pd(t[4 * i + j + 2]);
      r[4 * i + 2 * j] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
      r[4 * i + 2 * j + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
    }
  }
#pragma GCC unroll 2
  for (int i = 0; i < 2; ++i) {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      t[8 * i + j] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0x88);
      t[8 * i + j + 4] = _mm512_shuffle_f32x4(r[8 * i + j], r[8 * i + j + 4], 0xDD);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}

// float_gemm_columns: 16 rows by 16 values at a time, transposed in registers.
__attribute__((target("avx512f"))) void columns_avx512(const float* x, size_t M, size_t K, float* xt) {
  for (size_t m0 = 0; m0 < M; m0 += kColumnRows) {
    float* chunk = xt + m0 * K;  // (chunks are kColumnRows * K apart)
    for (size_t i0 = 0; i0 < kColumnRows; i0 += 16) {
      for (size_t k = 0; k < K; k += 16) {
        const size_t width = std::min<size_t>(16, K - k);
        const __mmask16 mask = static_cast<__mmask16>(width == 16 ? 0xFFFF : (1u << width) - 1);
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) {
          const size_t m = m0 + i0 + i;
          r[i] = m < M ? _mm512_maskz_loadu_ps(mask, x + m * K + k) : _mm512_setzero_ps();
        }
        transpose16(r);
#pragma GCC unroll 16
        for (int c = 0; c < 16; ++c) {
          if (static_cast<size_t>(c) < width) _mm512_storeu_ps(chunk + (k + c) * kColumnRows + i0, r[c]);
        }
      }
    }
  }
}

// Bytes to ask for into L2 while a product runs (the next weights a caller
// decodes): RN lines every 16 values of k, from `at` up to `end`.
struct Ahead {
  const char *at = nullptr, *end = nullptr;
};

// out[m, j] for the chunk's `rows` rows of x (V vectors of 16) and RN weight
// rows: for each k, weight j's value k (broadcast) times the chunk's values
// k, added in order of k (no sums across lanes). Every 16 values the lines
// of the next RN weight rows at the same k are asked for into L2 (`next`,
// or none), so that the next call finds them there, and RN lines of `ahead`.
template <int RN, int V>
__attribute__((target("avx512f"))) void weight_rows(const float* chunk, size_t rows, size_t K, const float* w,
                                                    bool next, Ahead& ahead, float* out, size_t ldo) {
  __m512 acc[RN][V];
#pragma GCC unroll 8
  for (int j = 0; j < RN; ++j) {
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) acc[j][v] = _mm512_setzero_ps();
  }
  for (size_t k = 0; k < K; ++k) {
    if (k % 16 == 0) {
      if (next) {
#pragma GCC unroll 8
        for (int j = 0; j < RN; ++j) _mm_prefetch(reinterpret_cast<const char*>(w + (RN + j) * K + k), _MM_HINT_T1);
      }
      if (ahead.at < ahead.end) {
#pragma GCC unroll 8
        for (int j = 0; j < RN; ++j) _mm_prefetch(ahead.at + 64 * j, _MM_HINT_T1);
        ahead.at += 64 * RN;
      }
    }
    __m512 xv[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(chunk + k * kColumnRows + 16 * v);
#pragma GCC unroll 8
    for (int j = 0; j < RN; ++j) {
      const __m512 wv = _mm512_set1_ps(w[j * K + k]);
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) acc[j][v] = _mm512_fmadd_ps(wv, xv[v], acc[j][v]);
    }
  }
  const __m512i lanes = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                           _mm512_set1_epi32(static_cast<int>(ldo)));
#pragma GCC unroll 4
  for (int v = 0; v < V; ++v) {
    const size_t left = rows > 16u * v ? rows - 16 * v : 0;
    const __mmask16 mask = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
#pragma GCC unroll 8
    for (int j = 0; j < RN; ++j) _mm512_mask_i32scatter_ps(out + 16 * v * ldo + j, mask, lanes, acc[j][v], 4);
  }
}

// All N weight rows against one chunk of x rows.
template <int V>
__attribute__((target("avx512f"))) void chunk_product(const float* chunk, size_t rows, size_t K, const float* w,
                                                      size_t N, Ahead& ahead, float* out, size_t ldo) {
  // 24 accumulators: with V of x and a weight, 26-29 of the 32 registers
  constexpr size_t kRN = float_gemm_weight_rows(16 * V);
  size_t n = 0;
  for (; n + kRN <= N; n += kRN) {
    weight_rows<kRN, V>(chunk, rows, K, w + n * K, n + 2 * kRN <= N, ahead, out + n, ldo);
  }
  for (; n < N; ++n) weight_rows<1, V>(chunk, rows, K, w + n * K, false, ahead, out + n, ldo);
}

}  // namespace
#endif

void float_gemm_columns(const float* x, size_t M, size_t K, float* xt) {
#if defined(__x86_64__)
  columns_avx512(x, M, K, xt);
#else
  (void)x, (void)M, (void)K, (void)xt;
  throw std::logic_error("float_gemm_columns: an x86 kernel, called on another CPU");
#endif
}

void float_gemm(const float* xt, size_t M, size_t K, const float* w, size_t N, float* out, size_t ldo,
                const void* ahead, size_t ahead_bytes) {
#if defined(__x86_64__)
  Ahead next{static_cast<const char*>(ahead), static_cast<const char*>(ahead) + (ahead ? ahead_bytes : 0)};
  for (size_t m0 = 0; m0 < M; m0 += kColumnRows) {
    const size_t rows = std::min(kColumnRows, M - m0);
    const float* chunk = xt + m0 * K;
    float* o = out + m0 * ldo;
    switch ((rows + 15) / 16) {
      case 1: chunk_product<1>(chunk, rows, K, w, N, next, o, ldo); break;
      case 2: chunk_product<2>(chunk, rows, K, w, N, next, o, ldo); break;
      case 3: chunk_product<3>(chunk, rows, K, w, N, next, o, ldo); break;
      default: chunk_product<4>(chunk, rows, K, w, N, next, o, ldo); break;
    }
  }
#else
  (void)xt, (void)M, (void)K, (void)w, (void)N, (void)out, (void)ldo, (void)ahead, (void)ahead_bytes;
  throw std::logic_error("float_gemm: an x86 kernel, called on another CPU");
#endif
}

}  // namespace emlx
