// Our own checks of a .pte container before ExecuTorch reads values from it.
//
// ExecuTorch's InternalConsistency verification bounds the FlatBuffer, and
// Method::init checks the instructions' value indices, but the indices of a
// method's inputs and outputs are read later with an assert (get_value:
// `i < n_value_`, SIGABRT), and Method::get_outputs does not check them at
// all. A one-byte change in a metadata method's outputs list reaches it. These
// checks run first, in both runners, so a corrupt file is an error, not a signal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

namespace emlx {

// The little-endian uint64 at `p` (ExecuTorch's headers are little-endian).
inline uint64_t read_u64(const uint8_t* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// The container's bytes from the start of the file; `size` must cover the
// program FlatBuffer (the extended header's program_size). Throws
// std::runtime_error naming what is wrong.
void check_program(const uint8_t* data, size_t size);

// Reads the FlatBuffer part of the file at `path` (not its segments: the
// weights stay unread) and checks it as above.
void check_program_file(const std::string& path);

// The same for an ExecuTorch data file (.ptd, data_file_checks.cpp): its
// header and FlatBuffer bound, every segment within the file.
void check_data_file(const std::string& path);

}  // namespace emlx
