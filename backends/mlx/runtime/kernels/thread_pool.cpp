#include "thread_pool.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "upcoming_weights.h"

#if defined(__linux__)
#include <sched.h>
#include <unistd.h>
#endif

namespace emlx {

namespace {

// The CPU the calling thread runs on; -1 where unknown.
int current_cpu() {
#if defined(__linux__)
  return sched_getcpu();
#else
  return -1;
#endif
}

// While it lives, the calling thread may not run on `cpu` (when its
// affinity allows others); then its affinity is as it was. Made and dropped
// at once, it moves the thread off `cpu`, where the scheduler leaves it until
// it has a reason to move it.
class AwayFrom {
 public:
  explicit AwayFrom(int cpu) {
#if defined(__linux__)
    if (cpu < 0 || cpu >= CPU_SETSIZE || sched_getaffinity(0, sizeof mask_, &mask_) != 0 || !CPU_ISSET(cpu, &mask_) ||
        CPU_COUNT(&mask_) < 2) {
      return;
    }
    cpu_set_t others = mask_;
    CPU_CLR(cpu, &others);
    moved_ = sched_setaffinity(0, sizeof others, &others) == 0;
#else
    (void)cpu;
#endif
  }
  ~AwayFrom() {
#if defined(__linux__)
    if (moved_) sched_setaffinity(0, sizeof mask_, &mask_);
#endif
  }
  AwayFrom(const AwayFrom&) = delete;
  AwayFrom& operator=(const AwayFrom&) = delete;

 private:
#if defined(__linux__)
  cpu_set_t mask_;
#endif
  bool moved_ = false;
};

// The CPU where MLX's stream thread last ran a task of ours.
std::atomic<int> kernel_cpu{-1};
std::atomic<int64_t> kernel_thread{0};  // (a Linux thread id)

int64_t current_thread() {
#if defined(__linux__)
  static thread_local const int64_t me = gettid();
  return me;
#else
  return 0;
#endif
}

thread_local int64_t stream_thread = 0;  // of the graphs the calling thread builds

// A spin-wait hint: the core's other hardware thread, if any, gets its share.
inline void relax() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  explicit Pool(int workers) {
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { work(); });
  }

