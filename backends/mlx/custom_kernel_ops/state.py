"""State-layer recurrences: the gated delta rule, Mamba-2's state-space scan and Mamba-1's selective scan.

    torch.ops.mlx.gated_delta(q[B, H, L, Dk], k[B, H, L, Dk], v[B, H, L, Dv],
                              g[B, H, L] or [B, H, L, Dk], beta[B, H, L],
                              state[B, H, Dk, Dv], snapshots)
        -> float32 [B, H, L + min(L, snapshots) * Dk, Dv]

runs, for t = 0 .. L-1 and each head (q and k already normalized and
scaled, g the log of the decay: one per head (Qwen3.5's gated delta rule) or
one per key channel, row of S (Kimi's delta attention, KDA)):

    S = S * exp(g_t)          (g_t [Dk]: row i of S times exp(g_t,i))
    S = S + k_t (beta_t (v_t - k_t^T S))^T
    o_t = S^T q_t

from S = state. The result packs the outputs and the states a runner may come
back to along axis 2: rows 0 .. L-1 are o_0 .. o_{L-1}; then m = min(L,
snapshots) blocks of Dk rows, block i the state after position L - m + i:
the states of the call's last positions only (a decode step writes one
state, not `snapshots`; the states before the call are where the runner
left them). Packing keeps it one node with one output (the IR's nodes have
one); llm/export/state_cache.py unpacks it.

    torch.ops.mlx.ssd_scan(x[B, H, L, P], dt[B, H, L], a[H], b[B, H, L, N],
                           c[B, H, L, N], state[B, H, P, N],
                           snapshots) -> float32 [B, H, L + min(L, snapshots) * N, P]

is Mamba-2's scan (dt already through softplus and its limits, `a` the
negative decay rate per head; D's skip term and the gate stay outside):

    S = S * exp(dt_t a) + dt_t x_t b_t^T
    y_t = S c_t

packed the same way, with the states stored transposed ([N, P] blocks).

    torch.ops.mlx.selective_scan(x[B, D, L], dt[B, D, L], a[D, N], b[B, L, N],
                                 c[B, L, N], state[B, D, N],
                                 snapshots) -> float32 [B, D, L + min(L, snapshots) * N]

is Mamba-1's scan (dt already through its bias and softplus, `a` the negative
decay rates per channel and state; D's skip term and the gate stay outside),
each channel d with a state of N values, each decaying at its own rate:

    S_d = S_d * exp(dt_t,d a_d) + dt_t,d x_t,d b_t
    y_t,d = S_d . c_t

packed along the last axis: the L outputs, then min(L, snapshots) states of N.

The references below step once per position in float64, as exact as a
reference gets; the runtime (runtime/kernels/state_scan.cpp) steps for
short calls and uses the chunked matrix form for long ones.
"""

from __future__ import annotations

import torch

torch.library.define("mlx::gated_delta",
                     "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor state, int snapshots) -> Tensor")
torch.library.define("mlx::ssd_scan",
                     "(Tensor x, Tensor dt, Tensor a, Tensor b, Tensor c, Tensor state, int snapshots) -> Tensor")
torch.library.define("mlx::selective_scan",
                     "(Tensor x, Tensor dt, Tensor a, Tensor b, Tensor c, Tensor state, int snapshots) -> Tensor")


def kept_states(length, snapshots: int):
    """How many states a call of `length` positions returns (symbolic in a trace)."""
    return torch.sym_min(length, snapshots)


def _packed_like(values: torch.Tensor, state_rows: int, snapshots: int) -> torch.Tensor:
    """The fakes: `values` [B, H, L, R] -> float32 [B, H, L + min(L, snapshots) * state_rows, R]."""
    batch, heads, length, width = values.shape
    return values.new_empty((batch, heads, length + kept_states(length, snapshots) * state_rows, width),
                            dtype=torch.float32)


def _pack(outputs: list, states: list, snapshots: int) -> torch.Tensor:
    """outputs [B, H, R] and states [B, H, S, R] after each position -> the packed result."""
    kept = states[len(states) - min(len(states), snapshots):]  # the last min(L, snapshots)
    return torch.cat([torch.stack(outputs, 2)] + kept, 2).to(torch.float32)


@torch.library.impl("mlx::gated_delta", "CompositeExplicitAutograd")
def gated_delta_reference(q, k, v, g, beta, state, snapshots):
    q, k, v, g, beta, s = (t.to(torch.float64) for t in (q, k, v, g, beta, state))
    outputs, states = [], []
    rows = g if g.dim() == 4 else g[..., None]  # [B, H, L, Dk or 1]: the decay of each row of S
    for t in range(q.shape[2]):
        s = s * rows[:, :, t].exp()[..., None]
        memory = (s * k[:, :, t, :, None]).sum(-2)
        delta = (v[:, :, t] - memory) * beta[:, :, t, None]
        s = s + k[:, :, t, :, None] * delta[:, :, None, :]
        outputs.append((s * q[:, :, t, :, None]).sum(-2))
        states.append(s)
    return _pack(outputs, states, snapshots)


@torch.library.register_fake("mlx::gated_delta")
def _gated_delta_fake(q, k, v, g, beta, state, snapshots):
    return _packed_like(v, k.shape[3], snapshots)


@torch.library.impl("mlx::ssd_scan", "CompositeExplicitAutograd")
def ssd_scan_reference(x, dt, a, b, c, state, snapshots):
    x, dt, a, b, c, s = (t.to(torch.float64) for t in (x, dt, a, b, c, state))
    s = s.transpose(-1, -2)  # [B, H, N, P]: states are packed transposed
    outputs, states = [], []
    for t in range(x.shape[2]):
        decay = (dt[:, :, t] * a).exp()[..., None, None]
        s = s * decay + dt[:, :, t, None, None] * b[:, :, t, :, None] * x[:, :, t, None, :]
        outputs.append((s * c[:, :, t, :, None]).sum(-2))
        states.append(s)
    return _pack(outputs, states, snapshots)


@torch.library.register_fake("mlx::ssd_scan")
def _ssd_scan_fake(x, dt, a, b, c, state, snapshots):
    return _packed_like(x, b.shape[3], snapshots)


@torch.library.impl("mlx::selective_scan", "CompositeExplicitAutograd")
def selective_scan_reference(x, dt, a, b, c, state, snapshots):
    x, dt, a, b, c, s = (t.to(torch.float64) for t in (x, dt, a, b, c, state))
    outputs, states = [], []  # as the other scans' rows: outputs [B, D, 1], states [B, D, N, 1]
    for t in range(x.shape[2]):
        s = s * (dt[:, :, t, None] * a).exp() + (dt[:, :, t] * x[:, :, t])[..., None] * b[:, None, t]
        outputs.append((s * c[:, None, t]).sum(-1, keepdim=True))
        states.append(s[..., None])
    return _pack(outputs, states, snapshots).flatten(2)


@torch.library.register_fake("mlx::selective_scan")
def _selective_scan_fake(x, dt, a, b, c, state, snapshots):
    batch, channels, length = x.shape
    return x.new_empty((batch, channels, length + kept_states(length, snapshots) * a.shape[1]), dtype=torch.float32)
