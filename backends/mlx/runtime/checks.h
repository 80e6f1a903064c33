// Checks of node arguments, made before MLX sees a node (generated from the
// schema's attributes into generated/op_dispatch.inc). A blob is untrusted
// input and MLX trusts its arguments: a zero stride divides by zero, a
// wrong axis indexes out of bounds. Each check throws std::invalid_argument
// naming the node's field (`where`, e.g. "SumNode.axes") and the bad value.
#pragma once

#include <mlx/mlx.h>

#include <flatbuffers/flatbuffers.h>

#include <cstdint>
#include <initializer_list>
#include <vector>

namespace emlx {

enum class Kind { floating, integer, number };

inline int rank_of(const mlx::core::array& a) { return static_cast<int>(a.ndim()); }
// The rank every value of a list shares (throws if they differ or it is empty).
int common_rank(const std::vector<mlx::core::array>& values, const char* where);

void check_axis(int32_t axis, int rank, const char* where);
// Each axis in [-rank, rank), none repeated (counting -1 and rank - 1 as one).
void check_axes(const flatbuffers::Vector<int32_t>* axes, int rank, const char* where);
void check_permutation(const flatbuffers::Vector<int32_t>* axes, int rank, const char* where);
void check_per_axis(size_t entries, int rank, const char* where);
void check_strides(const flatbuffers::Vector<int32_t>* strides, const char* where);
// `shape` (already within MLX's int32 range) holds as many elements as `a`.
void check_numel(const mlx::core::Shape& shape, const mlx::core::array& a, const char* where);
void check_one_of(int64_t value, std::initializer_list<int64_t> allowed, const char* where);
// integer: an integer type or bool; number: anything but bool.
void check_kind(mlx::core::Dtype dtype, Kind kind, const char* where);

}  // namespace emlx
