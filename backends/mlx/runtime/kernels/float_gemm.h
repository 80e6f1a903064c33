// Float32 products for many rows of x (a prefill) without OpenBLAS's
// packing: x and the weights both keep K contiguous, so a tile of 4 rows of
// x and 6 weight rows is 24 dot products at once in AVX-512 registers, each
// weight read straight from where it is stored. OpenBLAS copies (packs) every
// weight tile before multiplying: a quarter of a float32 prefill's time went
// to that copy.
#pragma once

#include <cstddef>

namespace emlx {

// out[m * ldo + n] = x[m] . w[n] for x [M, K] and w [N, K] (rows adjacent),
// on a CPU with AVX-512 only (has_avx512(), thread_pool.h; the callers take
// OpenBLAS elsewhere).
void float_gemm(const float* x, size_t M, size_t K, const float* w, size_t N, float* out, size_t ldo);

}  // namespace emlx
