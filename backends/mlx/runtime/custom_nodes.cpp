// Nodes executed by hand-written code (`(custom)` in schema.fbs).
#include <mlx/mlx.h>
#include <mlx/fast.h>
#include <mlx/random.h>
#include <mlx/transforms.h>

#include <algorithm>

#include "dtype.h"
#include "interpreter.h"
#include "kernels/accepted_prefix.h"
#include "kernels/activation.h"
#include "kernels/attention.h"
#include "kernels/cache_write.h"
#include "kernels/cpu_arrays.h"
#include "kernels/gather_linear.h"
#include "kernels/heads.h"
#include "kernels/linear.h"
#include "kernels/matmul.h"
#include "kernels/norm.h"
#include "kernels/packed_floats.h"
#include "kernels/quantized_rows.h"
#include "kernels/rope.h"
#include "kernels/sampler.h"
#include "kernels/state_scan.h"
#include "kernels/largest.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

mx::array u64(uint64_t v) { return mx::array(v); }

// random::key(s) for every s of a uint64 array of shape [rows], built on the
// device (no read-back): key(s) == [s >> 32, s & 0xffffffff] as uint32.
mx::array keys_for(const mx::array& seeds) {
  auto hi = mx::astype(mx::right_shift(seeds, u64(32)), mx::uint32);
  auto lo = mx::astype(seeds, mx::uint32);  // keeps the low 32 bits
  return mx::stack({hi, lo}, -1);
}

}  // namespace

// RandomBitsNode: MLX's counter-based RNG (threefry), seeded per row.
void exec_RandomBitsNode(Interpreter& st, const ir::RandomBitsNode* n) {
  auto shape = st.resolve_shape(n->shape());
  const int width = n->width();  // 1, 2 or 4: checked by the schema
  if (std::find(shape.begin(), shape.end(), 0) != shape.end()) {  // nothing to draw (MLX divides by the size)
    st.set(n->out(), mx::zeros(shape, width == 4 ? mx::uint32 : width == 2 ? mx::uint16 : mx::uint8));
    return;
  }
  auto seed = st.get_optional(n->seed());
  if (!seed) {
    // Unseeded: MLX's global key sequence.
    st.set(n->out(), mx::random::bits(shape, width));
    return;
  }
  if (shape.empty()) throw std::invalid_argument("RandomBitsNode: seeded bits need a [rows, ...] shape");
  const int rows = shape[0];
  auto position = st.get_optional(n->position()).value_or(mx::array(int64_t{0}));
  auto s = mx::broadcast_to(mx::astype(mx::flatten(*seed), mx::uint64), {rows});
  auto p = mx::broadcast_to(mx::astype(mx::flatten(position), mx::uint64), {rows});
  // SplitMix64 folds the position into the seed: well-separated key seeds
  auto keys = keys_for(mix64(mx::bitwise_xor(s, mix64(p, u64)), u64));
  // random::bits takes one key; vmapped over keys [rows, 2] it is one
  // RandomBits node that gives row r exactly random::bits(row shape, width,
  // key r): a row's bits depend on its own key only, whatever the batch.
  mx::Shape row_shape(shape.begin() + 1, shape.end());
  auto per_key = mx::vmap(
      [&](const std::vector<mx::array>& key) { return std::vector<mx::array>{mx::random::bits(row_shape, width, key[0])}; },
      {0}, {0});
  st.set(n->out(), per_key({keys})[0]);
}

