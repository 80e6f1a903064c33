// A small persistent thread pool for our CPU kernels (MLX's CPU stream runs
// one task at a time on one thread; a matrix-vector product is memory bound
// and needs every core to reach the memory bandwidth).
#pragma once

#include <functional>

namespace emlx {

// Runs fn(0) ... fn(n - 1), spread over the pool and the calling thread;
// returns when all are done. Thread-safe: while the pool is busy, another
// caller runs its items alone.
void parallel_for(int n, const std::function<void(int)>& fn);

// Threads that parallel_for uses, the caller included.
int pool_size();

// Whether our CPU kernels run (the linear layer, the sampler): on MLX's CPU
// device, unless EMLX_DISABLE_CPU_KERNELS is set (then MLX ops do the work,
// as on GPUs).
bool cpu_kernels_enabled();

// Whether this x86-64 CPU has AVX2 and FMA (false on other machines).
bool has_avx2();

}  // namespace emlx
