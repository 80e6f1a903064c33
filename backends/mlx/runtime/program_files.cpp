#include "program_files.h"

#include <cctype>
#include <cstring>
#include <fstream>
#include <stdexcept>

extern "C" int emlx_check_program(const char* path, const uint8_t* data, uint64_t size);  // program_checks.h
extern "C" int emlx_check_data_file(const char* path);  // data_file_checks.cpp
extern "C" const char* emlx_last_error();

namespace emlx::files {

void check(et::Error e, const std::string& what) {
  if (e != et::Error::Ok) {
    const std::string reason = emlx_last_error();
    throw std::runtime_error(what + " failed (ExecuTorch " + et::to_string(e) + ")" +
                             (reason.empty() ? "" : ": " + reason));
  }
}

namespace {

// ExecuTorch would log a wrong identifier's raw bytes: refused here, said cleanly.
void check_identifier(const char* head, size_t size, const std::string& label) {
  if (size < 8 || head[4] != 'E' || head[5] != 'T' || !std::isdigit(static_cast<unsigned char>(head[6])) ||
      !std::isdigit(static_cast<unsigned char>(head[7]))) {
    const std::string what = " is not an ExecuTorch program (no ET.. file identifier at bytes 4-8)";
    throw BadProgram(label + what, "the file" + what);
  }
}

}  // namespace

ProgramFile::ProgramFile(const std::string& path) {
  auto mapped = executorch::extension::MmapDataLoader::from(path.c_str());
  check(mapped.error(), "opening " + path);
  mapped_.emplace(std::move(mapped.get()));
  char head[8] = {};
  std::ifstream(path, std::ios::binary).read(head, sizeof head);
  check_identifier(head, sizeof head, path);
  if (emlx_check_program(path.c_str(), nullptr, 0) != 0) {
    throw BadProgram("loading program " + path + ": " + emlx_last_error(), emlx_last_error());
  }
  load(*mapped_, path);
}

ProgramFile::ProgramFile(const uint8_t* data, size_t size) : bytes_(data, data + size) {
  check_identifier(reinterpret_cast<const char*>(bytes_.data()), bytes_.size(), "the program");
  if (emlx_check_program(nullptr, bytes_.data(), bytes_.size()) != 0) {
    throw BadProgram(std::string("loading the program: ") + emlx_last_error(), emlx_last_error());
  }
  buffer_.emplace(bytes_.data(), bytes_.size());
  load(*buffer_, "the program");
}

// The whole container is verified (FlatBuffers bounds and offsets) before
// anything in it is trusted: the default (Minimal) lets a corrupt file crash.
// Our checks (emlx_check_program, above) cover what ExecuTorch later reads
// unchecked (method input/output value indices: an assert, SIGABRT, in
// Method::get_output).
void ProgramFile::load(et::DataLoader& loader, const std::string& label) {
  auto program = et::Program::load(&loader, et::Program::Verification::InternalConsistency);
  check(program.error(), "loading program " + label);
  program_.emplace(std::move(program.get()));
}

DataFile::DataFile(const std::string& path) {
  // ExecuTorch trusts the file's offsets: checked first, as the program is
  if (emlx_check_data_file(path.c_str()) != 0) throw BadProgram(emlx_last_error(), emlx_last_error());
  auto mapped = executorch::extension::MmapDataLoader::from(path.c_str());
  check(mapped.error(), "opening " + path);
  loader_.emplace(std::move(mapped.get()));
  auto data = executorch::extension::FlatTensorDataMap::load(&*loader_);
  check(data.error(), "reading the weights file " + path);
  map_.emplace(std::move(data.get()));
}

LoadedMethod::LoadedMethod(et::Program& program, const char* name, const et::LoadBackendOptionsMap* options,
                           const et::NamedDataMap* data) {
  auto meta = program.method_meta(name);
  check(meta.error(), std::string("reading method '") + name + "'");
  for (size_t i = 0; i < meta->num_memory_planned_buffers(); ++i) {
    auto size = meta->memory_planned_buffer_size(i);  // .get() on an error aborts
    check(size.error(), std::string("reading method '") + name + "''s memory plan");
    // Not zero-filled: untouched pages of a large plan cost nothing.
    planned.emplace_back(new uint8_t[static_cast<size_t>(size.get())]);
    spans.emplace_back(planned.back().get(), static_cast<size_t>(size.get()));
  }
  planned_allocator = std::make_unique<et::HierarchicalAllocator>(et::Span(spans.data(), spans.size()));
  memory = std::make_unique<et::MemoryManager>(&method_allocator, planned_allocator.get(), &temp_allocator);
  auto m = program.load_method(name, memory.get(), nullptr, data, options);
  check(m.error(), std::string("loading method '") + name + "'");
  method = std::make_unique<et::Method>(std::move(m.get()));
}

void LoadedMethod::execute() { check(method->execute(), "execute"); }

}  // namespace emlx::files