namespace {
// Integer indices into an axis of `size`, clamped into [-size, size - 1]:
// MLX's take and scatter wrap negative indices but read and write out of
// range ones unchecked.
void check_indices(const mx::array& indices, int size, const char* node) {
  if (size == 0) throw std::invalid_argument(std::string(node) + ": indexing an empty axis");
  if (!mx::issubdtype(indices.dtype(), mx::integer)) {
    throw std::invalid_argument(std::string(node) + ": indices must be integers");
  }
}

mx::array in_range(const mx::array& indices, int size, const char* node) {
  check_indices(indices, size, node);
  return mx::clip(indices, mx::array(-size, indices.dtype()), mx::array(size - 1, indices.dtype()));
}

int64_t floor_div(int64_t a, int64_t b) {
  if (b == 0) throw std::invalid_argument("SymIntNode: division by zero");
  int64_t q = a / b;
  return (a % b != 0 && ((a < 0) != (b < 0))) ? q - 1 : q;
}

// The entries of 0-d or 1-d `indices` already on the host (a literal, an
// input, a size), at least one, as rows of an axis of `size`: clamped into
// [-size, size - 1], counted from the end when negative; nullopt otherwise.
std::optional<std::vector<int64_t>> host_rows(const mx::array& indices, int64_t size) {
  constexpr size_t kMost = 4096;
  if (indices.ndim() > 1 || indices.size() == 0 || indices.size() > kMost || !indices.is_available()) {
    return std::nullopt;
  }
  std::vector<int64_t> rows;
  for (size_t i = 0; i < indices.size(); ++i) {
    rows.push_back(wrapped_row(integer_at(indices, indices.ndim() ? i * indices.strides()[0] : 0), size));
  }
  return rows;
}
}  // namespace

void exec_TakeNode(Interpreter& st, const ir::TakeNode* n) {
  if (const auto* p = st.packed(n->a())) {  // (a tied embedding table; axis 0: Program::float32_matrices_to_pack)
    const int rows = p->rows.shape(0);
    st.set(n->out(), packed_rows(*p, in_range(st.get(n->indices()), rows, "TakeNode")));
    return;
  }
  const auto& a = st.get(n->a());
  const auto& indices = st.get(n->indices());
  const int axis = n->axis() < 0 ? n->axis() + static_cast<int>(a.ndim()) : n->axis();  // checked by the schema
  check_indices(indices, a.shape(axis), "TakeNode");
  // Consecutive rows known on the host (the row of the last position a
  // prefill keeps, a decode step's one row of logits) are a slice: a view,
  // where MLX's take copies element by element (32000 logits took ~30 us at
  // the end of each decode step, nothing else running beside it).
  if (auto rows = host_rows(indices, a.shape(axis))) {
    bool consecutive = true;
    for (size_t i = 1; i < rows->size(); ++i) consecutive &= (*rows)[i] == (*rows)[0] + static_cast<int64_t>(i);
    if (consecutive) {
      mx::Shape start(a.ndim(), 0), stop = a.shape();
      start[axis] = static_cast<int>(rows->front()), stop[axis] = static_cast<int>(rows->back() + 1);
      const auto picked = mx::slice(a, start, stop);
      st.set(n->out(), indices.ndim() == 0 ? mx::squeeze(picked, axis) : picked);
      return;
    }
  }
  st.set(n->out(), mx::take(a, in_range(indices, a.shape(axis), "TakeNode"), axis));
}

void exec_CumsumNode(Interpreter& st, const ir::CumsumNode* n) {
  st.set(n->out(), mx::cumsum(st.get(n->a()), n->axis(), n->reverse(), n->inclusive()));
}

