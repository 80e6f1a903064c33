// Float32 products for many rows of x (a prefill) without OpenBLAS's
// packing of the weights: the weights are read where they are stored, a
// value of 6-24 weight rows at a time (fewer at the end) broadcast against
// the same value of up to 64 rows of x, which float_gemm_columns lays side
// by side once a product. Outer products like these need no sums across a
// register's lanes (the dot products of the decode kernel do).
#pragma once

#include <cstddef>

namespace emlx {

// Rows of x a chunk of float_gemm_columns' layout.
constexpr size_t kColumnRows = 64;

// xt = x [M, K] in chunks of kColumnRows rows, each [K, kColumnRows]: value
// k of the chunk's rows side by side (rows past M zero). xt holds
// ceil(M / kColumnRows) * kColumnRows * K floats. AVX-512 CPUs only, as below.
void float_gemm_columns(const float* x, size_t M, size_t K, float* xt);

// Weight rows float_gemm meets at once for a chunk of `rows` rows of x (1-64):
// 24 accumulators over the chunk's vectors of 16.
constexpr size_t float_gemm_weight_rows(size_t rows) { return 24 / ((rows + 15) / 16); }

// out[m * ldo + n] = x[m] . w[n] for x [M, K] (as float_gemm_columns lays it
// out) and w [N, K] (rows adjacent), on a CPU with AVX-512 only (has_avx512(),
// thread_pool.h; the callers take OpenBLAS elsewhere). The `ahead_bytes`
// at `ahead` (the caller's next weights, decoded before they are met) are
// asked for into L2 meanwhile, spread over the product.
void float_gemm(const float* xt, size_t M, size_t K, const float* w, size_t N, float* out, size_t ldo,
                const void* ahead = nullptr, size_t ahead_bytes = 0);

}  // namespace emlx
