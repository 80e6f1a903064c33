// Eight floats as one vector in GCC/Clang vector extensions: the same code
// compiles to AVX2+FMA inside functions built for it
// (__attribute__((target("avx2,fma")))) and to any CPU's vectors elsewhere.
#pragma once

#include <cstdint>

namespace emlx {

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i32x8 __attribute__((vector_size(32)));

// Inlined into the caller, so compiled for the caller's target.
#define EMLX_INLINE __attribute__((always_inline)) inline

EMLX_INLINE v8 load8(const float* p) {
  v8 v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

EMLX_INLINE void store8(float* p, v8 v) { __builtin_memcpy(p, &v, sizeof v); }

EMLX_INLINE v8 splat(float x) { return v8{} + x; }

// [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7] (AVX's hadd)
EMLX_INLINE v8 pair_sums(v8 a, v8 b) {
  return __builtin_shufflevector(a, b, 0, 2, 8, 10, 4, 6, 12, 14) +
         __builtin_shufflevector(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// Lane c: the lanes of acc[c] summed as ((l0+l1)+(l2+l3))+((l4+l5)+(l6+l7)).
EMLX_INLINE v8 lane_sums(const v8* acc) {
  const v8 g0 = pair_sums(pair_sums(acc[0], acc[1]), pair_sums(acc[2], acc[3]));
  const v8 g1 = pair_sums(pair_sums(acc[4], acc[5]), pair_sums(acc[6], acc[7]));
  return __builtin_shufflevector(g0, g1, 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(g0, g1, 4, 5, 6, 7, 12, 13, 14, 15);
}

EMLX_INLINE float sum_lanes(v8 a) { return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7])); }

// e^x for x <= 0 (e.g. scores minus their maximum); exactly 0 below -87 and
// for -inf (NaN stays NaN). Cephes' expf: a degree-5 polynomial on x - n ln2, times 2^n.
EMLX_INLINE v8 exp_nonpositive(v8 x) {
  const i32x8 keep = x >= -87.0f;
  x = keep ? x : splat(-87.0f);
  const v8 fx = x * 1.44269504088896341f + 0.5f;
  v8 n = __builtin_convertvector(__builtin_convertvector(fx, i32x8), v8);  // toward zero
  n = n > fx ? n - 1.0f : n;                                                // floor
  const v8 r = x - n * 0.693359375f - n * -2.12194440e-4f;
  v8 p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const i32x8 bits = (__builtin_convertvector(n, i32x8) + 127) << 23;
  v8 two_n;
  __builtin_memcpy(&two_n, &bits, sizeof two_n);
  return keep ? p * two_n : v8{};
}

}  // namespace emlx
