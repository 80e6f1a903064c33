// A small persistent thread pool for our CPU kernels (MLX's CPU stream runs
// one task at a time on one thread; a matrix-vector product is memory bound
// and needs every core to reach the memory bandwidth).
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>

namespace emlx {

// Runs fn(0) ... fn(n - 1), spread over the pool, a helping thread (see
// help_until) and the calling thread; returns when all are done.
// Thread-safe: while the pool is busy, another caller runs its items alone.
void parallel_for(int n, const std::function<void(int)>& fn);

// Threads that parallel_for uses, the caller included.
int pool_size();

// Waits until done() holds, meanwhile running items of parallel_for runs:
// the thread that builds a graph lends its core to the kernels while it
// waits on their results. Whatever makes done() true calls wake_helpers().
void help_until(const std::function<bool()>& done);
void wake_helpers();

// The thread that builds a graph and the one that runs it (MLX's stream
// thread) wake each other, and Linux places a thread it wakes on the
// waker's CPU when the other looks busy, as an idle virtual CPU can: both
// then take turns on one core for milliseconds while the other idles (a
// prefill after a pause ran at one thread's speed). The stream thread notes
// its CPU as it runs our tasks; step_aside moves the calling thread to
// another CPU when it is on that one (true if it did).
void note_kernel_cpu();
bool step_aside();

// step_aside moves the builder once; the stream thread, woken by it dozens
// of times a step, can follow it back. After an idle spell (a chat turn, a
// request apart from the last) both then took turns on one CPU for whole
// calls: a small model's decode step 1.54 ms instead of 0.78. While a
// KeptApart lives, the stream thread that ran the calling thread's last
// graph (remember_stream_thread) may run only on a CPU of its own and the
// calling thread only on the others; then both affinities are as they were.
// It does nothing with one thread for the kernels (EMLX_NUM_THREADS=1), one
// allowed CPU, or before the stream thread is known.
class KeptApart {
 public:
  KeptApart();
  ~KeptApart();
  KeptApart(const KeptApart&) = delete;
  KeptApart& operator=(const KeptApart&) = delete;

 private:
  struct Masks;
  std::unique_ptr<Masks> saved_;  // (set while the affinities are narrowed)
};
// Called by the thread that builds, once the last task it queued has run:
// the thread that ran it is its graphs' stream thread.
void remember_stream_thread();

// MLX's stream thread sleeps on a condition variable whenever its queue is
// empty, and the builder's next task then wakes it: a futex wake-up on the
// builder's side, a reschedule on the other (on a small model's decode,
// ~15% of the builder's time went to waking it). note_dispatch counts the
// tasks our kernels queue (CpuKernel::eval_cpu); at the end of a batch the
// stream thread calls linger(dispatches() as the batch was queued), which
// spins until the builder has queued a kernel of ours since, or for 50 us
// at most (none with one thread for the kernels, or while the helpers back
// off: another process wants the cores). Longer (200 us) cost a large
// model's decode 3%: the builder is then often slower than that.
void note_dispatch();
uint64_t dispatches();
void linger(uint64_t seen);
// After a call's last batch the stream thread reads the next call's first
// weights ahead (upcoming_weights.h) while the caller is away (a decode
// loop's own code, the next graph's building: ~0.8 ms a step of a 100M
// model's decode through Python), until its share is asked for or a kernel
// of ours is queued again (nothing with one thread for the kernels, or
// while the helpers back off).
void read_ahead_until_dispatch(uint64_t seen);

// Runs fn(r0, r1) over [0, rows) in chunks of `chunk` rows spread over the
// pool; as many rows as one chunk (a decode step's) run on the caller, not
// worth waking the pool for.
template <class F>
void parallel_rows(int64_t rows, int64_t chunk, F&& fn) {
  if (rows <= chunk) {
    if (rows > 0) fn(int64_t{0}, rows);
    return;
  }
  parallel_for(static_cast<int>((rows + chunk - 1) / chunk),
               [&](int t) { fn(t * chunk, std::min(rows, (t + 1) * chunk)); });
}

// Whether this x86-64 CPU has AVX2 and FMA (false on other machines).
bool has_avx2();
// AVX2 and AVX-VNNI (vpdpwssd on 256-bit registers): Intel since Alder Lake
// and Sapphire Rapids, AMD since Zen 5.
bool has_avx_vnni();
// AVX2, FMA and AVX-512 F: Intel since Skylake-SP, AMD since Zen 4.
bool has_avx512();
// AVX2, FMA and AVX-512 with VNNI (F, BW, VL): Intel since Ice Lake and
// Sapphire Rapids, AMD since Zen 4.
bool has_avx512_vnni();
// (EMLX_X86_KERNELS=avx2 makes the last three false, =avx-vnni the last two.)

}  // namespace emlx
