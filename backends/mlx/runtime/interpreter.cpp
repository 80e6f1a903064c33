#include "interpreter.h"

#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/named_data_map.h>

#include <flatbuffers/flatbuffers.h>

#include <string>

#include "dtype.h"

namespace emlx {

namespace mx = mlx::core;
using executorch::runtime::FreeableBuffer;
using executorch::runtime::NamedDataMap;

namespace {
// Upper bound on value slots, so a corrupt count cannot exhaust memory.
constexpr uint32_t kMaxValues = 1u << 24;
thread_local std::string g_last_error;

// MLX's default streams and scheduler are process-wide; graph building and
// evaluation from several threads is serialized here so that independent
// programs can be used from independent threads.
std::mutex& mlx_mutex() {
  static std::mutex m;
  return m;
}

std::string slot_str(int64_t s) { return "value slot " + std::to_string(s); }

mx::array scalar_literal(const ir::Literal* lit) {
  auto dtype = to_mlx_dtype(lit->dtype());
  if (mx::issubdtype(dtype, mx::floating)) {
    return mx::astype(mx::array(lit->float_value()), dtype);
  }
  if (dtype == mx::uint64) {
    return mx::array(static_cast<uint64_t>(lit->int_value()));
  }
  if (dtype == mx::bool_) {
    return mx::array(lit->int_value() != 0);
  }
  return mx::astype(mx::array(static_cast<int64_t>(lit->int_value())), dtype);
}
}  // namespace

void set_last_error(const std::string& msg) { g_last_error = msg; }
const std::string& last_error() { return g_last_error; }

std::vector<int> to_ints(const flatbuffers::Vector<int32_t>* v) {
  return v ? std::vector<int>(v->begin(), v->end()) : std::vector<int>{};
}

mx::Shape to_shape(const flatbuffers::Vector<int32_t>* v) {
  mx::Shape s;
  if (v) {
    for (auto x : *v) s.push_back(x);
  }
  return s;
}

const mx::array& Interpreter::at(uint32_t slot) const {
  if (slot >= values_.size() || !values_[slot]) {
    throw std::invalid_argument(slot_str(slot) + " read before it was written");
  }
  return *values_[slot];
}

const mx::array& Interpreter::get(const ir::Tid* t) const {
  if (!t) throw std::invalid_argument("missing required value reference");
  return at(t->idx());
}

std::optional<mx::array> Interpreter::get_optional(const ir::Tid* t) const {
  if (!t) return std::nullopt;
  return at(t->idx());
}

std::vector<mx::array> Interpreter::get_list(const flatbuffers::Vector<const ir::Tid*>* ts) const {
  std::vector<mx::array> out;
  for (auto* t : *ts) out.push_back(get(t));
  return out;
}

mx::Shape Interpreter::resolve_shape(const flatbuffers::Vector<const ir::IntOrSlot*>* dims) const {
  mx::Shape s;
  for (auto* d : *dims) {
    if (d->slot() < 0) {
      s.push_back(static_cast<mx::ShapeElem>(d->value()));
    } else {
      // A run-time dimension: reading it is a host synchronisation.
      auto v = mx::astype(at(static_cast<uint32_t>(d->slot())), mx::int64);
      v.eval();
      s.push_back(static_cast<mx::ShapeElem>(v.item<int64_t>()));
    }
  }
  return s;
}

namespace {
// Shapes are known when a node is built, before anything is evaluated:
// refuse values that could not be allocated (a corrupt or hostile blob)
// instead of letting MLX's allocator fail mid-evaluation.
void check_size(const mx::array& a) {
  size_t bytes = mx::size_of(a.dtype());
  for (auto d : a.shape()) {
    if (d < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes)) {
      throw std::invalid_argument("a value's size overflows");
    }
  }
  if (bytes > mx::get_memory_limit()) {
    throw std::invalid_argument("a value of " + std::to_string(bytes) + " bytes exceeds MLX's memory limit (" +
                                std::to_string(mx::get_memory_limit()) + " bytes)");
  }
}
}  // namespace

void Interpreter::set(uint32_t slot, mx::array a) {
  if (slot >= values_.size()) throw std::invalid_argument(slot_str(slot) + " out of range");
  check_size(a);
  values_[slot] = std::move(a);
}

void Interpreter::set(const ir::Tid* t, mx::array a) {
  if (!t) throw std::invalid_argument("missing output reference");
  set(t->idx(), std::move(a));
}