void exec_SymIntNode(Interpreter& st, const ir::SymIntNode* n) {
  auto* code = n->code();
  if (code->size() % 2 != 0 || code->size() > 256) throw std::invalid_argument("SymIntNode: malformed code");
  std::vector<int64_t> stack;
  for (uint32_t i = 0; i < code->size(); i += 2) {
    const int64_t arg = code->Get(i + 1);
    const auto op = static_cast<ir::SymIntOp>(code->Get(i));
    if (op == ir::SymIntOp::push) {
      stack.push_back(arg);
      continue;
    }
    if (op == ir::SymIntOp::symbol) {
      stack.push_back(st.symbol(arg));
      continue;
    }
    if (stack.size() < 2) throw std::invalid_argument("SymIntNode: stack underflow");
    const int64_t b = stack.back();
    stack.pop_back();
    int64_t& a = stack.back();
    bool overflow = false;
    switch (op) {
      case ir::SymIntOp::add: overflow = __builtin_add_overflow(a, b, &a); break;
      case ir::SymIntOp::mul: overflow = __builtin_mul_overflow(a, b, &a); break;
      case ir::SymIntOp::floor_div: a = floor_div(a, b); break;
      case ir::SymIntOp::mod: a = a - floor_div(a, b) * b; break;
      case ir::SymIntOp::max: a = std::max(a, b); break;
      case ir::SymIntOp::min: a = std::min(a, b); break;
      default: throw std::invalid_argument("SymIntNode: unknown opcode " + std::to_string(code->Get(i)));
    }
    if (overflow) throw std::invalid_argument("SymIntNode: integer overflow");
  }
  if (stack.size() != 1) throw std::invalid_argument("SymIntNode: malformed code");
  st.set(n->out(), mx::array(stack.back()));  // host data: available without evaluation
}

void exec_DynArangeNode(Interpreter& st, const ir::DynArangeNode* n) {
  auto* r = n->range();
  if (r->size() != 3) throw std::invalid_argument("DynArangeNode: range needs start, stop, step");
  const int64_t start = st.resolve_int(r->Get(0)), stop = st.resolve_int(r->Get(1)), step = st.resolve_int(r->Get(2));
  if (step == 0) throw std::invalid_argument("DynArangeNode: step is 0");
  const int64_t count = std::max<int64_t>(0, step > 0 ? (stop - start + step - 1) / step : (start - stop - step - 1) / -step);
  checked_dim(count);
  st.set(n->out(), mx::arange(static_cast<double>(start), static_cast<double>(stop), static_cast<double>(step),
                              to_mlx_dtype(n->dtype())));
}

void exec_DynSliceNode(Interpreter& st, const ir::DynSliceNode* n) {
  const auto& a = st.get(n->a());
  auto* starts = n->start();
  auto* stops = n->stop();
  auto* strides = n->strides();
  if (starts->size() != a.ndim() || stops->size() != a.ndim() || strides->size() != a.ndim()) {
    throw std::invalid_argument("DynSliceNode: start/stop/strides need one entry per axis");
  }
  mx::Shape lo, hi, step;
  for (uint32_t i = 0; i < a.ndim(); ++i) {
    const int64_t size = a.shape(i), s = strides->Get(i);
    if (s <= 0) throw std::invalid_argument("DynSliceNode: strides must be positive");
    // Python slice semantics for positive strides: negatives count from the
    // end, then clamp into [0, size].
    auto norm = [size](int64_t v) { return std::clamp<int64_t>(v < 0 ? v + size : v, 0, size); };
    const int64_t b = norm(st.resolve_int(starts->Get(i)));
    const int64_t e = std::max(b, norm(st.resolve_int(stops->Get(i))));
    lo.push_back(static_cast<int>(b));
    hi.push_back(static_cast<int>(e));
    step.push_back(static_cast<int>(s));
  }
  st.set(n->out(), mx::slice(a, lo, hi, step));
}

