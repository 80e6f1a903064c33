// A decode step's matrix-vector products come in the same order every step,
// and between two of them the memory bus idles: one core runs small kernels
// (attention, heads, cache writes) while the other, the graph builder lending
// its core to our kernels (thread_pool.h), spins waiting for the next
// product; between two calls the stream thread idles while the caller runs
// its own code and builds the next graph; at the end of each product one
// thread waits for the other's last rows. Any idle thread reads the start of
// the next products' weights meanwhile, so that they find them in cache (a
// ~100M model's decode on a 2-core Xeon: float32 1.05x, int4 1.05-1.10x; the
// ends of products added nothing clear beyond that; docs/benchmarks.md).
#pragma once

#include <cstddef>

namespace emlx {

// A product over the weights at w (bytes long) starts: it is remembered as
// the successor of the product before it, and the products that followed it
// last time, in order, are the ones to read ahead next, up to a budget (what
// the caches keep: read_ahead_bytes in the .cpp). Nothing is read ahead
// while every thread has a share of it (the cores' bandwidth is its own).
void product_starts(const void* w, size_t bytes);

// The running product's items are all claimed: a thread that found none
// left idles until the last one is done (a decode step's products spent ~5%
// of their time so, one core streaming), and may read ahead meanwhile.
// Our pool calls it at the end of every parallel run: one that is not a
// product (attention, say) runs after a product has ended, whose successors
// may be read ahead already.
void product_tail();

// The product that started last has ended: its successors may be read ahead.
void product_ends();

// Called by an idle thread: asks for the next share of the upcoming
// product's weights into cache. False when there is nothing (left) to ask for.
bool read_ahead();

}  // namespace emlx
