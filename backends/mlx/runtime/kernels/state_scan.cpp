#include "state_scan.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <vector>

#include "cpu_arrays.h"
#include "cpu_kernel.h"
#include "matmul.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

constexpr int kChunk = 64;

// a[:, :, start:stop] of a [B, H, L, ...] array.
mx::array rows(const mx::array& a, int start, int stop) {
  mx::Shape lo(a.ndim(), 0), hi = a.shape();
  lo[2] = start;
  hi[2] = stop;
  return mx::slice(a, lo, hi);
}

// a [B, H, L, ...] -> [B, H, n, size, ...], zero-padded to n * size positions.
mx::array chunked(const mx::array& a, int n, int size = kChunk) {
  const int pad = n * size - a.shape(2);
  mx::array padded = pad ? mx::pad(a, std::vector<int>{2}, mx::Shape{0}, mx::Shape{pad}, mx::array(0, a.dtype())) : a;
  mx::Shape shape = a.shape();
  shape[2] = size;
  shape.insert(shape.begin() + 2, n);
  return mx::reshape(padded, shape);
}

// [..., C, C]: exp(cum_i - cum_j) for j <= i, else 0 (cum [..., C]).
mx::array pairwise_decay(const mx::array& cum) {
  auto diff = mx::subtract(mx::expand_dims(cum, -1), mx::expand_dims(cum, -2));
  auto lower = mx::tril(mx::ones({kChunk, kChunk}, mx::bool_));
  return mx::where(lower, mx::exp(mx::where(lower, diff, mx::array(0.0f))), mx::array(0.0f));
}

// The last dims of chunk i of a [B, H, n, C, ...] array: [B, H, C, ...].
mx::array chunk(const mx::array& a, int i) {
  mx::Shape lo(a.ndim(), 0), hi = a.shape();
  lo[2] = i;
  hi[2] = i + 1;
  return mx::squeeze(mx::slice(a, lo, hi), 2);
}

mx::array last_rows(const mx::array& a) { return mx::swapaxes(a, -1, -2); }

// The packed result: outputs [B, H, L, R], then the states [B, H, S, R] kept
// (KeptStates): after the call's last positions, `initial` standing in for
// positions before the call where all `snapshots` are kept.
mx::array pack(const std::vector<mx::array>& outputs, const std::vector<mx::array>& states, const mx::array& initial,
               const KeptStates& kept) {
  std::vector<mx::array> parts = outputs;
  const int count = std::max(kept.snapshots, 0);
  const int own = std::min(static_cast<int>(states.size()), count);
  if (!kept.call_states_only) parts.insert(parts.end(), count - own, initial);
  parts.insert(parts.end(), states.end() - own, states.end());
  return mx::concatenate(parts, 2);
}

// (I + A)^-1 for a strictly lower [..., C, C] A, given as nil = -A (nilpotent):
// sum N^i = (I + N)(I + N^2)(I + N^4)... (log2 C products).
mx::array unit_lower_inverse(const mx::array& nil, int size) {
  auto inverse = mx::add(mx::eye(size, mx::float32), nil);
  auto power = nil;
  for (int span = 2; span < size; span *= 2) {
    power = emlx::matmul(power, power);
    inverse = mx::add(inverse, emlx::matmul(inverse, power));
  }
  return inverse;
}

// The delta rule's chunk after chunk ([B, H, n, C, ...] per-chunk terms):
// each chunk's outputs from the state carried in, and the state carried on.
mx::array carry_chunks(const mx::array& new_values, const mx::array& k_cumdecay, const mx::array& q_decayed,
                       const mx::array& intra, const mx::array& k_decayed, const mx::array& chunk_decay, int L,
                       mx::array& s) {
  std::vector<mx::array> outs;
  for (int i = 0; i < new_values.shape(2); ++i) {
    auto v_new = mx::subtract(chunk(new_values, i), emlx::matmul(chunk(k_cumdecay, i), s));
    outs.push_back(mx::add(emlx::matmul(chunk(q_decayed, i), s), emlx::matmul(chunk(intra, i), v_new)));
    s = mx::add(mx::multiply(s, chunk(chunk_decay, i)), emlx::matmul(last_rows(chunk(k_decayed, i)), v_new));
  }
  return rows(mx::concatenate(outs, 2), 0, L);
}

