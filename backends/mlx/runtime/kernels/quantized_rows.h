// Rows of an affine-quantized table, dequantized (QuantizedEmbeddingNode: a
// token's embedding). MLX's dequantize on a CPU stream is a composition of
// ops (a shift pair and an axis per value of a word, a concatenation, a
// multiply and an add, and the tiled layout's row lookups): about 45 arrays
// and their tasks for the one row a decode step reads. Our kernel is one.
#pragma once

#include <mlx/mlx.h>

#include "linear.h"

namespace emlx {

// Rows `ids` (any integer shape, clamped into [-N, N - 1], negative ones
// counted from the end) of `q`'s [N, K] matrix, dequantized as
// mlx::core::dequantize computes them (q * scale, then + bias, each rounded
// to the scales' type, or to float32 when that is not `dtype`), in `dtype`:
// [..., K]. Our kernel on a CPU stream for affine 2-, 4- and 8-bit tables
// (stored in rows or tiled) with float32 or bfloat16 scales and dtype;
// MLX's ops otherwise, with the same values.
mlx::core::array quantized_rows(const QuantizedMatrix& q, const mlx::core::array& ids, mlx::core::Dtype dtype,
                                mlx::core::StreamOrDevice s = {});

}  // namespace emlx
