// An ExecuTorch program and its methods, loaded for our runners: emlx_runner
// (llm_runner.cpp) and the Python package's (program_api.cpp), which load a
// program without ExecuTorch's pybindings and so without libtorch.
#pragma once

#include <executorch/extension/data_loader/buffer_data_loader.h>
#include <executorch/extension/data_loader/mmap_data_loader.h>
#include <executorch/extension/flat_tensor/flat_tensor_data_map.h>
#include <executorch/extension/memory_allocator/malloc_memory_allocator.h>
#include <executorch/runtime/executor/memory_manager.h>
#include <executorch/runtime/executor/method.h>
#include <executorch/runtime/executor/program.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace emlx::files {

namespace et = executorch::runtime;

// Throws std::runtime_error for an ExecuTorch error: `what` failed, with its
// code and our runtime's reason (a delegate that refused the program) when
// there is one.
void check(et::Error e, const std::string& what);

// A file that is not a sound ExecuTorch program or data file (identifier,
// container, our checks), as opposed to one ExecuTorch could not load.
// what() names the file; `reason` is our checks' own words.
struct BadProgram : std::runtime_error {
  BadProgram(const std::string& message, const std::string& reason) : std::runtime_error(message), reason(reason) {}
  std::string reason;
};

// A program, checked (ET.. identifier, the whole container verified, our
// checks of what ExecuTorch later reads unchecked) and loaded from a mapped
// file or from a copy of its bytes. Not movable: the program points into it.
class ProgramFile {
 public:
  explicit ProgramFile(const std::string& path);
  ProgramFile(const uint8_t* data, size_t size);
  ProgramFile(const ProgramFile&) = delete;
  ProgramFile& operator=(const ProgramFile&) = delete;

  et::Program& program() { return *program_; }

 private:
  void load(et::DataLoader& loader, const std::string& label);

  std::optional<executorch::extension::MmapDataLoader> mapped_;
  std::vector<uint8_t> bytes_;
  std::optional<executorch::extension::BufferDataLoader> buffer_;
  std::optional<et::Program> program_;
};

// A data file (.ptd: export --external-weights), checked and mapped.
class DataFile {
 public:
  explicit DataFile(const std::string& path);
  DataFile(const DataFile&) = delete;
  DataFile& operator=(const DataFile&) = delete;

  const et::NamedDataMap* map() const { return &*map_; }

 private:
  std::optional<executorch::extension::MmapDataLoader> loader_;
  std::optional<executorch::extension::FlatTensorDataMap> map_;
};

// A loaded method with the memory it plans into (which must outlive it).
struct LoadedMethod {
  executorch::extension::MallocMemoryAllocator method_allocator, temp_allocator;
  std::vector<std::unique_ptr<uint8_t[]>> planned;
  std::vector<et::Span<uint8_t>> spans;
  std::unique_ptr<et::HierarchicalAllocator> planned_allocator;
  std::unique_ptr<et::MemoryManager> memory;
  std::unique_ptr<et::Method> method;

  LoadedMethod(et::Program& program, const char* name, const et::LoadBackendOptionsMap* options = nullptr,
               const et::NamedDataMap* data = nullptr);

  void execute();
};

}  // namespace emlx::files
