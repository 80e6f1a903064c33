// Our checks of an ExecuTorch data file (.ptd: export --external-weights)
// before ExecuTorch reads it: its FlatTensorDataMap trusts the FlatBuffer's
// offsets, and one flipped byte there crashed both runners (SIGSEGV in 5 of
// 10 mutations of the first 200 bytes). The layout is the .pte's: a
// FlatBuffer from byte 0 ("FT01") with a header at byte 8 ("FH01": its
// length, the FlatBuffer's offset and size, the segments' base and size).
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "flat_tensor_generated.h"
#include "interpreter.h"  // set_last_error
#include "program_checks.h"  // check_data_file, read_u64

namespace emlx {
namespace {

[[noreturn]] void bad(const std::string& path, const std::string& why) {
  throw std::runtime_error("corrupt data file " + path + ": " + why);
}

}  // namespace

void check_data_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary | std::ios::ate);
  if (!f) throw std::runtime_error("cannot open " + path);
  const auto file_size = static_cast<uint64_t>(f.tellg());
  constexpr size_t kHead = 48;
  if (file_size < kHead) bad(path, "it has " + std::to_string(file_size) + " bytes, fewer than a header");
  std::vector<uint8_t> head(kHead);
  f.seekg(0);
  f.read(reinterpret_cast<char*>(head.data()), kHead);
  if (std::memcmp(head.data() + 4, "FT01", 4) != 0 || std::memcmp(head.data() + 8, "FH01", 4) != 0) {
    bad(path, "no FT01/FH01 identifiers at bytes 4 and 8");
  }
  uint32_t length;
  std::memcpy(&length, head.data() + 12, sizeof length);
  const uint64_t fb_offset = read_u64(head.data() + 16), fb_size = read_u64(head.data() + 24);
  const uint64_t base = read_u64(head.data() + 32), data = read_u64(head.data() + 40);
  if (length < 40 || fb_offset > file_size || fb_size > file_size - fb_offset || base > file_size ||
      data > file_size - base || fb_offset + fb_size > base) {
    bad(path, "its header's sizes do not fit its " + std::to_string(file_size) + " bytes (truncated?)");
  }
  std::vector<uint8_t> fb(static_cast<size_t>(fb_offset + fb_size));
  f.seekg(0);
  if (!f.read(reinterpret_cast<char*>(fb.data()), static_cast<std::streamsize>(fb.size()))) {
    throw std::runtime_error("cannot read " + path);
  }
  flatbuffers::Verifier verifier(fb.data(), fb.size());
  if (!verifier.VerifyBuffer<flat_tensor_flatbuffer::FlatTensor>("FT01")) {
    bad(path, "its FlatBuffer fails verification (offsets or sizes out of bounds)");
  }
  const auto* root = flatbuffers::GetRoot<flat_tensor_flatbuffer::FlatTensor>(fb.data());
  const auto* segments = root->segments();
  const size_t n_segments = segments == nullptr ? 0 : segments->size();
  for (size_t i = 0; i < n_segments; ++i) {
    const auto* s = segments->Get(i);
    if (s->offset() > data || s->size() > data - s->offset()) {
      bad(path, "segment " + std::to_string(i) + " lies outside the file's data");
    }
  }
  if (const auto* named = root->named_data()) {
    for (size_t i = 0; i < named->size(); ++i) {
      const auto* entry = named->Get(i);
      if (entry->key() == nullptr || entry->segment_index() >= n_segments) {
        bad(path, "entry " + std::to_string(i) + " has no key or names a segment it does not have");
      }
    }
  }
}

}  // namespace emlx

// 0 when the data file at `path` passes check_data_file, -1 otherwise
// (reason in emlx_last_error).
extern "C" __attribute__((visibility("default"))) int emlx_check_data_file(const char* path) {
  try {
    emlx::check_data_file(path);
    return 0;
  } catch (const std::exception& e) {
    emlx::set_last_error(e.what());
    return -1;
  }
}