  ~Pool() {
    {
      std::lock_guard<std::mutex> lock(m_);
      stop_ = true;
      ++generation_;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }

  void run(int n, const std::function<void(int)>& fn) {
    uint64_t gen;
    {
      std::lock_guard<std::mutex> lock(m_);
      gen = ++generation_;
      // First close the previous run: a worker that read its ticket just
      // before could otherwise claim an index of it against this run's n and
      // function once those are written (and run an item twice).
      ticket_.store((gen << 32) | kClosed);
      fn_.store(&fn);
      n_.store(n);
      pending_.store(n);
      ticket_.store(gen << 32);
    }
    cv_.notify_all();
    drain(gen);
    // Workers may still be finishing their last item: the next product's
    // weights are asked for meanwhile, a share before each yield (the thread
    // with the last item may be waiting for this core), none while the
    // helpers back off.
    while (pending_.load(std::memory_order_acquire) > 0) {
      if (may_spin()) read_ahead();
      std::this_thread::yield();
    }
  }

  void help_until(const std::function<bool()>& done, bool spin) {
    // A decode step's products come tens of microseconds apart, too close
    // for a sleep and a wake-up each (the builder has a core of its own by
    // then): the helper spins between them, yielding, and sleeps after a
    // longer lull. A yield that took long shows that another thread wanted
    // the core (another process, on a machine with no core to spare): then
    // every helper sleeps for a while rather than spin. While it spins it
    // reads the next product's weights ahead (upcoming_weights.h).
    using clock = std::chrono::steady_clock;
    auto idle_since = clock::now();
    while (!done()) {
      const uint64_t t = ticket_.load();
      if ((t & kClosed) < static_cast<uint64_t>(n_.load())) {
        if (spin) step_aside();
        drain(t >> 32);
        idle_since = clock::now();
        continue;
      }
      if (spin) {
        const auto before = clock::now();
        if (before - idle_since < kSpin && before.time_since_epoch().count() > no_spin_until_.load()) {
          if (read_ahead()) continue;
          std::this_thread::yield();
          const auto after = clock::now();
          if (after - before > kTaken && !step_aside()) {
            no_spin_until_.store((after + kBackOff).time_since_epoch().count());
          }
          continue;
        }
      }
      // (woken by the stream thread, it would be placed on the stream's CPU)
      const AwayFrom away(spin ? kernel_cpu.load(std::memory_order_relaxed) : -1);
      std::unique_lock<std::mutex> lock(m_);
      const uint64_t seen = generation_;
      cv_.wait(lock, [&] { return generation_ != seen || done(); });
      idle_since = clock::now();
    }
  }

  void linger(uint64_t seen) {
    using clock = std::chrono::steady_clock;
    const auto until = clock::now() + kLinger;
    if (until.time_since_epoch().count() <= no_spin_until_.load()) return;
    while (dispatches_.load(std::memory_order_acquire) == seen && clock::now() < until) {
      for (int i = 0; i < 16; ++i) relax();
    }
  }

  // False while the helpers back off (another process wants the cores).
  bool may_spin() const {
    return std::chrono::steady_clock::now().time_since_epoch().count() > no_spin_until_.load();
  }

  void note_dispatch() { dispatches_.fetch_add(1, std::memory_order_release); }
  uint64_t dispatches() const { return dispatches_.load(std::memory_order_acquire); }

  void wake() {
    // (taking the lock orders this after a helper's check of done(): it is
    // either not waiting yet, and sees done() true, or waiting, and wakes)
    { std::lock_guard<std::mutex> lock(m_); }
    cv_.notify_all();
  }

 private:
  // Claims and runs items of run `gen`. The ticket holds (generation, next
  // index), so a worker that wakes late never claims an item of a later run.
  void drain(uint64_t gen) {
    while (true) {
      uint64_t t = ticket_.load();
      const uint64_t index = t & kClosed;
      if ((t >> 32) != (gen & 0xffffffffu)) return;
      if (index >= static_cast<uint64_t>(n_.load())) {
        product_tail();
        return;
      }
      if (!ticket_.compare_exchange_weak(t, t + 1)) continue;
      (*fn_.load())(static_cast<int>(index));
      pending_.fetch_sub(1, std::memory_order_release);
    }
  }

  void work() {
    uint64_t seen = 0;
    while (true) {
      {
        std::unique_lock<std::mutex> lock(m_);
        cv_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (stop_) return;
      }
      drain(seen);
    }
  }

  std::vector<std::thread> threads_;
  std::mutex m_;
  std::condition_variable cv_;
  uint64_t generation_ = 0;
  bool stop_ = false;
  static constexpr uint64_t kClosed = 0xffffffffu;  // a ticket index no run reaches
  std::atomic<const std::function<void(int)>*> fn_{nullptr};
  std::atomic<int> n_{0};
  std::atomic<uint64_t> ticket_{0};
  std::atomic<int> pending_{0};
  std::atomic<int64_t> no_spin_until_{0};  // (steady_clock ticks)
  std::atomic<uint64_t> dispatches_{0};
  static constexpr auto kSpin = std::chrono::microseconds(200), kTaken = std::chrono::microseconds(100);
  static constexpr auto kLinger = std::chrono::microseconds(50);
  static constexpr auto kBackOff = std::chrono::milliseconds(50);
};

Pool& pool() {
  // A worker on every core would leave the builder none: it builds the
  // graph while the products run and is then one thread too many, taking
  // turns on a core with a worker (on 2 cores, a second thread for the
  // products gained almost nothing). It lends its core while it waits.
  static Pool p(std::max(0, pool_size() - 2));
  return p;
}

}  // namespace

void parallel_for(int n, const std::function<void(int)>& fn) {
  // One run at a time: a second caller (another MLX stream's thread) works
  // alone rather than wait.
  static std::mutex busy;
  std::unique_lock<std::mutex> lock(busy, std::try_to_lock);
  // (with no workers, a run is still published: the builder may help)
  if (n <= 1 || pool_size() == 1 || !lock.owns_lock()) {
    for (int i = 0; i < n; ++i) fn(i);
    return;
  }
  pool().run(n, fn);
}

// The caller (MLX's stream thread), the graph builder while it waits
// (help_until), and a worker for each further core; EMLX_NUM_THREADS
// overrides the number of cores.
int pool_size() {
  static const int n = [] {
    int n = static_cast<int>(std::thread::hardware_concurrency());
    if (const char* env = std::getenv("EMLX_NUM_THREADS")) n = std::atoi(env);
    return std::clamp(n, 1, 64);
  }();
  return n;
}

void help_until(const std::function<bool()>& done) { pool().help_until(done, pool_size() > 1); }

void wake_helpers() { pool().wake(); }

void note_dispatch() { pool().note_dispatch(); }
uint64_t dispatches() { return pool().dispatches(); }
void linger(uint64_t seen) {
  if (pool_size() > 1) pool().linger(seen);
}