// Gated delta rule, chunked form over all of q..beta (float32, [B, H, L, ...]);
// returns the outputs and updates `s`.
mx::array gated_delta_chunks(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                             const mx::array& beta, mx::array& s) {
  const int L = q.shape(2), n = (L + kChunk - 1) / kChunk;
  auto qc = chunked(q, n), kc = chunked(k, n), vc = chunked(v, n);
  auto gc = chunked(g, n), bc = chunked(beta, n);  // padding: g = 0 (no decay), beta = 0 (no write)
  auto cum = mx::cumsum(gc, -1);  // [B, H, n, C]
  auto decay = pairwise_decay(cum);
  auto k_beta = mx::multiply(kc, mx::expand_dims(bc, -1));
  auto v_beta = mx::multiply(vc, mx::expand_dims(bc, -1));
  auto kt = mx::swapaxes(kc, -1, -2);
  // A = (k_beta k^T) * decay, strictly lower
  auto strict = mx::tril(mx::ones({kChunk, kChunk}, mx::bool_), -1);
  auto nil = mx::where(strict, mx::negative(mx::multiply(emlx::matmul(k_beta, kt), decay)), mx::array(0.0f));
  auto inverse = unit_lower_inverse(nil, kChunk);
  auto exp_cum = mx::exp(cum);
  auto new_values = emlx::matmul(inverse, v_beta);
  auto k_cumdecay = emlx::matmul(inverse, mx::multiply(k_beta, mx::expand_dims(exp_cum, -1)));
  auto intra = mx::multiply(emlx::matmul(qc, kt), decay);
  auto last = mx::slice(cum, {0, 0, 0, kChunk - 1}, cum.shape());  // [B, H, n, 1]
  auto q_decayed = mx::multiply(qc, mx::expand_dims(exp_cum, -1));
  auto k_decayed = mx::multiply(kc, mx::expand_dims(mx::exp(mx::subtract(last, cum)), -1));
  auto chunk_decay = mx::expand_dims(mx::exp(last), -1);  // [B, H, n, 1, 1]
  return carry_chunks(new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay, L, s);
}

// [..., C, C, Dk]: exp(cum_i - cum_j) per key channel for j <= i, else 0 (cum [..., C, Dk]).
mx::array pairwise_channel_decay(const mx::array& cum, int size) {
  auto diff = mx::subtract(mx::expand_dims(cum, -2), mx::expand_dims(cum, -3));
  auto lower = mx::expand_dims(mx::tril(mx::ones({size, size}, mx::bool_)), -1);
  return mx::where(lower, mx::exp(mx::where(lower, diff, mx::array(0.0f))), mx::array(0.0f));
}

// [..., C, C]: sum over c of a_i[c] b_j[c] decay[i, j, c] (a, b [..., C, Dk]).
mx::array decayed_scores(const mx::array& a, const mx::array& b, const mx::array& decay) {
  return mx::sum(mx::multiply(mx::multiply(mx::expand_dims(a, -2), mx::expand_dims(b, -3)), decay), -1);
}

// The gated delta rule with a decay per key channel (Kimi's delta attention),
// chunked form over chunks of kChannelChunk positions: the pairwise decays
// are [C, C, Dk] per chunk, kept small; the same steps as gated_delta_chunks
// with exp(cum_i - cum_j) inside each product over the key channels.
constexpr int kChannelChunk = 16;

mx::array channel_delta_chunks(const mx::array& q, const mx::array& k, const mx::array& v, const mx::array& g,
                               const mx::array& beta, mx::array& s) {
  const int C = kChannelChunk, L = q.shape(2), n = (L + C - 1) / C;
  auto qc = chunked(q, n, C), kc = chunked(k, n, C), vc = chunked(v, n, C);
  auto cum = mx::cumsum(chunked(g, n, C), -2);  // [B, H, n, C, Dk]; padding: g = 0 (no decay)
  auto bc = mx::expand_dims(chunked(beta, n, C), -1);  // padding: beta = 0 (no write)
  auto decay = pairwise_channel_decay(cum, C);     // [B, H, n, C, C, Dk]
  auto k_beta = mx::multiply(kc, bc);
  auto strict = mx::tril(mx::ones({C, C}, mx::bool_), -1);
  auto nil = mx::where(strict, mx::negative(decayed_scores(k_beta, kc, decay)), mx::array(0.0f));
  auto inverse = unit_lower_inverse(nil, C);
  auto exp_cum = mx::exp(cum);
  auto new_values = emlx::matmul(inverse, mx::multiply(vc, bc));
  auto k_cumdecay = emlx::matmul(inverse, mx::multiply(k_beta, exp_cum));
  auto intra = decayed_scores(qc, kc, decay);  // the diagonal too: a position reads its own write
  auto last = mx::slice(cum, {0, 0, 0, C - 1, 0}, cum.shape());  // [B, H, n, 1, Dk]
  auto q_decayed = mx::multiply(qc, exp_cum);
  auto k_decayed = mx::multiply(kc, mx::exp(mx::subtract(last, cum)));
  auto chunk_decay = mx::swapaxes(mx::exp(last), -1, -2);  // [B, H, n, Dk, 1]: per row of s
  return carry_chunks(new_values, k_cumdecay, q_decayed, intra, k_decayed, chunk_decay, L, s);
}