void exec_ScatterNode(Interpreter& st, const ir::ScatterNode* n) {
  const auto& a = st.get(n->a());
  auto axes = to_ints(n->axes());
  auto indices = st.get_list(n->indices());
  if (indices.size() != axes.size() || indices.empty()) {
    throw std::invalid_argument("ScatterNode: one index array per axis");
  }
  for (size_t i = 0; i < axes.size(); ++i) {  // axes checked by the schema
    if (axes[i] < 0) axes[i] += static_cast<int>(a.ndim());
    indices[i] = in_range(indices[i], a.shape(axes[i]), "ScatterNode");
  }
  // MLX checks only that the update slice is no larger than `a`: one longer
  // than 1 along an axis written at the last index would write past `a`.
  const auto& updates = st.get(n->updates());
  const auto& ishape = indices[0].shape();
  bool fits = updates.ndim() == ishape.size() + a.ndim();
  for (const auto& idx : indices) fits &= idx.shape() == ishape;
  for (size_t d = 0; fits && d < updates.ndim(); ++d) {
    const int i = static_cast<int>(d) - static_cast<int>(ishape.size());
    const bool on_axis = i >= 0 && std::find(axes.begin(), axes.end(), i) != axes.end();
    fits = i < 0 ? updates.shape(d) == ishape[d] : on_axis ? updates.shape(d) == 1 : updates.shape(d) <= a.shape(i);
  }
  if (!fits) {
    throw std::invalid_argument("ScatterNode: updates must be [*indices shape, *slice of a], the slice 1 along axes");
  }
  if (updates.size() == 0) {  // nothing to write (MLX's kernel divides by the update count)
    st.set(n->out(), a);
    return;
  }
  st.set(n->out(), mx::scatter(a, indices, mx::astype(updates, a.dtype()), axes));
}

void exec_ScaledDotProductAttentionNode(Interpreter& st, const ir::ScaledDotProductAttentionNode* n) {
  const auto &q = st.get(n->q()), &k = st.get(n->k()), &v = st.get(n->v());
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4) {
    throw std::invalid_argument("ScaledDotProductAttentionNode: q, k, v must be [B, H, L, D]");
  }
  if (k.shape(1) == 0 || q.shape(1) % k.shape(1) != 0 || k.shape(1) != v.shape(1)) {
    throw std::invalid_argument("ScaledDotProductAttentionNode: query heads must be a multiple of key/value heads");
  }
  AttentionOptions o{n->scale(), n->causal(), st.get_optional(n->mask()), st.get_optional(n->keys()), n->merge_heads()};
  if (o.mask && o.causal) throw std::invalid_argument("ScaledDotProductAttentionNode: mask and causal together");
  if (o.keys && o.causal) throw std::invalid_argument("ScaledDotProductAttentionNode: keys and causal together");
  st.set(n->out(), attention(q, k, v, o));
}

void exec_RmsNormNode(Interpreter& st, const ir::RmsNormNode* n) {
  const auto& a = st.get(n->a());
  if (a.ndim() == 0) throw std::invalid_argument("RmsNormNode: input must have an axis");
  auto weight = st.get_optional(n->weight());
  if (weight && (weight->ndim() != 1 || weight->shape(0) != a.shape(-1))) {
    throw std::invalid_argument("RmsNormNode: weight must be [last dim]");
  }
  st.set(n->out(), rms_norm(a, weight, n->eps()));
}

void exec_LayerNormNode(Interpreter& st, const ir::LayerNormNode* n) {
  const auto& a = st.get(n->a());
  if (a.ndim() == 0) throw std::invalid_argument("LayerNormNode: input must have an axis");
  auto weight = st.get_optional(n->weight()), bias = st.get_optional(n->bias());
  for (const auto* p : {&weight, &bias}) {
    if (*p && ((*p)->ndim() != 1 || (*p)->shape(0) != a.shape(-1))) {
      throw std::invalid_argument("LayerNormNode: weight and bias must be [last dim]");
    }
  }
  st.set(n->out(), mx::fast::layer_norm(a, weight, bias, n->eps()));
}

void exec_SiluNode(Interpreter& st, const ir::SiluNode* n) {
  const auto& a = st.get(n->a());
  auto b = st.get_optional(n->b());
  if (b && b->shape() != a.shape()) throw std::invalid_argument("SiluNode: b must have a's shape");
  if (n->halves()) {
    if (b) throw std::invalid_argument("SiluNode: halves takes no b");
    st.set(n->out(), silu_halves(a));
    return;
  }
  st.set(n->out(), silu(a, b ? std::optional<mx::array>(*b) : std::nullopt));
}

void exec_RopeNode(Interpreter& st, const ir::RopeNode* n) {
  st.set(n->out(), rope(st.get(n->x()), st.get(n->cos()), st.get(n->sin())));
}

