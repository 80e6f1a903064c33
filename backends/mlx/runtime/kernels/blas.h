// OpenBLAS from the scipy-openblas32 wheel (every symbol prefixed scipy_, so
// it never meets the reference BLAS that MLX links), for our CPU kernels.
#pragma once

#include <mutex>

extern "C" {
#include <cblas.h>
}

namespace emlx {

// Call before any sgemm: our pool spreads the work, so OpenBLAS runs
// single-threaded (its own spinning threads collapse when another process
// wants a core).
inline void use_single_threaded_blas() {
  static std::once_flag once;
  std::call_once(once, [] { scipy_openblas_set_num_threads(1); });
}

}  // namespace emlx
