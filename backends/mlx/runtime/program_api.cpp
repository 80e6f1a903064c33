// A C API over program_files.h for the Python package (loaded_program.py):
// loads and runs a program without ExecuTorch's pybindings, which link
// libtorch (seconds to import) where running a program needs none of it.
// Every function that can fail returns 0/NULL for success/failure as noted,
// with the reason in emlx_last_error().
#include <executorch/extension/tensor/tensor_ptr.h>
#include <executorch/extension/tensor/tensor_ptr_maker.h>
#include <executorch/runtime/platform/runtime.h>

#include <cstdint>
#include <exception>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include <mlx/memory.h>

#include "interpreter.h"
#include "program_files.h"

namespace emlx {
namespace {

namespace et = executorch::runtime;

constexpr int kMaxRank = 16;

// One value in or out of a method; loaded_program.py mirrors it.
struct Value {
  int32_t tag;  // 0 none, 1 tensor, 2 int, 3 double, 4 bool, 5 string
  int32_t dtype;  // a tensor's ScalarType code
  int64_t rank;
  int64_t sizes[kMaxRank];
  const void* data;  // a tensor's elements, a string's characters
  int64_t nbytes;  // of data
  int64_t integer;  // an int or a bool
  double real;
};

struct ProgramHandle {
  std::optional<files::ProgramFile> file;
  std::optional<files::DataFile> data;
};

struct MethodHandle {
  files::LoadedMethod loaded;
  MethodHandle(ProgramHandle& p, const char* name) : loaded(p.file->program(), name, nullptr, p.data ? p.data->map() : nullptr) {}
};

// Runs `body`; an exception becomes the thread's last error and `failed`.
// A BadProgram (a file that is not a sound program) also sets *bad to 1.
template <typename T, typename F>
T guarded(T failed, F&& body, int* bad = nullptr) {
  try {
    return body();
  } catch (const files::BadProgram& e) {
    set_last_error(e.reason);  // (Python names the file)
    if (bad) *bad = 1;
  } catch (const std::exception& e) {
    set_last_error(e.what());
  }
  return failed;
}

void describe(const et::Result<et::TensorInfo>& info, Value* out) {
  files::check(info.error(), "reading a tensor's shape");
  out->tag = 1;
  out->dtype = static_cast<int32_t>(info->scalar_type());
  out->rank = static_cast<int64_t>(info->sizes().size());
  if (out->rank > kMaxRank) throw std::runtime_error("a tensor of rank above 16");
  for (int64_t d = 0; d < out->rank; ++d) out->sizes[d] = info->sizes()[d];
}

}  // namespace
}  // namespace emlx

