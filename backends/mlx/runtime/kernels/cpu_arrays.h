// Small helpers our CPU kernels share for reading MLX arrays.
#pragma once

#include <mlx/mlx.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace emlx {

// The float types our CPU kernels compute in (others go to MLX's own ops).
inline bool float32_or_bfloat16(mlx::core::Dtype d) { return d == mlx::core::float32 || d == mlx::core::bfloat16; }

inline float bf16_to_f32(uint16_t h) {
  uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rounds to nearest even, as MLX does; NaN stays NaN.
inline uint16_t f32_to_bf16(float f) {
  if (f != f) return 0x7fc0;
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

// n bfloat16 values as float32.
inline std::vector<float> bf16_rows_to_f32(const uint16_t* h, size_t n) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = bf16_to_f32(h[i]);
  return v;
}

// Element i of a float32 or (bf16) bfloat16 array.
inline float float_at(const void* p, size_t i, bool bf16) {
  return bf16 ? bf16_to_f32(static_cast<const uint16_t*>(p)[i]) : static_cast<const float*>(p)[i];
}

// Element i (in memory order, from its data pointer) of an integer or bool
// array, as int64 (uint64 beyond int64's range reads as its largest value).
inline int64_t integer_at(const mlx::core::array& a, int64_t i) {
  namespace mx = mlx::core;
  switch (a.dtype()) {
    case mx::int64: return a.data<int64_t>()[i];
    case mx::int32: return a.data<int32_t>()[i];
    case mx::int16: return a.data<int16_t>()[i];
    case mx::int8: return a.data<int8_t>()[i];
    case mx::uint64: return static_cast<int64_t>(std::min<uint64_t>(a.data<uint64_t>()[i], INT64_MAX));
    case mx::uint32: return a.data<uint32_t>()[i];
    case mx::uint16: return a.data<uint16_t>()[i];
    case mx::uint8:
    case mx::bool_: return a.data<uint8_t>()[i];
    default: throw std::invalid_argument("expected an integer array");
  }
}

// Entry i of a 1-D integer array (any stride) clamped into [0, n): a slot of
// a cache of n.
inline int64_t clamped_entry(const mlx::core::array& a, int64_t i, int64_t n) {
  return std::clamp<int64_t>(integer_at(a, i * a.strides()[0]), 0, n - 1);
}

// An index into an axis of n (n > 0) as the runtime's takes read it:
// clamped into [-n, n - 1], negative ones counted from the end.
inline int64_t wrapped_row(int64_t index, int64_t n) {
  const int64_t r = std::clamp<int64_t>(index, -n, n - 1);
  return r < 0 ? r + n : r;
}

// Whether `a` broadcasts to `shape` (right-aligned: each of its axes 1 or
// the shape's).
inline bool broadcasts_to(const mlx::core::array& a, const mlx::core::Shape& shape) {
  if (a.ndim() > shape.size()) return false;
  for (int i = 1; i <= static_cast<int>(a.ndim()); ++i) {
    if (a.shape(-i) != 1 && a.shape(-i) != shape[shape.size() - i]) return false;
  }
  return true;
}

// Indices clamped into [0, n), as uint32: MLX's gather and scatter kernels
// read and write out-of-range indices unchecked.
inline mlx::core::array clamped_indices(const mlx::core::array& ids, int n, mlx::core::StreamOrDevice s = {}) {
  namespace mx = mlx::core;
  const auto lo = mx::array(0, ids.dtype()), hi = mx::array(n - 1, ids.dtype());
  return mx::astype(mx::minimum(mx::maximum(ids, lo, s), hi, s), mx::uint32, s);
}

// Element strides of `a` read as an array of `shape` (a right-aligned
// broadcast: a missing or size-1 axis has stride 0).
inline std::vector<int64_t> broadcast_strides(const mlx::core::array& a, const mlx::core::Shape& shape) {
  std::vector<int64_t> st(shape.size(), 0);
  const int lead = static_cast<int>(shape.size()) - static_cast<int>(a.ndim());
  for (int i = 0; i < static_cast<int>(a.ndim()); ++i) {
    if (a.shape(i) != 1) st[lead + i] = a.strides()[i];
  }
  return st;
}

// `a`'s elements in row-major order, for an input that arrives strided (a
// transposed or broadcast view, or a slice of a wider product's rows:
// llm/export/fused_projections.py), a run of the last axis at a time when
// that axis is contiguous.
inline std::vector<uint8_t> row_major_bytes(const mlx::core::array& a) {
  const size_t item = a.itemsize();
  std::vector<uint8_t> out(a.size() * item);
  if (a.size() == 0) return out;
  const uint8_t* src = a.data<uint8_t>();
  const int last = static_cast<int>(a.ndim()) - 1;
  const bool runs = last >= 0 && a.strides()[last] == 1;
  const size_t run = runs ? static_cast<size_t>(a.shape(last)) : 1;  // elements copied at once
  const int outer = runs ? last : last + 1;                            // the axes stepped over
  std::vector<int64_t> index(outer, 0);
  for (size_t i = 0; i < a.size(); i += run) {
    int64_t at = 0;
    for (int d = 0; d < outer; ++d) at += index[d] * a.strides()[d];
    std::memcpy(out.data() + i * item, src + at * item, run * item);
    for (int d = outer - 1; d >= 0 && ++index[d] == a.shape(d); --d) index[d] = 0;
  }
  return out;
}

// `a`'s data in row-major order: its own buffer when row-contiguous, else a
// copy made into `packed` (which must outlive the pointer).
template <class T>
inline const T* row_major_data(const mlx::core::array& a, std::vector<uint8_t>& packed) {
  if (a.flags().row_contiguous) return a.data<T>();
  packed = row_major_bytes(a);
  return static_cast<const T*>(static_cast<const void*>(packed.data()));
}

// `a` itself when it is evaluated and row-contiguous (weights are: a
// contiguous() would add an MLX node, a task scheduled per call, for
// nothing), else a contiguous copy.
inline mlx::core::array row_contiguous(const mlx::core::array& a) {
  return a.is_available() && a.flags().row_contiguous ? a : mlx::core::contiguous(a);
}

}  // namespace emlx
