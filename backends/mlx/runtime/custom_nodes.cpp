// Nodes executed by hand-written code (`(custom)` in schema.fbs).
#include <mlx/mlx.h>
#include <mlx/random.h>

#include "interpreter.h"

namespace emlx {

namespace mx = mlx::core;

namespace {

mx::array u64(uint64_t v) { return mx::array(v); }

// SplitMix64's finalizer on uint64 arrays, evaluated on the device. Used to
// fold the decode position into the seed, so that (seed, position) pairs map
// to well-separated 64-bit key seeds.
mx::array mix64(mx::array z) {
  z = mx::add(z, u64(0x9E3779B97F4A7C15ull));
  z = mx::multiply(mx::bitwise_xor(z, mx::right_shift(z, u64(30))), u64(0xBF58476D1CE4E5B9ull));
  z = mx::multiply(mx::bitwise_xor(z, mx::right_shift(z, u64(27))), u64(0x94D049BB133111EBull));
  return mx::bitwise_xor(z, mx::right_shift(z, u64(31)));
}

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
  const int width = n->width();
  if (width != 1 && width != 2 && width != 4) {
    throw std::invalid_argument("RandomBitsNode: width must be 1, 2 or 4 bytes");
  }
  auto seed = st.get_optional(n->seed());
  if (!seed) {
    // Unseeded: MLX's global key sequence.
    st.set(n->out(), mx::random::bits(shape, width));
    return;
  }
  if (shape.empty()) throw std::invalid_argument("RandomBitsNode: seeded bits need a [rows, ...] shape");
  const int rows = shape[0];
  mx::Shape row_shape(shape.begin() + 1, shape.end());
  auto position = st.get_optional(n->position()).value_or(mx::array(int64_t{0}));
  auto s = mx::broadcast_to(mx::astype(mx::flatten(*seed), mx::uint64), {rows});
  auto p = mx::broadcast_to(mx::astype(mx::flatten(position), mx::uint64), {rows});
  auto keys = keys_for(mix64(mx::bitwise_xor(s, mix64(p))));
  // random::bits takes one key of shape (2): one call per row, so a row's
  // bits depend on its own key only, whatever the batch.
  std::vector<mx::array> out;
  out.reserve(rows);
  for (int r = 0; r < rows; ++r) {
    out.push_back(mx::random::bits(row_shape, width, mx::take(keys, r, 0)));
  }
  st.set(n->out(), mx::stack(out, 0));
}

void exec_TakeNode(Interpreter& st, const ir::TakeNode* n) {
  const auto& a = st.get(n->a());
  int axis = n->axis();
  if (axis < 0) axis += a.ndim();
  if (axis < 0 || axis >= static_cast<int>(a.ndim())) {
    throw std::invalid_argument("TakeNode: axis " + std::to_string(n->axis()) + " out of range");
  }
  const int size = a.shape(axis);
  if (size == 0) throw std::invalid_argument("TakeNode: take from an empty axis");
  const auto& indices = st.get(n->indices());
  if (!mx::issubdtype(indices.dtype(), mx::integer)) throw std::invalid_argument("TakeNode: indices must be integers");
  // MLX wraps negative indices and reads out of range ones unchecked.
  auto safe = mx::clip(indices, mx::array(-size, indices.dtype()), mx::array(size - 1, indices.dtype()));
  st.set(n->out(), mx::take(a, safe, axis));
}

}  // namespace emlx
