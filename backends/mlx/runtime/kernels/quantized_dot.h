// Dot products of rows of x with MLX's affine 4- and 8-bit quantized weight
// rows, in integers, as llama.cpp computes its 4- and 8-bit formats: each
// group of x (the weights' group: 32, 64 or 128 values) is rounded to int8
// (x ~ a * xq, |xq| <= 127, a = max|x| / 127 rounded to half precision as
// llama.cpp stores it), so a group's sum over code * xq is exact in int32
// and one vpdpbusd multiplies and sums four bytes of weights with four of
// x. The weights' bias term meets the rounded x too (a * sum of xq): the
// result is the exact dot product of the dequantized weights with the
// rounded x, up to float rounding. Every row is rounded alone, so a row of a
// many-row call (a prefill, a verify call) is the one-row call's bit for bit.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace emlx {

// Rows of x quantized per group, laid out as the weight rows unpack.
struct IntRows {
  size_t M = 0, K = 0;
  int group = 0, bits = 0;
  std::vector<int8_t> q;     // [M, K]; 4-bit: per 64 values (32 in groups of 32), the even ones, then the odd
  std::vector<float> scale;  // [M, K / group]: a
  std::vector<float> sum;    // [M, K / group]: a * the sum of xq (what the weights' biases meet)
};

// False (and `rows` unusable) when x holds a NaN or an infinity: the caller
// then takes its float path, which propagates them.
bool quantize_rows(const float* x, size_t M, size_t K, int group, int bits, IntRows& rows);

// Weight rows a tile of the tiled layout.
constexpr size_t kTileRows = 16;

// The tiled layout of an [N, C] matrix of `elem`-byte elements (a weight
// matrix as 4-byte words, its scales, its biases): each whole tile of 16
// rows is stored [C, 16], element c of the tile's row r at c * 16 + r; the
// N % 16 last rows stay as they are. The kernels then read a tile's 16 rows
// side by side, one a 32-bit lane, in one pass over memory, where rows
// stored one after another would have to be transposed on the way (which a
// decode step cannot afford). tile_in_place rearranges a matrix (at load),
// untile writes one back in rows to `out`.
void tile_in_place(void* data, size_t N, size_t C, size_t elem);
void untile(const void* data, size_t N, size_t C, size_t elem, void* out);

// An affine 4- or 8-bit matrix [N, K] as the CPU kernels read it: packed
// rows of K * bits / 8 bytes, scales and biases [N, K / group].
struct PackedRows {
  const uint8_t* w;
  const void *scales, *biases;
  bool params_bf16;  // scales and biases bfloat16, else float32
  int group, bits;
};

// A tiled matrix (weights, scales and biases) back in rows, into `bytes`:
// the same matrix, read from there.
PackedRows untile_matrix(const PackedRows& tiled, size_t N, size_t K, std::vector<uint8_t> (&bytes)[3]);

// out[m * ldo + n] = x[m] . w[n] for n in [n0, n1) and every row m, with
// w = q * scale + bias per group (w: [N, K * bits / 8] bytes; scales and
// biases [N, K / group], float32 or bfloat16; all three tiled or none). n0
// is a multiple of 16, and so is n1 unless it is N: each tile whole.
void quantized_dots(const IntRows& x, const uint8_t* w, const void* scales, const void* biases, bool params_bf16,
                    bool tiled, size_t n0, size_t n1, float* out, size_t ldo);

}  // namespace emlx
