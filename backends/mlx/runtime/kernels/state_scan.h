// The recurrences of state layers (custom_kernel_ops/state.py has their
// exact definitions and the packed result): the gated delta rule (Qwen3.5,
// Qwen3-Next), Mamba-2's state-space scan (Granite 4, Nemotron-H,
// Falcon-H1, Bamba, Mamba-2) and Mamba-1's selective scan (Mamba,
// Falcon-Mamba, Jamba). Composed from MLX ops, so they run on any
// device: one recurrent step per position for the positions whose states
// are kept (a decode or verify call is only those), the chunked matrix form
// for the positions before them (a prefill), whose cost is a few matrix
// products per 64 positions instead of a step each.
#pragma once

#include <mlx/mlx.h>

namespace emlx {

// Which states a scan returns after its outputs (custom_kernel_ops/state.py).
struct KeptStates {
  int snapshots;          // the states after the call's last positions a runner may come back to
  bool call_states_only;  // min(L, snapshots) of them; else `snapshots`, the initial state before the call
};

// q, k [B, H, L, Dk], v [B, H, L, Dv], g, beta [B, H, L], state [B, H, Dk, Dv]
// -> float32 [B, H, L + S * Dk, Dv] (S: the states kept).
mlx::core::array gated_delta(const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v,
                             const mlx::core::array& g, const mlx::core::array& beta, const mlx::core::array& state,
                             const KeptStates& kept);

// x [B, H, L, P], dt [B, H, L], a [H], b, c [B, H, L, N], state [B, H, P, N]
// -> float32 [B, H, L + S * N, P].
mlx::core::array ssd_scan(const mlx::core::array& x, const mlx::core::array& dt, const mlx::core::array& a,
                          const mlx::core::array& b, const mlx::core::array& c, const mlx::core::array& state,
                          const KeptStates& kept);

// x, dt [B, D, L], a [D, N], b, c [B, L, N], state [B, D, N]
// -> float32 [B, D, L + S * N].
mlx::core::array selective_scan(const mlx::core::array& x, const mlx::core::array& dt, const mlx::core::array& a,
                                const mlx::core::array& b, const mlx::core::array& c, const mlx::core::array& state,
                                const KeptStates& kept);

}  // namespace emlx
