// Registers the MLX graph delegate with ExecuTorch's runtime.
#include <executorch/runtime/backend/interface.h>
#include <executorch/runtime/core/exec_aten/util/scalar_type_util.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>
#include <executorch/runtime/platform/log.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <variant>

#include "dtype.h"
#include "interpreter.h"
#include "memory_budget.h"

namespace emlx {

namespace mx = mlx::core;
namespace et = executorch::runtime;
using executorch::aten::Tensor;
using et::Error;

// The id programs are lowered for; must equal the Python BackendDetails
// class name (executorch_mlx.backend.MLXGraphBackend).
constexpr const char* kBackendId = "MLXGraphBackend";
// Backend option (int, KiB): the memory budget (memory_budget.h), process-wide
// through executorch::runtime::set_option (0 restores the default), or per
// program as a load-time runtime spec (Program::load_method's
// LoadBackendOptionsMap).
constexpr const char* kMemoryBudgetOption = "memory_budget_kib";

namespace {

struct Handle {
  explicit Handle(et::FreeableBuffer&& b) : blob(std::move(b)) {}
  et::FreeableBuffer blob;  // the Program points into it
  std::unique_ptr<Program> program;
};

// Messages can quote blob bytes (a corrupt constant name, say); ExecuTorch's
// Python bindings forward logs into Python, where invalid UTF-8 aborts the
// process. Keep messages printable ASCII.
std::string printable(const std::string& msg) {
  std::string out;
  for (unsigned char c : msg) {
    if (c >= 0x20 && c < 0x7f) {
      out += static_cast<char>(c);
    } else {
      static const char* hex = "0123456789abcdef";
      out += "\\x";
      out += hex[c >> 4];
      out += hex[c & 15];
    }
  }
  return out;
}

Error fail(Error code, const std::string& msg) {
  const std::string safe = printable(msg);
  set_last_error(safe);
  ET_LOG(Error, "%s: %s", kBackendId, safe.c_str());
  return code;
}

// Wraps input `i` as an MLX array after checking it against the program.
mx::array bind_input(const ir::IOValue* io, const et::EValue& v, size_t i,
                     std::vector<int64_t>& symbol_sizes, const ir::Graph& g) {
  const std::string which = "input " + std::to_string(i);
  switch (io->kind()) {
    case ir::IOKind::int_scalar:
      if (!v.isInt()) throw InputError(which + ": expected an int");
      return mx::array(static_cast<int64_t>(v.toInt()));
    case ir::IOKind::float_scalar:
      if (!v.isDouble()) throw InputError(which + ": expected a float");
      return mx::array(static_cast<float>(v.toDouble()));
    case ir::IOKind::bool_scalar:
      if (!v.isBool()) throw InputError(which + ": expected a bool");
      return mx::array(v.toBool());
    case ir::IOKind::tensor:
      break;
  }
  if (!v.isTensor()) throw InputError(which + ": expected a tensor");
  const Tensor& t = v.toTensor();
  if (t.scalar_type() != *to_et_dtype(io->dtype())) {
    throw InputError(which + ": dtype " + executorch::runtime::toString(t.scalar_type()) +
                     " does not match the program's " + ir::EnumNameDType(io->dtype()));
  }
  auto* dims = io->shape();
  if (static_cast<size_t>(t.dim()) != dims->size()) {
    throw InputError(which + ": rank " + std::to_string(t.dim()) + ", program expects " +
                     std::to_string(dims->size()));
  }
  mx::Shape shape;
  for (size_t d = 0; d < dims->size(); ++d) {
    const int64_t size = t.size(d);
    auto* dim = dims->Get(d);
    if (dim->symbol() < 0) {
      if (size != dim->size()) {
        throw InputError(which + ": dim " + std::to_string(d) + " is " + std::to_string(size) +
                         ", program expects " + std::to_string(dim->size()));
      }
    } else {
      auto* sym = g.symbols()->Get(dim->symbol());
      if (size < sym->min() || size > sym->max()) {
        throw InputError(which + ": dim " + std::to_string(d) + " is " + std::to_string(size) +
                         ", outside [" + std::to_string(sym->min()) + ", " + std::to_string(sym->max()) + "]");
      }
      int64_t& seen = symbol_sizes[dim->symbol()];
      if (seen >= 0 && seen != size) {
        throw InputError(which + ": dim " + std::to_string(d) + " must equal an earlier dim of the same symbol (" +
                         std::to_string(seen) + ")");
      }
      seen = size;
    }
    shape.push_back(static_cast<mx::ShapeElem>(size));
  }
  auto dtype = to_mlx_dtype(io->dtype());
  if (t.numel() == 0) return mx::zeros(shape, dtype);
  // Zero-copy: the tensor outlives this call, outputs are copied out after
  // evaluation, and the caller keeps this array referenced while MLX
  // evaluates, so MLX never reuses (overwrites) ExecuTorch's memory.
  return mx::array(const_cast<void*>(t.const_data_ptr()), shape, dtype, [](void*) {});
}

void write_output(const mx::array& a, et::EValue& v, size_t i) {
  const std::string which = "output " + std::to_string(i);
  if (!v.isTensor()) throw InputError(which + ": expected a tensor");
  Tensor& t = v.toTensor();
  std::vector<executorch::aten::SizesType> sizes(a.shape().begin(), a.shape().end());
  if (et::resize_tensor(t, {sizes.data(), sizes.size()}) != Error::Ok) {
    throw std::runtime_error(which + ": cannot resize to the computed shape");
  }
  if (t.nbytes() != a.nbytes()) throw std::runtime_error(which + ": size mismatch");
  if (a.nbytes()) std::memcpy(t.mutable_data_ptr(), a.data<void>(), a.nbytes());
}

class MLXGraphBackend final : public et::BackendInterface {
 public:
  bool is_available() const override { return true; }

