#include "checks.h"

#include <sstream>
#include <stdexcept>
#include <string>

namespace emlx {

namespace mx = mlx::core;

namespace {
[[noreturn]] void fail(const char* where, const std::string& what) {
  throw std::invalid_argument(std::string(where) + ": " + what);
}

int normalized(int32_t axis, int rank, const char* where) {
  if (axis < -rank || axis >= rank) {
    fail(where, "axis " + std::to_string(axis) + " out of range for rank " + std::to_string(rank));
  }
  return axis < 0 ? axis + rank : axis;
}
}  // namespace

int common_rank(const std::vector<mx::array>& values, const char* where) {
  if (values.empty()) fail(where, "no values");
  for (const auto& v : values) {
    if (v.ndim() != values[0].ndim()) fail(where, "values of different ranks");
  }
  return rank_of(values[0]);
}

void check_axis(int32_t axis, int rank, const char* where) { normalized(axis, rank, where); }

void check_axes(const flatbuffers::Vector<int32_t>* axes, int rank, const char* where) {
  if (!axes) return;
  std::vector<bool> seen(std::max(rank, 0), false);
  for (auto axis : *axes) {
    const int a = normalized(axis, rank, where);
    if (seen[a]) fail(where, "axis " + std::to_string(axis) + " repeated");
    seen[a] = true;
  }
}

void check_permutation(const flatbuffers::Vector<int32_t>* axes, int rank, const char* where) {
  check_per_axis(axes ? axes->size() : 0, rank, where);
  check_axes(axes, rank, where);
}

void check_per_axis(size_t entries, int rank, const char* where) {
  if (entries != static_cast<size_t>(rank)) {
    fail(where, std::to_string(entries) + " entries for rank " + std::to_string(rank));
  }
}

void check_strides(const flatbuffers::Vector<int32_t>* strides, const char* where) {
  if (!strides) return;
  for (auto s : *strides) {
    if (s == 0) fail(where, "a stride is 0");
  }
}

void check_numel(const mx::Shape& shape, const mx::array& a, const char* where) {
  uint64_t n = 1;
  for (auto d : shape) {
    if (__builtin_mul_overflow(n, static_cast<uint64_t>(d), &n)) fail(where, "element count overflows");
  }
  if (n != a.size()) {
    fail(where, "shape of " + std::to_string(n) + " elements for a value of " + std::to_string(a.size()));
  }
}

void check_one_of(int64_t value, std::initializer_list<int64_t> allowed, const char* where) {
  for (auto v : allowed) {
    if (value == v) return;
  }
  std::ostringstream msg;
  msg << value << " is not one of";
  for (auto v : allowed) msg << " " << v;
  fail(where, msg.str());
}

void check_kind(mx::Dtype dtype, Kind kind, const char* where) {
  const bool ok = kind == Kind::floating ? mx::issubdtype(dtype, mx::floating)
                  : kind == Kind::integer ? (mx::issubdtype(dtype, mx::integer) || dtype == mx::bool_)
                                          : dtype != mx::bool_;
  if (!ok) {
    static const char* names[] = {"floating point", "integer", "numeric"};
    std::ostringstream msg;
    msg << "dtype " << dtype << " where a " << names[static_cast<int>(kind)] << " one is needed";
    fail(where, msg.str());
  }
}

}  // namespace emlx