// Mamba-2's scan, chunked form; s is [B, H, N, P] (transposed), updated.
mx::array ssd_chunks(const mx::array& x, const mx::array& dt, const mx::array& a, const mx::array& b,
                     const mx::array& c, mx::array& s) {
  const int L = x.shape(2), n = (L + kChunk - 1) / kChunk;
  auto log_decay = mx::multiply(dt, mx::reshape(a, {1, -1, 1}));  // [B, H, L]
  auto cum = mx::cumsum(chunked(log_decay, n), -1);                 // padding: dt = 0
  auto xdt = chunked(mx::multiply(x, mx::expand_dims(dt, -1)), n);  // [B, H, n, C, P]
  auto bc = chunked(b, n), cc = chunked(c, n);
  auto scores = mx::multiply(emlx::matmul(cc, mx::swapaxes(bc, -1, -2)), pairwise_decay(cum));
  auto intra = emlx::matmul(scores, xdt);
  auto last = mx::slice(cum, {0, 0, 0, kChunk - 1}, cum.shape());
  auto c_decayed = mx::multiply(cc, mx::expand_dims(mx::exp(cum), -1));
  auto b_decayed = mx::multiply(bc, mx::expand_dims(mx::exp(mx::subtract(last, cum)), -1));
  auto chunk_decay = mx::expand_dims(mx::exp(last), -1);
  std::vector<mx::array> outs;
  for (int i = 0; i < n; ++i) {
    outs.push_back(mx::add(chunk(intra, i), emlx::matmul(chunk(c_decayed, i), s)));
    s = mx::add(mx::multiply(s, chunk(chunk_decay, i)), emlx::matmul(last_rows(chunk(b_decayed, i)), chunk(xdt, i)));
  }
  return rows(mx::concatenate(outs, 2), 0, L);
}

// a [B, D, L, N] -> [..., L, N] shifted `off` positions later along L, zeros first.
mx::array later(const mx::array& a, int off) {
  mx::Shape hi = a.shape();
  hi[3] -= off;
  return mx::pad(mx::slice(a, mx::Shape(a.ndim(), 0), hi), std::vector<int>{3}, mx::Shape{off}, mx::Shape{0},
                 mx::array(0, a.dtype()));
}

// Mamba-1's scan, chunked form (x, dt [B, D, L, 1], a [1, D, 1, N], b, c
// [B, 1, L, N]); s is [B, D, N, 1], updated. Each chunk's states from a zero
// start are an inclusive scan of h_j = exp(l_j) h_{j-1} + u_j, taken by
// doubling (log2 C steps over [B, D, n, C, N]); the state carried in adds
// exp(cumsum l) times it.
mx::array selective_chunks(const mx::array& x, const mx::array& dt, const mx::array& a, const mx::array& b,
                           const mx::array& c, mx::array& s) {
  const int L = x.shape(2), n = (L + kChunk - 1) / kChunk;
  auto cum = mx::cumsum(chunked(mx::multiply(dt, a), n), 3);  // [B, D, n, C, N]; padding: dt = 0
  auto u = chunked(mx::multiply(mx::multiply(dt, x), b), n);  // padding: no write
  for (int off = 1; off < kChunk; off *= 2) {
    u = mx::add(u, mx::multiply(mx::exp(mx::subtract(cum, later(cum, off))), later(u, off)));
  }
  auto cc = chunked(c, n);  // [B, 1, n, C, N]: broadcast over the channels
  auto intra = mx::sum(mx::multiply(u, cc), -1, true);  // [B, D, n, C, 1]
  auto c_decayed = mx::multiply(cc, mx::exp(cum));
  auto last = [](const mx::array& a) {  // [B, D, C, N] -> its last position as [B, D, N, 1]
    return mx::swapaxes(mx::slice(a, {0, 0, kChunk - 1, 0}, a.shape()), -1, -2);
  };
  std::vector<mx::array> outs;
  for (int i = 0; i < n; ++i) {
    outs.push_back(mx::add(chunk(intra, i), emlx::matmul(chunk(c_decayed, i), s)));
    s = mx::add(mx::multiply(s, mx::exp(last(chunk(cum, i)))), last(chunk(u, i)));
  }
  return rows(mx::concatenate(outs, 2), 0, L);
}

