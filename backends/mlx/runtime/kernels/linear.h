// y = x @ w^T (+ bias): the linear layer, with CPU kernels of ours for
// float32 and bfloat16 weights and for MLX's affine 4- and 8-bit quantized
// weights (MLX's CPU matmul calls a single-threaded reference BLAS, and its
// CPU quantized_matmul is a scalar loop). Quantized weights: integer dot
// products on the packed rows for any number of rows of x (quantized_dot.h).
// Float weights: up to kDotRows (16) rows of x, dot products on the stored
// weights; more (prefill), OpenBLAS sgemm on tiles of them. Either way, up to
// kDotRows rows each row is computed as a one-row call computes it.
#pragma once

#include <mlx/mlx.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "packed_floats.h"
#include "quantized_dot.h"

namespace emlx {

// x's RMS norm (as rms_norm, norm.h: weight [K]), taken before the product.
struct RowNorm {
  mlx::core::array weight;
  float eps;
};

// What a linear layer does besides x w^T, in this order: x normalized first
// (a decoder's norm before its projections), then a bias [N] added, then a
// residual of the output's shape and x's dtype (the residual stream a
// decoder layer adds the layer's output to). Each is one node fewer; our
// kernel takes the norm and the residual for float32 x, MLX's ops
// elsewhere, with the same values.
struct LinearTerms {
  std::optional<RowNorm> norm;
  std::optional<mlx::core::array> bias, residual;
};

// x [..., K], w [N, K] -> [..., N], with the terms. On a CPU stream with
// float32 or bfloat16 operands of one dtype it runs our multi-threaded
// kernel; anywhere else (GPUs, other dtypes) it is mlx::core::matmul with
// the same semantics.
mlx::core::array linear(const mlx::core::array& x, const mlx::core::array& w, const LinearTerms& terms,
                        mlx::core::StreamOrDevice s = {});

// The same as linear with w a float32 matrix packed at load (packed_floats.h):
// bit for bit what w's floats give. x and the bias float32 take our kernel;
// other dtypes, MLX's product on the unpacked floats.
mlx::core::array packed_float_linear(const mlx::core::array& x, const PackedFloats& p, const LinearTerms& terms,
                                     mlx::core::StreamOrDevice s = {});

// A matrix in one of MLX's quantized layouts (mlx::core::quantize): w
// [N, K * bits / 32] packed 32-bit words, scales [N, K / group_size] and, for
// mode "affine" only, biases of the same shape (mode "mxfp4": uint8 scales).
struct QuantizedMatrix {
  mlx::core::array w, scales;
  std::optional<mlx::core::array> biases;
  int group_size, bits;
  std::string mode;
  bool tiled = false;  // w, scales and biases in the tiled layout (quantized_dot.h): an affine 4- or 8-bit matrix
};

// How our kernel meets x with 4- and 8-bit weights: Int8 rounds each group
// of x to 8 bits and multiplies in integers (quantized_dot.h, llama.cpp's
// way, the faster); Float multiplies x by the dequantized weights in floats
// (mlx::core::quantized_matmul's way, so mlx-lm's).
enum class Activations { Int8, Float };

// The same as linear with w quantized. Our kernel on a CPU stream for affine
// 4 and 8 bits when x, scales (and bias) share a float32 or bfloat16 dtype;
// mlx::core::quantized_matmul otherwise.
mlx::core::array quantized_linear(const mlx::core::array& x, const QuantizedMatrix& q, const LinearTerms& terms,
                                  Activations activations, mlx::core::StreamOrDevice s = {});

// A tiled [..., N, C] matrix (quantized_dot.h; each [N, C] tiled alone)
// back in rows, in MLX ops: for MLX's own kernels (another device, dtypes
// ours do not take).
mlx::core::array untiled(const mlx::core::array& a, mlx::core::StreamOrDevice s = {});

// Rows `ids` (any shape, in [-N, N)) of [N, C] matrices with the same N
// (a table, its scales, its biases), stored in rows or tiled
// (quantized_dot.h): [..., C] each.
std::vector<mlx::core::array> take_rows(const std::vector<mlx::core::array>& tables, const mlx::core::array& ids,
                                        bool tiled, mlx::core::StreamOrDevice s = {});

// Throws std::invalid_argument naming `node` unless `q` is a valid
// quantization of an [N, K] matrix (N: w's rows).
void check_quantization(const char* node, const QuantizedMatrix& q, int K);

// out [M, N] = x [M, K] w^T for a row-major w [N, K] of float32 (or
// bfloat16, w_bf16), x and out float32: LinearNode's kernel (each row as a
// one-row call computes it up to kDotRows rows, sgemm beyond), for other
// kernels of ours. Runs on the calling thread and our pool.
void float_linear_rows(const float* x, size_t M, size_t K, const void* w, bool w_bf16, size_t N, float* out);

// The same for w packed: QuantizedLinearNode's kernel with Activations::Float.
void dequantized_linear_rows(const float* x, size_t M, size_t K, const PackedRows& w, size_t N, float* out);

}  // namespace emlx
