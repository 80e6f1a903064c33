#include "memory_budget.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>

namespace emlx {

namespace {
std::atomic<size_t> g_budget{0};

size_t physical_memory() {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  size_t bytes = pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : size_t{8} << 30;
  rlimit lim{};
  if (getrlimit(RLIMIT_AS, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY) bytes = std::min<size_t>(bytes, lim.rlim_cur);
  return bytes;
}
}  // namespace

size_t parse_memory_size(const std::string& text) {
  const auto bad = [&] {
    return std::invalid_argument("memory size '" + text + "': expected bytes, a K/M/G/T suffix, or a % of memory");
  };
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    throw bad();
  }
  std::string unit = text.substr(pos);
  unit.erase(std::remove_if(unit.begin(), unit.end(), [](unsigned char c) { return std::isspace(c); }), unit.end());
  for (auto& c : unit) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  if (!(value > 0) || !std::isfinite(value)) throw bad();
  if (unit == "%") {
    if (value > 100) throw bad();
    return static_cast<size_t>(static_cast<double>(physical_memory()) * value / 100);
  }
  static const char* units = "KMGT";
  double scale = 1;
  if (!unit.empty()) {
    const char* u = std::strchr(units, unit[0]);
    if (!u || !(unit.size() == 1 || unit.substr(1) == "B" || unit.substr(1) == "IB")) throw bad();
    scale = std::ldexp(1.0, 10 * static_cast<int>(u - units + 1));
  }
  const double bytes = value * scale;
  if (bytes >= 1.8e19) throw bad();
  return static_cast<size_t>(bytes);
}

std::string format_bytes(size_t bytes) {
  char buf[32];
  if (bytes >= (size_t{1} << 30)) {
    std::snprintf(buf, sizeof buf, "%.1f GiB", static_cast<double>(bytes) / (1 << 30));
  } else if (bytes >= (size_t{1} << 20)) {
    std::snprintf(buf, sizeof buf, "%.1f MiB", static_cast<double>(bytes) / (1 << 20));
  } else {
    std::snprintf(buf, sizeof buf, "%zu bytes", bytes);
  }
  return buf;
}

size_t memory_budget() {
  if (size_t set = g_budget.load()) return set;
  if (const char* env = std::getenv("EMLX_MEMORY_BUDGET"); env && *env) {
    try {
      return parse_memory_size(env);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("EMLX_MEMORY_BUDGET: ") + e.what());
    }
  }
  return physical_memory() / 4;
}

void set_memory_budget(size_t bytes) { g_budget.store(bytes); }

}  // namespace emlx