void check_rank(const mx::array& a, int rank, const char* what) {
  if (static_cast<int>(a.ndim()) != rank) throw std::invalid_argument(what);
}

mx::array f32(const mx::array& a) { return mx::astype(a, mx::float32); }

// What both scans share: the chunked form (`chunks(n, s)`: the outputs of
// positions 0 .. n-1, updating s) before the last `snapshots` positions, one
// step each for those (`step(t, s)`: the output of position t, updating s)
// so that their states can be kept, then the packed result.
template <class Chunks, class Step>
mx::array scan(const char* node, int L, const KeptStates& kept, mx::array s, Chunks chunks, Step step) {
  if (kept.snapshots < 0 || kept.snapshots > 1024) {
    throw std::invalid_argument(std::string(node) + ": snapshots out of range");
  }
  const auto initial = s;
  const int stepped = std::min(L, std::max(kept.snapshots, 1));
  std::vector<mx::array> outputs, states;
  if (L > stepped) outputs.push_back(chunks(L - stepped, s));
  for (int t = L - stepped; t < L; ++t) {
    outputs.push_back(step(t, s));
    states.push_back(s);
  }
  return pack(outputs, states, initial, kept);
}

// The gated delta rule's steps over a call's kept positions as one task (a
// decode step is only that), packed as GatedDeltaNode keeps them: inputs
// q, k [B, H, S, Dk], v [B, H, S, Dv], g [B, H, S] (or [B, H, S, Dk] per key
// channel), beta [B, H, S] and the state [B, H, Dk, Dv], float32; output
// [B, H, S + S * Dk, Dv]: the S outputs, then the state after each step.
// As MLX ops a step is a dozen small arrays a layer.
class DeltaSteps : public CpuKernel {
 public:
  DeltaSteps(mx::Stream s, bool per_channel) : CpuKernel(s), per_channel_(per_channel) {}

  const char* name() const override { return "EmlxDeltaSteps"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return per_channel_ == static_cast<const DeltaSteps&>(other).per_channel_;
  }

 private:
  CpuTask task() const override {
    return [per_channel = per_channel_](const std::vector<mx::array>& inputs, mx::array& out) {
      std::vector<uint8_t> packed[6];
      const float* in[6];
      for (int i = 0; i < 6; ++i) in[i] = row_major_data<float>(inputs[i], packed[i]);
      const float *q = in[0], *k = in[1], *v = in[2], *g = in[3], *beta = in[4], *initial = in[5];
      const int BH = inputs[0].shape(0) * inputs[0].shape(1), S = inputs[0].shape(2), Dk = inputs[0].shape(3);
      const int Dv = inputs[2].shape(3);
      float* result = out.data<float>();
      parallel_for(BH, [&](int bh) {
        std::vector<float> st(initial + static_cast<size_t>(bh) * Dk * Dv, initial + static_cast<size_t>(bh + 1) * Dk * Dv);
        std::vector<float> delta(Dv);
        float* r = result + static_cast<size_t>(bh) * S * (1 + Dk) * Dv;
        for (int t = 0; t < S; ++t) {
          const size_t at = static_cast<size_t>(bh) * S + t;
          const float *kt = k + at * Dk, *qt = q + at * Dk, *vt = v + at * Dv;
          for (int i = 0; i < Dk; ++i) {
            const float decay = std::exp(per_channel ? g[at * Dk + i] : g[at]);
            for (int j = 0; j < Dv; ++j) st[i * Dv + j] *= decay;
          }
          std::fill(delta.begin(), delta.end(), 0.0f);  // the memory k^T s, then the write
          for (int i = 0; i < Dk; ++i) {
            for (int j = 0; j < Dv; ++j) delta[j] += kt[i] * st[i * Dv + j];
          }
          for (int j = 0; j < Dv; ++j) delta[j] = (vt[j] - delta[j]) * beta[at];
          float* o = r + static_cast<size_t>(t) * Dv;
          std::fill(o, o + Dv, 0.0f);
          for (int i = 0; i < Dk; ++i) {
            for (int j = 0; j < Dv; ++j) {
              st[i * Dv + j] += kt[i] * delta[j];
              o[j] += qt[i] * st[i * Dv + j];
            }
          }
          std::copy(st.begin(), st.end(), r + (S + static_cast<size_t>(t) * Dk) * Dv);
        }
      });
    };
  }