void read_ahead_until_dispatch(uint64_t seen) {
  if (pool_size() < 2 || !pool().may_spin()) return;
  while (dispatches() == seen && read_ahead()) {
  }
}

void note_kernel_cpu() {
  kernel_cpu.store(current_cpu(), std::memory_order_relaxed);
  kernel_thread.store(current_thread(), std::memory_order_relaxed);
}

void remember_stream_thread() { stream_thread = kernel_thread.load(std::memory_order_relaxed); }

#if defined(__linux__)
struct KeptApart::Masks {
  pid_t stream;
  cpu_set_t builder_was, stream_was;
};

KeptApart::KeptApart() {
  if (pool_size() < 2 || stream_thread == 0) return;
  Masks m;
  m.stream = static_cast<pid_t>(stream_thread);
  if (sched_getaffinity(0, sizeof m.builder_was, &m.builder_was) != 0 || CPU_COUNT(&m.builder_was) < 2 ||
      sched_getaffinity(m.stream, sizeof m.stream_was, &m.stream_was) != 0) {
    return;
  }
  // The stream thread's CPU: one both may run on, the one it last ran on
  // unless the builder is there (then the builder moves only if it must).
  cpu_set_t both;
  CPU_AND(&both, &m.builder_was, &m.stream_was);
  const int here = current_cpu(), last = kernel_cpu.load(std::memory_order_relaxed);
  int own = last >= 0 && last < CPU_SETSIZE && last != here && CPU_ISSET(last, &both) ? last : -1;
  for (int c = 0; c < CPU_SETSIZE && own < 0; ++c) {
    if (c != here && CPU_ISSET(c, &both)) own = c;
  }
  if (own < 0) {
    if (here < 0 || here >= CPU_SETSIZE || !CPU_ISSET(here, &both)) return;
    own = here;
  }
  cpu_set_t one, rest = m.builder_was;
  CPU_ZERO(&one);
  CPU_SET(own, &one);
  CPU_CLR(own, &rest);
  if (sched_setaffinity(m.stream, sizeof one, &one) != 0) return;  // (it ended: another stream's)
  if (sched_setaffinity(0, sizeof rest, &rest) != 0) {
    sched_setaffinity(m.stream, sizeof m.stream_was, &m.stream_was);
    return;
  }
  saved_ = std::make_unique<Masks>(m);
}

KeptApart::~KeptApart() {
  if (!saved_) return;
  sched_setaffinity(0, sizeof saved_->builder_was, &saved_->builder_was);
  sched_setaffinity(saved_->stream, sizeof saved_->stream_was, &saved_->stream_was);
}
#else
struct KeptApart::Masks {};
KeptApart::KeptApart() {}
KeptApart::~KeptApart() {}
#endif

bool step_aside() {
  const int at = current_cpu();
  if (at < 0 || at != kernel_cpu.load(std::memory_order_relaxed)) return false;
  { const AwayFrom away(at); }
  return true;
}

#if defined(__x86_64__)
namespace {
// EMLX_X86_KERNELS=plain | avx2 | avx-vnni caps the x86 kernel builds used
// below what the CPU has (to test every build on one machine; plain: the
// plain C++ kernels every CPU runs).
int x86_cap() {
  static const int cap = [] {
    const char* env = std::getenv("EMLX_X86_KERNELS");
    if (env == nullptr) return 3;
    const std::string v = env;
    if (v == "plain") return 0;
    if (v == "avx2" || v == "avx-vnni") return v == "avx2" ? 1 : 2;
    std::fprintf(stderr, "emlx: EMLX_X86_KERNELS=%s ignored (plain, avx2 or avx-vnni)\n", env);
    return 3;
  }();
  return cap;
}
}  // namespace
#endif

bool has_avx2() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && x86_cap() >= 1;
  return yes;
#else
  return false;
#endif
}

bool has_avx_vnni() {
#if defined(__x86_64__)
  static const bool yes = has_avx2() && __builtin_cpu_supports("avxvnni") && x86_cap() >= 2;
  return yes;
#else
  return false;
#endif
}

bool has_avx512() {
#if defined(__x86_64__)
  // (GCC's and Clang's checks include the OS saving the 512-bit registers)
  static const bool yes = has_avx2() && __builtin_cpu_supports("avx512f") && x86_cap() >= 3;
  return yes;
#else
  return false;
#endif
}

bool has_avx512_vnni() {
#if defined(__x86_64__)
  static const bool yes = has_avx512() && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                          __builtin_cpu_supports("avx512vnni");
  return yes;
#else
  return false;
#endif
}

}  // namespace emlx
