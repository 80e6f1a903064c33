// Mixture-of-experts layers: each row of a call against the weights of the
// experts it chose. MLX's CPU gather_mm / gather_qmm run one matrix-vector
// product per (row, expert) pair (gather_qmm in a scalar loop), reading an
// expert's weights again for every row routed to it; our kernels group a
// call's rows by expert, so each chosen expert's weights are read once per
// call, by the dense linear kernels (linear.h, quantized_dot.h): a pair is
// what the dense layer computes for its row against its expert's rows.
#pragma once

#include <mlx/mlx.h>

#include <optional>

#include "linear.h"

namespace emlx {

// x [T, K] (one row for all of a row's experts) or [T, k, K], ids uint32
// [T, k] in [0, E), w [E, N, K], bias [E, N] in w's dtype or none ->
// [T, k, N]. Our kernel on a CPU stream for float32 and bfloat16 (x in w's
// dtype); mlx::core::gather_mm otherwise.
mlx::core::array gather_linear(const mlx::core::array& x, const mlx::core::array& ids, const mlx::core::array& w,
                               const std::optional<mlx::core::array>& bias, mlx::core::StreamOrDevice s = {});

// The same with q [E, N, ...] per-expert tables of QuantizedLinearNode's
// layout, x and bias in the scales' dtype. Our kernel on a CPU stream for
// affine 4 and 8 bits with float32 or bfloat16 scales (x met as
// `activations` says); mlx::core::gather_qmm otherwise.
mlx::core::array gather_quantized_linear(const mlx::core::array& x, const mlx::core::array& ids,
                                         const QuantizedMatrix& q, const std::optional<mlx::core::array>& bias,
                                         Activations activations, mlx::core::StreamOrDevice s = {});

}  // namespace emlx