void exec_HeadsNode(Interpreter& st, const ir::HeadsNode* n) {
  const HeadsOptions o{st.get_optional(n->norm()), n->eps(), st.get_optional(n->cos()), st.get_optional(n->sin())};
  const HeadColumns columns{n->start(), n->heads(), n->head_dim()};
  if (n->cache() == nullptr && n->slots() == nullptr) {
    st.set(n->out(), heads(st.get(n->x()), columns, o));
  } else if (n->cache() == nullptr || n->slots() == nullptr) {
    throw std::invalid_argument("HeadsNode: cache and slots go together");
  } else {
    st.set(n->out(), heads_into_cache(st.get(n->x()), columns, o, {st.get(n->cache()), st.get(n->slots())}));
  }
}

void exec_CacheWriteNode(Interpreter& st, const ir::CacheWriteNode* n) {
  st.set(n->out(), cache_write(st.get(n->cache()), st.get(n->slots()), st.get(n->update())));
}

void exec_AcceptedPrefixNode(Interpreter& st, const ir::AcceptedPrefixNode* n) {
  st.set(n->out(), accepted_prefix(st.get(n->sampled()), st.get(n->fed())));
}

void exec_MatmulNode(Interpreter& st, const ir::MatmulNode* n) {
  st.set(n->out(), emlx::matmul(st.get(n->a()), st.get(n->b())));
}

namespace {
// A linear node's terms besides the product (LinearNode, QuantizedLinearNode).
template <typename Node>
LinearTerms linear_terms(Interpreter& st, const Node* n) {
  std::optional<RowNorm> norm;
  if (n->norm()) norm = RowNorm{st.get(n->norm()), n->norm_eps()};
  return {norm, st.get_optional(n->bias()), st.get_optional(n->residual())};
}
}  // namespace

void exec_LinearNode(Interpreter& st, const ir::LinearNode* n) {
  if (const auto* p = st.packed(n->weight())) {  // (Program::float32_matrices_to_pack)
    st.set(n->out(), packed_float_linear(st.get(n->x()), *p, linear_terms(st, n)));
    return;
  }
  st.set(n->out(), linear(st.get(n->x()), st.get(n->weight()), linear_terms(st, n)));
}

namespace {
// A quantized node's table (QuantizedLinearNode, QuantizedEmbeddingNode, GatherQuantizedLinearNode).
template <typename Node>
QuantizedMatrix quantized_matrix(Interpreter& st, const Node* n) {
  const char* mode = nullptr;
  switch (n->mode()) {
    case ir::QuantMode::affine: mode = "affine"; break;
    case ir::QuantMode::mxfp4: mode = "mxfp4"; break;
  }
  if (!mode) throw std::invalid_argument("quantized node: unknown mode " + std::to_string(static_cast<int>(n->mode())));
  return {st.get(n->weight()), st.get(n->scales()), st.get_optional(n->biases()), n->group_size(), n->bits(), mode};
}

template <typename Node>
Activations activations(const Node* n) {
  return n->float_activations() ? Activations::Float : Activations::Int8;
}
}  // namespace

void exec_QuantizedLinearNode(Interpreter& st, const ir::QuantizedLinearNode* n) {
  auto q = quantized_matrix(st, n);
  q.tiled = st.tiled(n->weight());  // (with its scales and biases: Program::tile_quantized_weights)
  st.set(n->out(), quantized_linear(st.get(n->x()), std::move(q), linear_terms(st, n), activations(n)));
}

void exec_QuantizedEmbeddingNode(Interpreter& st, const ir::QuantizedEmbeddingNode* n) {
  auto q = quantized_matrix(st, n);
  q.tiled = st.tiled(n->weight());  // a tied output layer's (Program::tile_quantized_weights)
  const int K = q.w.ndim() == 2 ? static_cast<int>(static_cast<int64_t>(q.w.shape(1)) * 32 / std::max(q.bits, 1)) : 0;
  check_quantization("QuantizedEmbeddingNode", q, K);
  const auto& ids = st.get(n->indices());
  check_indices(ids, q.w.shape(0), "QuantizedEmbeddingNode");
  st.set(n->out(), quantized_rows(q, ids, to_mlx_dtype(n->dtype())));
}