  et::Result<et::DelegateHandle*> init(et::BackendInitContext& context, et::FreeableBuffer* processed,
                                       et::ArrayRef<et::CompileSpec>) const override {
    auto handle = std::make_unique<Handle>(std::move(*processed));
    try {
      auto spec = context.get_runtime_spec<int>(kMemoryBudgetOption);
      if (spec.ok() && *spec < 0) throw std::invalid_argument(std::string(kMemoryBudgetOption) + " is negative");
      const size_t budget = spec.ok() && *spec > 0 ? static_cast<size_t>(*spec) << 10 : memory_budget();
      handle->program = std::make_unique<Program>(handle->blob.data(), handle->blob.size(),
                                                  context.get_named_data_map(), budget);
    } catch (const std::exception& e) {
      return fail(Error::InvalidProgram, std::string("invalid program: ") + e.what());
    }
    return handle.release();
  }

  Error execute(et::BackendExecutionContext&, et::DelegateHandle* raw,
                et::Span<et::EValue*> args) const override {
    auto* handle = static_cast<Handle*>(raw);
    const ir::Graph& g = handle->program->graph();
    const size_t n_in = g.inputs()->size(), n_out = g.outputs()->size();
    if (args.size() != n_in + n_out) {
      return fail(Error::InvalidArgument, "expected " + std::to_string(n_in) + " inputs and " +
                                              std::to_string(n_out) + " outputs, got " +
                                              std::to_string(args.size()) + " arguments");
    }
    try {
      std::vector<int64_t> symbol_sizes(g.symbols()->size(), -1);
      std::vector<mx::array> inputs;
      for (size_t i = 0; i < n_in; ++i) {
        inputs.push_back(bind_input(g.inputs()->Get(i), *args[i], i, symbol_sizes, g));
      }
      auto outs = handle->program->run(inputs, symbol_sizes);
      for (size_t i = 0; i < n_out; ++i) write_output(outs[i], *args[n_in + i], i);
    } catch (const InputError& e) {
      return fail(Error::InvalidArgument, e.what());
    } catch (const std::exception& e) {
      return fail(Error::Internal, std::string("execution failed: ") + e.what());
    }
    return Error::Ok;
  }

  Error set_option(et::BackendOptionContext&, const et::Span<et::BackendOption>& options) override {
    for (auto& opt : options) {
      if (std::strcmp(opt.key, kMemoryBudgetOption) != 0) continue;
      auto* kib = std::get_if<int>(&opt.value);
      if (!kib || *kib < 0) return fail(Error::InvalidArgument, std::string(kMemoryBudgetOption) + ": expected an int >= 0");
      set_memory_budget(static_cast<size_t>(*kib) << 10);
    }
    return Error::Ok;
  }

