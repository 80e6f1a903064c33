#include "upcoming_weights.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <unordered_map>

#if defined(__linux__)
#include <unistd.h>
#endif

namespace emlx {

namespace {

struct Span {
  const char* p = nullptr;
  size_t bytes = 0;
};

struct State {
  std::mutex m;  // (guards all below but `pending`)
  // Which product followed which, by weight address (the last successor
  // seen for each; two programs run in turn only mix their guesses).
  std::unordered_map<const void*, Span> successors;
  const void* last = nullptr;  // the weights of the product that ran last
  Span upcoming;               // the product being read ahead, from upcoming.p + asked on
  size_t asked = 0;
  size_t budget = 0;  // bytes left to ask for before the next product starts
  // Whether there may be something to read ahead: idle threads spin on it,
  // and a product about to start never waits on a lock they hold.
  std::atomic<bool> pending{false};

  Span successor(const void* w) const {
    const auto it = successors.find(w);
    return it == successors.end() ? Span{} : it->second;
  }
};

// Never destroyed: MLX's stream thread may read ahead while the process exits.
State& state() {
  static State* s = new State;
  return *s;
}

// How far ahead to read: what the caches keep until the product comes. A
// quarter of the last level (shared with the other cores, and on a virtual
// machine with other guests) and a core's L2, at most 32 MB; 8 MB where the
// sizes are unknown. EMLX_READ_AHEAD_KB overrides (0: off).
size_t read_ahead_bytes() {
  static const size_t bytes = [] {
    if (const char* env = std::getenv("EMLX_READ_AHEAD_KB")) return size_t{std::strtoull(env, nullptr, 10)} * 1024;
    size_t cached = 0;
#if defined(__linux__) && defined(_SC_LEVEL3_CACHE_SIZE)
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE), l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
    if (l2 > 0 && l3 > 0) cached = static_cast<size_t>(l2) + static_cast<size_t>(l3) / 4;
#endif
    return cached ? std::min<size_t>(cached, size_t{32} << 20) : size_t{8} << 20;
  }();
  return bytes;
}

}  // namespace

void product_starts(const void* w, size_t bytes) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.m);
  if (s.last != nullptr) {
    if (s.successors.size() >= 4096) s.successors.clear();  // (weights of programs since freed)
    s.successors[s.last] = {static_cast<const char*>(w), bytes};
  }
  s.last = w;
  s.upcoming = s.successor(w), s.asked = 0, s.budget = read_ahead_bytes();
  s.pending.store(false, std::memory_order_relaxed);
}

void product_tail() { state().pending.store(true, std::memory_order_relaxed); }

void product_ends() { product_tail(); }

bool read_ahead() {
  constexpr size_t kShare = 16 * 1024;  // (a few microseconds: new work is never kept waiting long)
  State& s = state();
  if (!s.pending.load(std::memory_order_relaxed)) return false;
  const char* p;
  size_t n;
  {
    std::unique_lock<std::mutex> lock(s.m, std::try_to_lock);
    if (!lock.owns_lock()) return false;  // (a product is starting or ending)
    if (s.upcoming.p != nullptr && s.asked >= s.upcoming.bytes) s.upcoming = s.successor(s.upcoming.p), s.asked = 0;
    if (s.upcoming.p == nullptr || s.budget == 0) {
      s.pending.store(false, std::memory_order_relaxed);
      return false;
    }
    p = s.upcoming.p + s.asked;
    n = std::min({kShare, s.upcoming.bytes - s.asked, s.budget});
    s.asked += n, s.budget -= n;
  }
  for (size_t i = 0; i < n; i += 64) __builtin_prefetch(p + i, 0, 2);
  return true;
}

}  // namespace emlx