  bool per_channel_;
};

}  // namespace

mx::array gated_delta(const mx::array& q_in, const mx::array& k_in, const mx::array& v_in, const mx::array& g_in,
                      const mx::array& beta_in, const mx::array& state, const KeptStates& kept) {
  check_rank(q_in, 4, "GatedDeltaNode: q must be [B, H, L, Dk]");
  check_rank(state, 4, "GatedDeltaNode: state must be [B, H, Dk, Dv]");
  const int B = q_in.shape(0), H = q_in.shape(1), L = q_in.shape(2), Dk = q_in.shape(3), Dv = v_in.shape(-1);
  const bool per_channel = g_in.ndim() == 4;  // a decay per key channel (KDA), else per head
  if (k_in.shape() != q_in.shape() || v_in.shape() != mx::Shape{B, H, L, Dv} || beta_in.shape() != mx::Shape{B, H, L} ||
      g_in.shape() != (per_channel ? mx::Shape{B, H, L, Dk} : mx::Shape{B, H, L}) ||
      state.shape() != mx::Shape{B, H, Dk, Dv}) {
    throw std::invalid_argument("GatedDeltaNode: inputs of inconsistent shapes");
  }
  auto q = f32(q_in), k = f32(k_in), v = f32(v_in), g = f32(g_in), beta = f32(beta_in);
  auto chunks = [&](int n, mx::array& s) {
    auto form = per_channel ? channel_delta_chunks : gated_delta_chunks;
    return form(rows(q, 0, n), rows(k, 0, n), rows(v, 0, n), rows(g, 0, n), rows(beta, 0, n), s);
  };
  auto step = [&](int t, mx::array& s) {
    auto kt = rows(k, t, t + 1);  // [B, H, 1, Dk]
    auto gt = mx::exp(rows(g, t, t + 1));  // [B, H, 1] or [B, H, 1, Dk]
    s = mx::multiply(s, per_channel ? mx::swapaxes(gt, -1, -2) : mx::expand_dims(gt, -1));
    auto memory = emlx::matmul(kt, s);  // [B, H, 1, Dv]
    auto delta = mx::multiply(mx::subtract(rows(v, t, t + 1), memory), mx::expand_dims(rows(beta, t, t + 1), -1));
    s = mx::add(s, emlx::matmul(mx::swapaxes(kt, -1, -2), delta));
    return emlx::matmul(rows(q, t, t + 1), s);
  };
  if (!kept.call_states_only || kept.snapshots < 1 || kept.snapshots > 1024) {
    return scan("GatedDeltaNode", L, kept, f32(state), chunks, step);
  }
  // the kept positions' steps as one task (the same packing as scan's)
  const int stepped = std::min(L, kept.snapshots);
  auto s = f32(state);
  std::vector<mx::array> parts;
  if (L > stepped) parts.push_back(chunks(L - stepped, s));
  auto as_ops = [&](const std::vector<mx::array>&, mx::Stream) {
    std::vector<mx::array> outputs, states;
    for (int t = L - stepped; t < L; ++t) {
      outputs.push_back(step(t, s));
      states.push_back(s);
    }
    outputs.insert(outputs.end(), states.begin(), states.end());
    return mx::concatenate(outputs, 2);
  };
  auto last = [&](const mx::array& a) { return rows(a, L - stepped, L); };
  parts.push_back(CpuKernel::build({}, true, {last(q), last(k), last(v), last(g), last(beta), s},
                                   {B, H, stepped * (1 + Dk), Dv}, mx::float32, as_ops,
                                   [&](mx::Stream st) { return std::make_shared<DeltaSteps>(st, per_channel); }));
  return parts.size() == 1 ? parts[0] : mx::concatenate(parts, 2);
}

