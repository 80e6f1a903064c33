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

// What an experts layer adds to its products: a bias row per expert, and
// how its rows are combined.
struct ExpertsOptions {
  std::optional<mlx::core::array> bias;  // [E, N] in the output's dtype
  // [T, k] float32: out [T, N] = sum over j (in order, from 0) of
  // weights[t, j] * y[t, j] (an MoE layer's combination of its experts),
  // instead of y [T, k, N] itself. Float32 outputs only.
  std::optional<mlx::core::array> weights;
};

// x [T, K] (one row for all of a row's experts) or [T, k, K], ids [T, k]
// integers (clamped into [0, E)), w [E, N, K] -> [T, k, N] (or, weighted,
// [T, N]). Our kernel on a CPU stream for float32 and bfloat16 (x in w's
// dtype); mlx::core::gather_mm otherwise.
mlx::core::array gather_linear(const mlx::core::array& x, const mlx::core::array& ids, const mlx::core::array& w,
                               const ExpertsOptions& options, mlx::core::StreamOrDevice s = {});

// The same with q [E, N, ...] per-expert tables of QuantizedLinearNode's
// layout, x and bias in the scales' dtype. Our kernel on a CPU stream for
// affine 4 and 8 bits with float32 or bfloat16 scales (x met as
// `activations` says); mlx::core::gather_qmm otherwise.
mlx::core::array gather_quantized_linear(const mlx::core::array& x, const mlx::core::array& ids,
                                         const QuantizedMatrix& q, Activations activations,
                                         const ExpertsOptions& options, mlx::core::StreamOrDevice s = {});

}  // namespace emlx
