// Where a program's weights live on a CPU: a few large allocations rather
// than one a weight, each weight 64-byte aligned in them (a row of a
// matrix whose rows are a multiple of 64 bytes never straddles two cache
// lines), and on Linux backed by 2 MiB pages (transparent huge pages,
// asked for with madvise): a decode step streams every weight once, and
// with 4 KiB pages its reads miss the TLB at every page (measured: docs/
// benchmarks.md, "Weights in huge pages").
#pragma once

#include <mlx/mlx.h>

#include <vector>

namespace emlx {

struct WeightSpec {
  mlx::core::Shape shape;
  mlx::core::Dtype dtype;
};

// Arrays of these shapes and dtypes, row-contiguous, evaluated, their
// contents unset (for the caller to write), in the order given. They share
// buffers: MLX never donates them to an operation's output.
std::vector<mlx::core::array> weight_arrays(const std::vector<WeightSpec>& specs);

}  // namespace emlx