#include "generated/op_dispatch.inc"

Program::Program(const void* data, size_t size, const NamedDataMap* named_data) {
  verify(data, size);
  try {
    for (auto* lit : *graph_->literals()) literals_.emplace_back(lit->slot(), scalar_literal(lit));
    load_constants(named_data);
    // Build the graph once on zero inputs (nothing is evaluated) so that
    // shape and type errors surface at load time, not on the first call.
    std::vector<mx::array> probe;
    for (auto* io : *graph_->inputs()) {
      mx::Shape shape;
      for (auto* d : *io->shape()) {
        shape.push_back(static_cast<mx::ShapeElem>(
            d->symbol() < 0 ? d->size() : graph_->symbols()->Get(d->symbol())->min()));
      }
      probe.push_back(mx::zeros(shape, to_mlx_dtype(io->dtype())));
    }
    std::lock_guard<std::mutex> lock(mlx_mutex());
    Interpreter st(graph_->num_values());
    build(st, probe);
  } catch (const ProgramError&) {
    throw;
  } catch (const std::exception& e) {
    throw ProgramError(std::string("graph does not build: ") + e.what());
  }
}

void Program::verify(const void* data, size_t size) {
  auto* bytes = static_cast<const uint8_t*>(data);
  if (size < 8) throw ProgramError("blob too small (" + std::to_string(size) + " bytes)");
  if (!flatbuffers::BufferHasIdentifier(bytes, kFileIdentifier)) {
    throw ProgramError(std::string("wrong file identifier (expected ") + kFileIdentifier + ")");
  }
  flatbuffers::Verifier verifier(bytes, size);
  if (!ir::VerifyGraphBuffer(verifier)) throw ProgramError("FlatBuffers verification failed");
  graph_ = ir::GetGraph(bytes);
  if (graph_->version() > kSchemaVersion) {
    throw ProgramError("blob schema version " + std::to_string(graph_->version()) +
                       " is newer than this runtime supports (" + std::to_string(kSchemaVersion) +
                       "); upgrade executorch-mlx");
  }
  const uint32_t n = graph_->num_values();
  if (n > kMaxValues) throw ProgramError("too many value slots: " + std::to_string(n));
  if (!graph_->inputs() || !graph_->outputs() || !graph_->nodes() || !graph_->constants() ||
      !graph_->literals() || !graph_->symbols() || !graph_->mutable_buffers()) {
    throw ProgramError("graph is missing a required list");
  }
  std::vector<bool> defined(n, false);
  auto define = [&](int64_t slot, const char* what) {
    if (slot < 0 || slot >= n) throw ProgramError(std::string(what) + ": " + slot_str(slot) + " out of range");
    defined[slot] = true;
  };
  auto check_dims = [&](const flatbuffers::Vector<const ir::Dim*>* dims, const char* what) {
    if (!dims) throw ProgramError(std::string(what) + " has no shape");
    for (auto* d : *dims) {
      if (d->symbol() >= static_cast<int32_t>(graph_->symbols()->size())) {
        throw ProgramError(std::string(what) + ": symbol " + std::to_string(d->symbol()) + " out of range");
      }
      if (d->symbol() < 0 && d->size() < 0) throw ProgramError(std::string(what) + ": negative dimension");
    }
  };
  for (auto* io : *graph_->inputs()) {
    define(io->slot(), "input");
    if (!valid_dtype(io->dtype())) throw ProgramError("input: invalid dtype");
    check_dims(io->shape(), "input");
  }
  for (auto* c : *graph_->constants()) {
    define(c->slot(), "constant");
    if (!valid_dtype(c->dtype())) throw ProgramError("constant: invalid dtype");
  }
  for (auto* l : *graph_->literals()) {
    define(l->slot(), "literal");
    if (!valid_dtype(l->dtype())) throw ProgramError("literal: invalid dtype");
  }
  for (auto* b : *graph_->mutable_buffers()) {
    define(b->slot(), "mutable buffer");
    if (b->update() >= n) throw ProgramError("mutable buffer update: " + slot_str(b->update()) + " out of range");
  }
  std::vector<int64_t> reads, writes;
  for (uint32_t i = 0; i < graph_->nodes()->size(); ++i) {
    reads.clear();
    writes.clear();
    const char* name = node_refs(graph_->nodes()->Get(i), reads, writes);
    std::string where = "node " + std::to_string(i);
    if (!name) throw ProgramError(where + ": unknown op type (blob newer than this runtime?)");
    where += std::string(" (") + name + ")";
    for (auto r : reads) {
      if (r < 0 || r >= n) throw ProgramError(where + " reads " + slot_str(r) + ", out of range");
      if (!defined[r]) throw ProgramError(where + " reads " + slot_str(r) + " before it is written");
    }
    for (auto w : writes) define(w, where.c_str());
  }
  for (auto* io : *graph_->outputs()) {
    if (io->slot() >= n || !defined[io->slot()]) throw ProgramError("output " + slot_str(io->slot()) + " is never written");
    if (!valid_dtype(io->dtype()) || !to_et_dtype(io->dtype())) throw ProgramError("output: invalid dtype");
    check_dims(io->shape(), "output");
  }
  for (auto* b : *graph_->mutable_buffers()) {
    if (!defined[b->update()]) throw ProgramError("mutable buffer update " + slot_str(b->update()) + " is never written");
  }
}