mx::array ssd_scan(const mx::array& x_in, const mx::array& dt_in, const mx::array& a_in, const mx::array& b_in,
                   const mx::array& c_in, const mx::array& state, const KeptStates& kept) {
  check_rank(x_in, 4, "SsdScanNode: x must be [B, H, L, P]");
  check_rank(state, 4, "SsdScanNode: state must be [B, H, P, N]");
  const int B = x_in.shape(0), H = x_in.shape(1), L = x_in.shape(2), P = x_in.shape(3), N = b_in.shape(-1);
  if (dt_in.shape() != mx::Shape{B, H, L} || a_in.shape() != mx::Shape{H} || b_in.shape() != mx::Shape{B, H, L, N} ||
      c_in.shape() != b_in.shape() || state.shape() != mx::Shape{B, H, P, N}) {
    throw std::invalid_argument("SsdScanNode: inputs of inconsistent shapes");
  }
  auto x = f32(x_in), dt = f32(dt_in), a = f32(a_in), b = f32(b_in), c = f32(c_in);
  auto chunks = [&](int n, mx::array& s) {
    return ssd_chunks(rows(x, 0, n), rows(dt, 0, n), a, rows(b, 0, n), rows(c, 0, n), s);
  };
  auto rate = mx::reshape(a, {1, -1, 1, 1});
  auto step = [&](int t, mx::array& s) {
    auto dtt = mx::expand_dims(rows(dt, t, t + 1), -1);  // [B, H, 1, 1]
    auto write = emlx::matmul(mx::swapaxes(rows(b, t, t + 1), -1, -2), mx::multiply(rows(x, t, t + 1), dtt));
    s = mx::add(mx::multiply(s, mx::exp(mx::multiply(dtt, rate))), write);
    return emlx::matmul(rows(c, t, t + 1), s);
  };
  return scan("SsdScanNode", L, kept, mx::swapaxes(f32(state), -1, -2), chunks, step);  // s: [B, H, N, P]
}

mx::array selective_scan(const mx::array& x_in, const mx::array& dt_in, const mx::array& a_in, const mx::array& b_in,
                         const mx::array& c_in, const mx::array& state, const KeptStates& kept) {
  check_rank(x_in, 3, "SelectiveScanNode: x must be [B, D, L]");
  check_rank(a_in, 2, "SelectiveScanNode: a must be [D, N]");
  const int B = x_in.shape(0), D = x_in.shape(1), L = x_in.shape(2), N = a_in.shape(1);
  if (dt_in.shape() != x_in.shape() || a_in.shape(0) != D || b_in.shape() != mx::Shape{B, L, N} ||
      c_in.shape() != b_in.shape() || state.shape() != mx::Shape{B, D, N}) {
    throw std::invalid_argument("SelectiveScanNode: inputs of inconsistent shapes");
  }
  // as the other scans' [B, H, L, R] rows: x, dt [B, D, L, 1], b, c [B, 1, L, N], states [B, D, N, 1]
  auto x = mx::expand_dims(f32(x_in), -1), dt = mx::expand_dims(f32(dt_in), -1);
  auto a = mx::reshape(f32(a_in), {1, D, 1, N});
  auto b = mx::expand_dims(f32(b_in), 1), c = mx::expand_dims(f32(c_in), 1);
  auto chunks = [&](int n, mx::array& s) {
    return selective_chunks(rows(x, 0, n), rows(dt, 0, n), a, rows(b, 0, n), rows(c, 0, n), s);
  };
  auto rate = mx::swapaxes(a, -1, -2);  // [1, D, N, 1]
  auto step = [&](int t, mx::array& s) {
    auto dtt = rows(dt, t, t + 1);  // [B, D, 1, 1]
    auto write = mx::multiply(mx::multiply(dtt, rows(x, t, t + 1)), mx::swapaxes(rows(b, t, t + 1), -1, -2));
    s = mx::add(mx::multiply(s, mx::exp(mx::multiply(dtt, rate))), write);
    return emlx::matmul(rows(c, t, t + 1), s);  // [B, D, 1, 1]
  };
  auto packed = scan("SelectiveScanNode", L, kept, mx::expand_dims(f32(state), -1), chunks, step);
  return mx::reshape(packed, {B, D, -1});
}

}  // namespace emlx
