// A small persistent thread pool for our CPU kernels (MLX's CPU stream runs
// one task at a time on one thread; a matrix-vector product is memory bound
// and needs every core to reach the memory bandwidth).
#pragma once

#include <functional>

namespace emlx {

// Runs fn(0) ... fn(n - 1), spread over the pool and the calling thread;
// returns when all are done. Not reentrant: call it from one thread at a time
// (MLX's CPU stream thread).
void parallel_for(int n, const std::function<void(int)>& fn);

// Threads that parallel_for uses, the caller included.
int pool_size();

}  // namespace emlx