namespace {
// Indices clamped into [0, size - 1], as uint32 (what MLX's gather kernels take).
mx::array in_bounds(const mx::array& indices, int size, const char* node) {
  check_indices(indices, size, node);
  return clamped_indices(indices, size);
}

// x [T, K] (a row shared by its experts) or [T, k, K] against indices [T, k].
void check_expert_rows(const mx::array& x, const mx::array& indices, int K, const char* node) {
  const bool shared = x.ndim() == 2;
  if (indices.ndim() != 2 || (x.ndim() != 2 && x.ndim() != 3) || x.shape(0) != indices.shape(0) ||
      (!shared && x.shape(1) != indices.shape(1)) || x.shape(-1) != K) {
    throw std::invalid_argument(std::string(node) + ": x [T, K] or [T, k, K] and indices [T, k] expected");
  }
}

// An experts layer's combining weights: none, or [T, k] as its indices.
std::optional<mx::array> combining_weights(const std::optional<mx::array>& weights, const mx::array& indices,
                                           const char* node) {
  if (weights && weights->shape() != indices.shape()) {
    throw std::invalid_argument(std::string(node) + ": weights must be [T, k], as the indices");
  }
  return weights;
}

// The bias of an experts layer: none, or [E, N] in the weights' dtype.
std::optional<mx::array> expert_bias(const std::optional<mx::array>& bias, int E, int N, mx::Dtype dtype,
                                     const char* node) {
  if (!bias) return std::nullopt;
  if (bias->shape() != mx::Shape{E, N}) throw std::invalid_argument(std::string(node) + ": bias must be [E, N]");
  return mx::astype(*bias, dtype);
}
}  // namespace

void exec_RemainderNode(Interpreter& st, const ir::RemainderNode* n) {
  const auto &a = st.get(n->a()), &b = st.get(n->b());
  if (mx::issubdtype(mx::promote_types(a.dtype(), b.dtype()), mx::integer)) {
    auto zero = mx::equal(b, mx::array(0, b.dtype()));
    st.set(n->out(), mx::remainder(a, mx::where(zero, mx::array(1, b.dtype()), b)));
    return;
  }
  st.set(n->out(), mx::remainder(a, b));
}

void exec_ArgTopKNode(Interpreter& st, const ir::ArgTopKNode* n) {
  const auto& a = st.get(n->a());
  const int axis = n->axis() < 0 ? n->axis() + static_cast<int>(a.ndim()) : n->axis();  // checked by the schema
  if (n->k() < 1 || n->k() > a.shape(axis)) throw std::invalid_argument("ArgTopKNode: k out of range");
  if (axis == static_cast<int>(a.ndim()) - 1) return st.set(n->out(), largest_indices(a, n->k()));
  // a stable sort of the negated values: largest first, ties in index order
  auto order = mx::argsort(mx::negative(a), axis);
  auto stop = a.shape();
  stop[axis] = n->k();
  st.set(n->out(), mx::astype(mx::slice(order, mx::Shape(a.ndim(), 0), stop), mx::int32));
}

void exec_TakeAlongAxisNode(Interpreter& st, const ir::TakeAlongAxisNode* n) {
  const auto& a = st.get(n->a());
  const int axis = n->axis() < 0 ? n->axis() + static_cast<int>(a.ndim()) : n->axis();  // checked by the schema
  const auto& indices = st.get(n->indices());
  if (indices.ndim() != a.ndim()) throw std::invalid_argument("TakeAlongAxisNode: indices must have a's rank");
  st.set(n->out(), mx::take_along_axis(a, in_bounds(indices, a.shape(axis), "TakeAlongAxisNode"), axis));
}

