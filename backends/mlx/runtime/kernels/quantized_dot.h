// Dot products of rows of x with MLX's affine 4- and 8-bit quantized weight
// rows, in integers: each group of x is scaled to int16 (x ~ a * xq,
// |xq| <= 32767, a = max|x| / 32767), so a group's sum over q * xq is exact
// in int32 and costs one multiply-add per two weights instead of a
// conversion to float per weight. The rounding of x to 16 bits is the only
// change to the sum: at most 2^-16 of the group's largest |x| per value, far
// below the weights' own 4- or 8-bit steps. (int8 x, as llama.cpp takes,
// multiplies 4-bit codes twice as fast with vpmaddubsw, but its 256x coarser
// steps tip tokens far more often: on the benchmark model's looping prompt,
// greedy decoding of the prompt prefilled whole and of the same prompt met
// token by token from the cache parted; with int16 x they agree.)
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace emlx {

// Rows of x quantized per group, laid out as the weight rows unpack.
struct IntRows {
  size_t M = 0, K = 0;
  int group = 0, bits = 0;
  std::vector<int16_t> q;    // [M, K]; 4-bit: each 32 values as their 16 even then 16 odd ones
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
