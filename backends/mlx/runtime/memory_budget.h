// How much memory one program may allocate as it runs: the values a call
// creates that are alive at once (node outputs, from the node that writes
// one to the last node that reads it; graph outputs and buffer updates to
// the end) plus its persistent state (mutable buffers). Weights are not
// counted: they are already in memory, read from a file the caller chose.
// Checked at load on the shapes of a dry run, and on every call (dynamic
// shapes), before anything is allocated.
#pragma once

#include <cstddef>
#include <string>

namespace emlx {

// The process-wide budget in bytes: the last set_memory_budget() value, else
// EMLX_MEMORY_BUDGET, else a quarter of physical memory (of RLIMIT_AS, if
// that is lower). Throws std::invalid_argument for a malformed variable.
size_t memory_budget();
// 0 restores the default.
void set_memory_budget(size_t bytes);

// "1073741824", "512M", "8G", "8GiB", "25%" (of physical memory) -> bytes.
size_t parse_memory_size(const std::string& text);
std::string format_bytes(size_t bytes);

}  // namespace emlx