extern "C" {
#define EMLX_API __attribute__((visibility("default")))

// A program from the file at `path` (mapped), or from `size` bytes at `data`
// (copied); `*bad` is set to 1 when it is not a sound program file.
EMLX_API void* emlx_program_load(const char* path, const uint8_t* data, uint64_t size, int* bad) {
  static std::once_flag init;
  std::call_once(init, [] { executorch::runtime::runtime_init(); });
  return emlx::guarded<void*>(nullptr, [&]() -> void* {
    auto p = std::make_unique<emlx::ProgramHandle>();
    if (path) {
      p->file.emplace(path);
    } else {
      p->file.emplace(data, static_cast<size_t>(size));
    }
    return p.release();
  }, bad);
}

// The weights file (.ptd) the methods loaded from now on take their weights from.
EMLX_API int emlx_program_use_data(void* program, const char* path, int* bad) {
  return emlx::guarded<int>(1, [&] {
    auto& p = *static_cast<emlx::ProgramHandle*>(program);
    p.data.reset();
    p.data.emplace(path);
    return 0;
  }, bad);
}

// Frees a program after all its methods.
EMLX_API void emlx_program_free(void* program) { delete static_cast<emlx::ProgramHandle*>(program); }

EMLX_API int64_t emlx_program_method_count(void* program) {
  return static_cast<int64_t>(static_cast<emlx::ProgramHandle*>(program)->file->program().num_methods());
}

// The name of method `i` (NULL past the end).
EMLX_API const char* emlx_program_method_name(void* program, int64_t i) {
  auto name = static_cast<emlx::ProgramHandle*>(program)->file->program().get_method_name(static_cast<size_t>(i));
  return name.ok() ? name.get() : nullptr;
}

EMLX_API void* emlx_method_load(void* program, const char* name) {
  return emlx::guarded<void*>(nullptr, [&]() -> void* {
    return new emlx::MethodHandle(*static_cast<emlx::ProgramHandle*>(program), name);
  });
}

EMLX_API void emlx_method_free(void* method) { delete static_cast<emlx::MethodHandle*>(method); }

EMLX_API int64_t emlx_method_inputs(void* method) {
  return static_cast<int64_t>(static_cast<emlx::MethodHandle*>(method)->loaded.method->inputs_size());
}

EMLX_API int64_t emlx_method_outputs(void* method) {
  return static_cast<int64_t>(static_cast<emlx::MethodHandle*>(method)->loaded.method->outputs_size());
}

// What input (`output` 0) or output (1) `i` takes: a tensor's dtype and its
// exported shape (for a dynamic dimension, its upper bound); tag 0 for another kind.
EMLX_API int emlx_method_meta(void* method, int output, int64_t i, emlx::Value* out) {
  return emlx::guarded<int>(1, [&] {
    const auto meta = static_cast<emlx::MethodHandle*>(method)->loaded.method->method_meta();
    auto tag = output ? meta.output_tag(static_cast<size_t>(i)) : meta.input_tag(static_cast<size_t>(i));
    emlx::files::check(tag.error(), "reading a method's signature");
    *out = {};
    if (tag.get() == executorch::runtime::Tag::Tensor) {
      emlx::describe(output ? meta.output_tensor_meta(static_cast<size_t>(i))
                            : meta.input_tensor_meta(static_cast<size_t>(i)), out);
    }
    return 0;
  });
}

// Runs the method on `count` tensor inputs (their data is copied in, or read
// during the call); its outputs stay readable until the next call.
EMLX_API int emlx_method_execute(void* method, int64_t count, const emlx::Value* inputs) {
  return emlx::guarded<int>(1, [&] {
    auto& m = *static_cast<emlx::MethodHandle*>(method)->loaded.method;
    if (count != static_cast<int64_t>(m.inputs_size())) {
      throw std::runtime_error("the method takes " + std::to_string(m.inputs_size()) + " inputs, not " +
                               std::to_string(count));
    }
    std::vector<executorch::extension::TensorPtr> held;
    for (int64_t i = 0; i < count; ++i) {
      const auto& v = inputs[i];
      std::vector<executorch::aten::SizesType> sizes(v.sizes, v.sizes + v.rank);
      held.push_back(executorch::extension::from_blob(const_cast<void*>(v.data), std::move(sizes),
                                                      static_cast<executorch::aten::ScalarType>(v.dtype)));
      emlx::files::check(m.set_input(executorch::runtime::EValue(*held.back()), static_cast<size_t>(i)),
                         "input " + std::to_string(i));
    }
    emlx::files::check(m.execute(), "the program");
    return 0;
  });
}

// Bytes MLX holds in this process now: every program's weights, state and
// values alive (MLX's allocator; what the loader packs takes less).
EMLX_API int64_t emlx_active_memory() { return static_cast<int64_t>(mlx::core::get_active_memory()); }

// Output `i` of the last call: a tensor points into the method's memory.
EMLX_API int emlx_method_output(void* method, int64_t i, emlx::Value* out) {
  return emlx::guarded<int>(1, [&] {
    const auto& m = *static_cast<emlx::MethodHandle*>(method)->loaded.method;
    if (i < 0 || i >= static_cast<int64_t>(m.outputs_size())) {  // (get_output would abort)
      throw std::out_of_range("output " + std::to_string(i) + " of " + std::to_string(m.outputs_size()));
    }
    const auto& v = m.get_output(static_cast<size_t>(i));
    *out = {};
    if (v.isTensor()) {
      const auto& t = v.toTensor();
      out->tag = 1;
      out->dtype = static_cast<int32_t>(t.scalar_type());
      out->rank = t.dim();
      if (out->rank > emlx::kMaxRank) throw std::runtime_error("an output of rank above 16");
      for (int64_t d = 0; d < out->rank; ++d) out->sizes[d] = t.size(d);
      out->data = t.const_data_ptr();
      out->nbytes = static_cast<int64_t>(t.nbytes());
    } else if (v.isInt()) {
      out->tag = 2, out->integer = v.toInt();
    } else if (v.isDouble()) {
      out->tag = 3, out->real = v.toDouble();
    } else if (v.isBool()) {
      out->tag = 4, out->integer = v.toBool();
    } else if (v.isString()) {
      const auto s = v.toString();
      out->tag = 5, out->data = s.data(), out->nbytes = static_cast<int64_t>(s.size());
    } else if (!v.isNone()) {
      throw std::runtime_error("output " + std::to_string(i) + " is of a kind this runner does not read");
    }
    return 0;
  });
}
}
