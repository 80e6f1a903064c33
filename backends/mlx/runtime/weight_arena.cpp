#include "weight_arena.h"

#include <algorithm>
#include <cstdint>
#include <stdexcept>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace emlx {

namespace mx = mlx::core;

namespace {

constexpr size_t kAlign = 64;
constexpr size_t kHugePage = size_t{2} << 20;
// Weights a shared allocation holds at most (a larger weight gets its own):
// bounded, so that no one allocation outgrows what an allocator hands out.
constexpr size_t kChunk = size_t{1} << 30;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t nbytes(const WeightSpec& w) {
  size_t n = mx::size_of(w.dtype);
  for (auto d : w.shape) n *= static_cast<size_t>(d);
  return n;
}

// One allocation of at least `bytes` from MLX's allocator, as a uint8
// array, and where in it an address aligned to a huge page (or to kAlign,
// for small ones) starts.
mx::array chunk(size_t bytes, size_t& start) {
  const size_t align = bytes >= kHugePage ? kHugePage : kAlign, total = bytes + align;
  constexpr size_t kRow = 4096;  // (an array's dimensions are 32-bit: a 2-D shape holds any size)
  mx::array a(mx::allocator::malloc(round_up(total, kRow)),
              {static_cast<int>(round_up(total, kRow) / kRow), static_cast<int>(kRow)}, mx::uint8);
  const auto base = reinterpret_cast<uintptr_t>(a.data<uint8_t>());
  start = round_up(base, align) - base;
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  // before the weights are written: their first touch then takes huge pages
  if (align == kHugePage) {
    const size_t whole = bytes / kHugePage * kHugePage;
    if (whole) madvise(reinterpret_cast<void*>(base + start), whole, MADV_HUGEPAGE);
  }
#endif
  return a;
}

// An evaluated array of `w`'s shape and dtype over bytes [offset, ...) of `buffer`.
mx::array view(const mx::array& buffer, const WeightSpec& w, size_t offset) {
  mx::array a(w.shape, w.dtype, nullptr, {});
  if (offset % a.itemsize() != 0) throw std::logic_error("weight_arrays: a weight misaligned for its dtype");
  mx::array::Flags flags;
  flags.contiguous = flags.row_contiguous = true;
  const size_t size = a.size();
  const auto max_dim = std::max_element(a.shape().begin(), a.shape().end());
  flags.col_contiguous = size <= 1 || (max_dim != a.shape().end() && size == static_cast<size_t>(*max_dim));
  // (copy_shared_buffer's offset counts elements of the new array)
  a.copy_shared_buffer(buffer, a.strides(), flags, size, static_cast<int64_t>(offset / a.itemsize()));
  a.set_status(mx::array::Status::available);
  return a;
}

}  // namespace

std::vector<mx::array> weight_arrays(const std::vector<WeightSpec>& specs) {
  std::vector<mx::array> out;
  out.reserve(specs.size());
  for (size_t i = 0; i < specs.size();) {
    // weights [i, j) share an allocation
    size_t j = i, bytes = 0;
    while (j < specs.size() && (j == i || round_up(bytes, kAlign) + nbytes(specs[j]) <= kChunk)) {
      bytes = round_up(bytes, kAlign) + nbytes(specs[j]);
      ++j;
    }
    size_t start = 0, at = 0;  // at: from the aligned start
    const mx::array buffer = chunk(std::max<size_t>(bytes, 1), start);
    for (; i < j; ++i) {
      at = round_up(at, kAlign);
      out.push_back(view(buffer, specs[i], start + at));
      at += nbytes(specs[i]);
    }
  }
  return out;
}

}  // namespace emlx