  Error get_option(et::BackendOptionContext&, et::Span<et::BackendOption>& options) override {
    for (auto& opt : options) {
      if (std::strcmp(opt.key, kMemoryBudgetOption) != 0) continue;
      try {
        opt.value = static_cast<int>(std::min<size_t>(memory_budget() >> 10, INT32_MAX));
      } catch (const std::exception& e) {
        return fail(Error::InvalidArgument, e.what());
      }
    }
    return Error::Ok;
  }

  void destroy(et::DelegateHandle* raw) const override { delete static_cast<Handle*>(raw); }
};

MLXGraphBackend g_backend;
const Error g_registered = et::register_backend({kBackendId, &g_backend});

}  // namespace
}  // namespace emlx

extern "C" {
// For the Python package: the reason behind the last error on this thread.
__attribute__((visibility("default"))) const char* emlx_last_error() { return emlx::last_error().c_str(); }
__attribute__((visibility("default"))) void emlx_clear_last_error() { emlx::set_last_error(""); }
// Whether the static registration above succeeded.
__attribute__((visibility("default"))) int emlx_registered() { return emlx::g_registered == emlx::Error::Ok; }
__attribute__((visibility("default"))) const char* emlx_backend_id() { return emlx::kBackendId; }
// The memory budget of programs loaded from now on (memory_budget.h), in
// bytes; 0 restores the default. The getter returns 0 on failure (a
// malformed EMLX_MEMORY_BUDGET; reason in emlx_last_error).
__attribute__((visibility("default"))) void emlx_set_memory_budget(uint64_t bytes) {
  emlx::set_memory_budget(static_cast<size_t>(bytes));
}
__attribute__((visibility("default"))) uint64_t emlx_memory_budget() {
  try {
    return emlx::memory_budget();
  } catch (const std::exception& e) {
    emlx::set_last_error(e.what());
    return 0;
  }
}
// Snapshots the mutable state (KV caches) of every loaded program: its id
// (0 on failure, reason in emlx_last_error) and, in *bytes, its size.
__attribute__((visibility("default"))) uint64_t emlx_state_snapshot(uint64_t* bytes) {
  try {
    size_t size = 0;
    const uint64_t id = emlx::snapshot_all_state(size);
    *bytes = size;
    return id;
  } catch (const std::exception& e) {
    emlx::set_last_error(std::string("snapshot failed: ") + e.what());
    return 0;
  }
}
// Sets every loaded program's state back to snapshot `id` (programs loaded
// since: their initial state). Returns 0, or -1 (reason in emlx_last_error).
__attribute__((visibility("default"))) int emlx_state_restore(uint64_t id) {
  try {
    emlx::restore_all_state(id);
    return 0;
  } catch (const std::exception& e) {
    emlx::set_last_error(std::string("restore failed: ") + e.what());
    return -1;
  }
}
// A batched program's cache row (its buffers with `rows` rows): row `row`
// kept as a snapshot (its id, 0 on failure; its bytes in *bytes), and such
// a snapshot put back as row `to` (0, or -1; reason in emlx_last_error).
__attribute__((visibility("default"))) uint64_t emlx_state_snapshot_row(int64_t row, int64_t rows, uint64_t* bytes) {
  try {
    size_t size = 0;
    const uint64_t id = emlx::snapshot_state_row(row, rows, size);
    *bytes = size;
    return id;
  } catch (const std::exception& e) {
    emlx::set_last_error(std::string("row snapshot failed: ") + e.what());
    return 0;
  }
}
__attribute__((visibility("default"))) int emlx_state_copy_row(uint64_t id, int64_t to, int64_t rows) {
  try {
    emlx::copy_state_row(id, to, rows);
    return 0;
  } catch (const std::exception& e) {
    emlx::set_last_error(std::string("row copy failed: ") + e.what());
    return -1;
  }
}
// Forgets snapshot `id` (its memory is freed once no program uses it).
__attribute__((visibility("default"))) void emlx_state_drop(uint64_t id) { emlx::drop_state_snapshot(id); }
// Sets the mutable state (KV caches) of every loaded program back to its
// initial value. Returns 0, or -1 on failure (reason in emlx_last_error).
__attribute__((visibility("default"))) int emlx_reset_state() {
  try {
    emlx::reset_all_state();
    return 0;
  } catch (const std::exception& e) {
    emlx::set_last_error(std::string("reset failed: ") + e.what());
    return -1;
  }
}
}