void Program::load_constants(const NamedDataMap* named_data) {
  auto* consts = graph_->constants();
  auto* buffers = graph_->mutable_buffers();
  if ((consts->size() || buffers->size()) && !named_data) {
    throw ProgramError("program has constants but no named data map was provided");
  }
  auto load = [&](const char* name, ir::DType dtype, mx::Shape shape) {
    auto data = named_data->get_data(name);
    if (!data.ok()) throw ProgramError(std::string("constant '") + name + "' not found in named data");
    weight_buffers_.push_back(std::make_unique<FreeableBuffer>(std::move(data.get())));
    FreeableBuffer* buf = weight_buffers_.back().get();
    auto mdtype = to_mlx_dtype(dtype);
    size_t numel = 1;
    for (auto d : shape) numel *= static_cast<size_t>(d);
    if (buf->size() != numel * mx::size_of(mdtype)) {
      throw ProgramError(std::string("constant '") + name + "' has " + std::to_string(buf->size()) +
                         " bytes, expected " + std::to_string(numel * mx::size_of(mdtype)));
    }
    // Zero-copy: the buffer stays alive until the Program is destroyed.
    return mx::array(const_cast<void*>(buf->data()), std::move(shape), mdtype, [](void*) {});
  };
  for (auto* c : *consts) {
    mx::Shape shape;
    if (c->shape()) {
      for (auto d : *c->shape()) {
        if (d < 0) throw ProgramError("constant has a negative dimension");
        shape.push_back(static_cast<mx::ShapeElem>(d));
      }
    }
    constants_.emplace_back(c->slot(), load(c->name()->c_str(), c->dtype(), std::move(shape)));
  }
  if (buffers->size()) {
    throw ProgramError(std::string("mutable buffers (persistent state such as a KV cache) are not "
                                   "supported by this runtime yet ('") +
                       buffers->Get(0)->initial()->c_str() + "')");
  }
}

void Program::build(Interpreter& st, const std::vector<mx::array>& inputs) const {
  for (auto& [slot, arr] : constants_) st.set(slot, arr);
  for (auto& [slot, arr] : literals_) st.set(slot, arr);
  auto* ins = graph_->inputs();
  for (uint32_t i = 0; i < ins->size(); ++i) st.set(ins->Get(i)->slot(), inputs[i]);
  for (auto* node : *graph_->nodes()) execute_node(st, node);
}

std::vector<mx::array> Program::run(const std::vector<mx::array>& inputs) {
  std::lock_guard<std::mutex> lock(mlx_mutex());
  std::vector<mx::array> outs;
  {
    Interpreter st(graph_->num_values());
    build(st, inputs);
    for (auto* io : *graph_->outputs()) {
      auto a = st.at(io->slot());
      auto want = to_mlx_dtype(io->dtype());
      if (a.dtype() != want) a = mx::astype(a, want);
      outs.push_back(mx::contiguous(a));
    }
  }
  // The slot table is gone: intermediates are referenced by the graph alone,
  // so MLX can reuse (donate) their buffers during evaluation instead of
  // allocating fresh memory for every node. Inputs stay referenced by the
  // caller and constants by this Program, so their memory is never donated.
  mx::eval(outs);
  return outs;
}

}  // namespace emlx
