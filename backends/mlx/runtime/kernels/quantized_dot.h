// Dot products of a few rows of x (decoding: one) with MLX's affine
// 4- and 8-bit quantized weight rows, in integers: each group of x is
// scaled to integers (x ~ a * xq, a = max|x| / L), so a group's sum over
// q * xq is exact in int32 and the weights are never converted to float.
// Against 4-bit codes x is int8 (L = 127): vpmaddubsw multiplies 32 codes
// with x in one instruction. Against 8-bit codes it is int16 (L = 32767):
// an 8-bit code times an int8 would overflow vpmaddubsw's int16 pair sums,
// so vpmaddwd takes 16 at a time. The rounding of x is the only change to
// the sum: at most half of max|x| / L per value (1/254 of the group's
// largest |x| for 4-bit weights, below their own step of 1/15 of the
// group's range; 1/65534 for 8-bit ones).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace emlx {

// Rows of x quantized per group, laid out as the weight rows unpack.
struct IntRows {
  size_t M = 0, K = 0;
  int group = 0, bits = 0;
  std::vector<int8_t> q8;    // 4-bit weights: [M, K], each 32 values as their 16 even then 16 odd ones
  std::vector<int16_t> q16;  // 8-bit weights: [M, K] in order
  std::vector<float> scale;  // [M, K / group]: a
  std::vector<float> sum;    // [M, K / group]: the float sum of x (the weights' bias term)
};

// False (and `rows` unusable) when x holds a NaN or an infinity: the caller
// then takes its float path, which propagates them.
bool quantize_rows(const float* x, size_t M, size_t K, int group, int bits, IntRows& rows);

// out[m * ldo + n] = x[m] . w[n] for n in [n0, n1) and every row m, with
// w = q * scale + bias per group (w: [N, K * bits / 8] bytes; scales and
// biases [N, K / group], float32 or bfloat16).
void quantized_dots(const IntRows& x, const uint8_t* w, const void* scales, const void* biases, bool params_bf16,
                    size_t n0, size_t n1, float* out, size_t ldo);

}  // namespace emlx
