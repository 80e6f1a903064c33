#include "program_checks.h"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <vector>

#include "interpreter.h"  // set_last_error
#include "memory_budget.h"
// Generated at build time by flatc from the installed executorch wheel's
// schema/program.fbs (CMakeLists.txt), so it always matches the runtime we link.
#include "program_generated.h"

namespace emlx {
namespace {

[[noreturn]] void bad(const std::string& why) { throw std::runtime_error("corrupt program: " + why); }

// The extended header ("eh00" at byte 8) gives the FlatBuffer's size; a file
// without one is all FlatBuffer. `head`: the file's first min(file_size, 40)
// bytes. Returns the FlatBuffer's size, checked against the file's first.
uint64_t program_size(const uint8_t* head, uint64_t file_size) {
  if (file_size < 8) bad("the file has " + std::to_string(file_size) + " bytes, fewer than a header");
  if (file_size < 40 || std::memcmp(head + 8, "eh00", 4) != 0) return file_size;
  uint32_t length;
  std::memcpy(&length, head + 12, sizeof length);
  if (length < 24) bad("its extended header has a length of " + std::to_string(length) + " (< 24)");
  const uint64_t n = read_u64(head + 16), base = read_u64(head + 24);
  const uint64_t data = length >= 32 ? read_u64(head + 32) : 0;
  if (n < 8 || n > file_size) {
    bad("its header gives a program of " + std::to_string(n) + " bytes in a file of " + std::to_string(file_size));
  }
  // ExecuTorch's own rule (Program::load), said here with the numbers: its
  // error alone is "InvalidProgram". A zero data size with a base: an old file.
  if ((data > 0 || base == 0) && (base > UINT64_MAX - data || (base == 0 ? n : base + data) > file_size)) {
    bad("truncated? its header gives " + std::to_string(data) + " bytes of segments at byte " + std::to_string(base) +
        " in a file of " + std::to_string(file_size));
  }
  return n;
}

template <typename Vector>
void check_indices(const Vector* indices, size_t n_values, const std::string& method, const char* what) {
  if (indices == nullptr) return;
  for (size_t i = 0; i < indices->size(); ++i) {
    const auto v = indices->Get(i);
    if (v < 0 || static_cast<uint64_t>(v) >= n_values) {
      bad("method '" + method + "': " + what + " " + std::to_string(i) + " is value " + std::to_string(v) +
          " of " + std::to_string(n_values));
    }
  }
}

// `data`: the FlatBuffer's `size` bytes.
void check_flatbuffer(const uint8_t* data, size_t size) {
  // Our own bounds check of every table walked below (the caller's
  // ExecuTorch verification may be off: Python's Verification.Minimal).
  flatbuffers::Verifier verifier(data, size);
  if (!verifier.VerifyBuffer<executorch_flatbuffer::Program>(nullptr)) {
    bad("its FlatBuffer fails verification (offsets or sizes out of bounds)");
  }
  const auto* plans = flatbuffers::GetRoot<executorch_flatbuffer::Program>(data)->execution_plan();
  if (plans == nullptr || plans->size() == 0) bad("it has no methods");
  for (size_t p = 0; p < plans->size(); ++p) {
    const auto* plan = plans->Get(p);
    if (plan->name() == nullptr) bad("method " + std::to_string(p) + " has no name");
    const std::string name = plan->name()->str();
    const size_t n_values = plan->values() == nullptr ? 0 : plan->values()->size();
    // ExecuTorch reads these with an assert (SIGABRT) or not bounded at all.
    check_indices(plan->inputs(), n_values, name, "input");
    check_indices(plan->outputs(), n_values, name, "output");
    // The runners allocate these (ExecuTorch's memory planning) before any
    // check of theirs: a negative one aborts in MethodMeta, a huge one stalls.
    if (const auto* sizes = plan->non_const_buffer_sizes()) {
      const size_t budget = memory_budget();
      for (size_t i = 0; i < sizes->size(); ++i) {
        const int64_t n = sizes->Get(i);
        if (n < 0 || static_cast<uint64_t>(n) > budget) {
          bad("method '" + name + "' plans a buffer of " + std::to_string(n) + " bytes (the memory budget is " +
              format_bytes(budget) + ")");
        }
      }
    }
  }
}

}  // namespace

void check_program(const uint8_t* data, size_t size) {
  check_flatbuffer(data, static_cast<size_t>(program_size(data, size)));
}

void check_program_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot open " + path);
  const auto file_size = static_cast<uint64_t>(f.tellg());
  std::vector<uint8_t> head(std::min<uint64_t>(file_size, 40));
  f.seekg(0);
  f.read(reinterpret_cast<char*>(head.data()), static_cast<std::streamsize>(head.size()));
  const uint64_t n = program_size(head.data(), file_size);  // <= file_size: no huge allocation
  std::vector<uint8_t> program(static_cast<size_t>(n));
  f.seekg(0);
  if (!f.read(reinterpret_cast<char*>(program.data()), static_cast<std::streamsize>(n))) {
    throw std::runtime_error("cannot read " + path);
  }
  check_flatbuffer(program.data(), program.size());
}

}  // namespace emlx

// For the Python runner: 0 when the container passes check_program, -1
// otherwise (reason in emlx_last_error). `path` or, when null, `data`/`size`.
extern "C" __attribute__((visibility("default"))) int emlx_check_program(const char* path, const uint8_t* data, uint64_t size) {
  try {
    if (path != nullptr) {
      emlx::check_program_file(path);
    } else {
      emlx::check_program(data, static_cast<size_t>(size));
    }
    return 0;
  } catch (const std::exception& e) {
    emlx::set_last_error(e.what());
    return -1;
  }
}