void exec_GatherLinearNode(Interpreter& st, const ir::GatherLinearNode* n) {
  const auto& w = st.get(n->weight());
  if (w.ndim() != 3) throw std::invalid_argument("GatherLinearNode: weight must be [E, N, K]");
  const auto& indices = st.get(n->indices());
  const auto& x = st.get(n->x());
  check_expert_rows(x, indices, w.shape(2), "GatherLinearNode");
  if (w.shape(0) == 0) throw std::invalid_argument("GatherLinearNode: no experts");
  const ExpertsOptions o{expert_bias(st.get_optional(n->bias()), w.shape(0), w.shape(1), w.dtype(), "GatherLinearNode"),
                         combining_weights(st.get_optional(n->weights()), indices, "GatherLinearNode")};
  st.set(n->out(), gather_linear(mx::astype(x, w.dtype()), indices, w, o));
}

void exec_GatherQuantizedLinearNode(Interpreter& st, const ir::GatherQuantizedLinearNode* n) {
  auto q = quantized_matrix(st, n);
  q.tiled = st.tiled(n->weight());  // each expert's matrix (Program::tile_quantized_weights)
  const char* node = "GatherQuantizedLinearNode";
  if (q.w.ndim() != 3 || q.scales.ndim() != 3 || (q.biases && q.biases->ndim() != 3)) {
    throw std::invalid_argument(std::string(node) + ": weight, scales and biases must be [E, N, ...]");
  }
  const int E = q.w.shape(0), N = q.w.shape(1);
  const int K = static_cast<int>(static_cast<int64_t>(q.w.shape(2)) * 32 / std::max(q.bits, 1));
  if (q.scales.shape(0) != E || (q.biases && q.biases->shape(0) != E)) {
    throw std::invalid_argument(std::string(node) + ": scales and biases must have one row block per expert");
  }
  // the per-expert layout is QuantizedLinearNode's: check it as one [E * N, ...] table
  auto flat = [E, N](const mx::array& a) { return mx::reshape(a, {E * N, a.shape(2)}); };
  check_quantization(node, {flat(q.w), flat(q.scales), q.biases ? std::optional(flat(*q.biases)) : std::nullopt,
                            q.group_size, q.bits, q.mode}, K);
  const auto& indices = st.get(n->indices());
  const auto& x = st.get(n->x());
  check_expert_rows(x, indices, K, node);
  if (E == 0) throw std::invalid_argument(std::string(node) + ": no experts");
  const ExpertsOptions o{expert_bias(st.get_optional(n->bias()), E, N, x.dtype(), node),
                         combining_weights(st.get_optional(n->weights()), indices, node)};
  st.set(n->out(), gather_quantized_linear(x, indices, q, activations(n), o));
}

void exec_SampleNode(Interpreter& st, const ir::SampleNode* n) { st.set(n->out(), sample(read_sample_inputs(st, n))); }

void exec_GatedDeltaNode(Interpreter& st, const ir::GatedDeltaNode* n) {
  st.set(n->out(), gated_delta(st.get(n->q()), st.get(n->k()), st.get(n->v()), st.get(n->g()), st.get(n->beta()),
                               st.get(n->state()), {n->snapshots(), n->call_states_only()}));
}

void exec_SsdScanNode(Interpreter& st, const ir::SsdScanNode* n) {
  st.set(n->out(), ssd_scan(st.get(n->x()), st.get(n->dt()), st.get(n->a()), st.get(n->b()), st.get(n->c()),
                            st.get(n->state()), {n->snapshots(), n->call_states_only()}));
}

void exec_SelectiveScanNode(Interpreter& st, const ir::SelectiveScanNode* n) {
  st.set(n->out(), selective_scan(st.get(n->x()), st.get(n->dt()), st.get(n->a()), st.get(n->b()), st.get(n->c()),
                                  st.get(n->state()), {n->snapshots(), n->call_states_only()}));
}

}  // namespace emlx
