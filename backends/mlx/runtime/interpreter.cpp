#include "interpreter.h"

#include <executorch/runtime/core/freeable_buffer.h>
#include <executorch/runtime/core/named_data_map.h>

#include <flatbuffers/flatbuffers.h>
#include <mlx/scheduler.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <utility>

#include "checks.h"
#include "dtype.h"
#include "kernels/cpu_kernel.h"
#include "kernels/packed_floats.h"
#include "kernels/quantized_dot.h"
#include "kernels/thread_pool.h"
#include "memory_budget.h"
#include "weight_arena.h"

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

// MLX streams belong to threads: an array can only be evaluated in the thread
// whose stream it was made on ("There is no Stream(cpu, 0) in current
// thread"). So every array a Program keeps between calls is evaluated (it then
// has no stream), and each calling thread builds on a stream of its own.
void use_thread_stream() {
  const auto device = mx::default_device();
  if (!mx::peek_default_stream(device)) mx::set_default_stream(mx::new_stream(device));
}

// Live programs with mutable state, for reset_all_state().
std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::set<Program*>& stateful_programs() {
  static std::set<Program*> s;
  return s;
}
// Snapshots by id: each program's state then (under registry_mutex).
std::map<uint64_t, std::map<const Program*, std::vector<mx::array>>>& state_snapshots() {
  static std::map<uint64_t, std::map<const Program*, std::vector<mx::array>>> s;
  return s;
}

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

mx::ShapeElem checked_dim(int64_t d) {
  if (d < 0 || d > std::numeric_limits<mx::ShapeElem>::max()) {
    throw std::invalid_argument("dimension " + std::to_string(d) + " outside [0, " +
                                std::to_string(std::numeric_limits<mx::ShapeElem>::max()) + "]");
  }
  return static_cast<mx::ShapeElem>(d);
}

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
  for (auto* d : *dims) s.push_back(checked_dim(resolve_int(d)));
  return s;
}

int64_t Interpreter::resolve_int(const ir::IntOrSlot* d) const {
  if (d->slot() < 0) return d->value();
  const auto& v = at(static_cast<uint32_t>(d->slot()));
  if (v.ndim() != 0 || !mx::issubdtype(v.dtype(), mx::integer)) {
    throw std::invalid_argument(slot_str(d->slot()) + " is not a 0-d integer size");
  }
  // SymIntNode values are computed on the host and already available;
  // anything else is evaluated here, a host synchronisation.
  auto i = mx::astype(v, mx::int64);
  i.eval();
  return i.item<int64_t>();
}

int64_t Interpreter::symbol(int64_t i) const {
  if (i < 0 || i >= static_cast<int64_t>(symbols_.size())) {
    throw std::invalid_argument("symbol " + std::to_string(i) + " out of range");
  }
  return symbols_[i];
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

#include "generated/op_dispatch.inc"

void Interpreter::set(uint32_t slot, mx::array a) {
  if (slot >= values_.size()) throw std::invalid_argument(slot_str(slot) + " out of range");
  check_size(a);
  if (node_ >= 0) {
    // A node output: alive (allocated when evaluated) until its last reader.
    live_bytes_ -= counted_[slot];
    counted_[slot] = a.nbytes();
    live_bytes_ += counted_[slot];
    if (liveness_.state_bytes + live_bytes_ > liveness_.budget) {
      throw std::invalid_argument(
          "values alive at once reach " + format_bytes(liveness_.state_bytes + live_bytes_) + " (this output: " +
          format_bytes(a.nbytes()) + "), over the memory budget of " + format_bytes(liveness_.budget) +
          " (set EMLX_MEMORY_BUDGET or the backend option memory_budget_kib)");
    }
  }
  values_[slot] = std::move(a);
}

void Interpreter::run_node(uint32_t i, const ir::Node* node) {
  node_ = i;
  try {
    execute_node(*this, node);
  } catch (const std::exception& e) {
    std::vector<int64_t> reads, writes;
    const char* name = node_refs(node, reads, writes);
    throw std::invalid_argument("node " + std::to_string(i) + " (" + (name ? name : "?") + "): " + e.what());
  }
  for (uint32_t slot : liveness_.dies_after[i]) {
    live_bytes_ -= counted_[slot];
    counted_[slot] = 0;
    values_[slot].reset();
  }
  node_ = -1;
}

void Interpreter::set(const ir::Tid* t, mx::array a) {
  if (!t) throw std::invalid_argument("missing output reference");
  set(t->idx(), std::move(a));
}

Program::Program(const void* data, size_t size, const NamedDataMap* named_data, size_t memory_budget) {
  verify(data, size);
  liveness_.budget = memory_budget;
  plan_liveness();
  try {
    use_thread_stream();
    for (auto* lit : *graph_->literals()) literals_.emplace_back(lit->slot(), scalar_literal(lit));
    load_constants(named_data);
    tile_quantized_weights();
    // Build the graph once on zero inputs (nothing is evaluated) so that
    // shape and type errors surface at load time, not on the first call.
    // Dynamic dimensions take their smallest non-empty size.
    std::vector<int64_t> symbols;
    for (auto* sym : *graph_->symbols()) symbols.push_back(std::max<int64_t>(sym->min(), 1));
    std::vector<mx::array> probe;
    for (auto* io : *graph_->inputs()) {
      mx::Shape shape;
      for (auto* d : *io->shape()) {
        shape.push_back(checked_dim(d->symbol() < 0 ? d->size() : symbols[d->symbol()]));
      }
      probe.push_back(mx::zeros(shape, to_mlx_dtype(io->dtype())));
    }
    std::lock_guard<std::mutex> lock(mlx_mutex());
    // Kept between calls, which may come from other threads: evaluated now.
    // (Zero initial values are not: evaluated zeros take the cache's size;
    // initial_value() makes them afresh in the calling thread.)
    std::vector<mx::array> kept;
    for (auto& [slot, arr] : literals_) kept.push_back(arr);
    mx::eval(kept);
    Interpreter st(graph_->num_values(), symbols, liveness_, layouts_);
    for (size_t i = 0; i < buffer_initial_.size(); ++i) {
      st.set(graph_->mutable_buffers()->Get(i)->slot(), buffer_initial_[i]);
    }
    build(st, probe);
    for (size_t i = 0; i < buffer_initial_.size(); ++i) {
      const auto& upd = st.at(graph_->mutable_buffers()->Get(i)->update());
      if (upd.shape() != buffer_initial_[i].shape()) {
        throw ProgramError("mutable buffer " + std::to_string(i) + ": its update changes its shape");
      }
    }
    state_ = initial_state();
  } catch (const ProgramError&) {
    throw;
  } catch (const std::exception& e) {
    throw ProgramError(std::string("graph does not build: ") + e.what());
  }
  if (!state_.empty()) {
    std::lock_guard<std::mutex> lock(registry_mutex());
    stateful_programs().insert(this);
  }
}

Program::~Program() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  stateful_programs().erase(this);
  for (auto& [id, snapshot] : state_snapshots()) snapshot.erase(this);
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
  // Every slot worth having is written once, by a Tid of 4 bytes or more:
  // a blob cannot justify more slots than a quarter of its size (each run
  // allocates them all).
  if (n > kMaxValues || uint64_t{n} * sizeof(ir::Tid) > size) {
    throw ProgramError(std::to_string(n) + " value slots: more than a blob of " + std::to_string(size) +
                       " bytes can define");
  }
  if (!graph_->inputs() || !graph_->outputs() || !graph_->nodes() || !graph_->constants() ||
      !graph_->literals() || !graph_->symbols() || !graph_->mutable_buffers()) {
    throw ProgramError("graph is missing a required list");
  }
  std::vector<bool> defined(n, false);
  // Each slot is written once (so nodes are no more than slots).
  auto define = [&](int64_t slot, const char* what) {
    if (slot < 0 || slot >= n) throw ProgramError(std::string(what) + ": " + slot_str(slot) + " out of range");
    if (defined[slot]) throw ProgramError(std::string(what) + ": " + slot_str(slot) + " is written twice");
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
    if (!valid_dtype(b->dtype())) throw ProgramError("mutable buffer: invalid dtype");
    if (!b->shape()) throw ProgramError("mutable buffer has no shape");
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

void Program::plan_liveness() {
  const uint32_t n = graph_->num_values();
  auto* nodes = graph_->nodes();
  constexpr uint32_t kNever = UINT32_MAX;
  std::vector<uint32_t> last(n, kNever);  // the node that last writes or reads a node output
  std::vector<bool> produced(n, false);
  std::vector<int64_t> reads, writes;
  for (uint32_t i = 0; i < nodes->size(); ++i) {
    reads.clear();
    writes.clear();
    node_refs(nodes->Get(i), reads, writes);
    for (auto r : reads) last[r] = i;
    for (auto w : writes) {
      last[w] = i;
      produced[w] = true;
    }
  }
  for (auto* io : *graph_->outputs()) last[io->slot()] = kNever;
  for (auto* b : *graph_->mutable_buffers()) {
    last[b->update()] = kNever;
    produced[b->slot()] = true;  // (set by the run, not a node: let go of after its last reader all the same)
  }
  liveness_.dies_after.assign(nodes->size(), {});
  for (uint32_t s = 0; s < n; ++s) {
    if (produced[s] && last[s] != kNever) liveness_.dies_after[last[s]].push_back(s);
  }
  // Building a step's graph takes about a millisecond for an LLM (hundreds
  // of nodes): evaluating from each heavy node on, while the rest is built,
  // hides most of it behind the products (a tenth of a decode step).
  static const std::set<std::string> kHeavy = {
      "MatmulNode", "LinearNode", "QuantizedLinearNode", "GatherLinearNode", "GatherQuantizedLinearNode",
      "ScaledDotProductAttentionNode", "SsdScanNode", "SelectiveScanNode"};
  liveness_.evaluate_after.assign(nodes->size(), {});
  for (uint32_t i = 0; i < nodes->size(); ++i) {
    reads.clear();
    writes.clear();
    const char* name = node_refs(nodes->Get(i), reads, writes);
    if (name && kHeavy.count(name)) liveness_.evaluate_after[i].assign(writes.begin(), writes.end());
  }
  // The state, alive throughout: refused before it is allocated.
  for (auto* b : *graph_->mutable_buffers()) {
    size_t bytes = mx::size_of(to_mlx_dtype(b->dtype()));
    bool overflow = false;
    for (auto d : *b->shape()) overflow |= d < 0 || __builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes);
    if (overflow || __builtin_add_overflow(liveness_.state_bytes, bytes, &liveness_.state_bytes)) {
      throw ProgramError("mutable buffer: size overflows");
    }
  }
  if (liveness_.state_bytes > liveness_.budget) {
    throw ProgramError("mutable buffers of " + format_bytes(liveness_.state_bytes) + " exceed the memory budget of " +
                       format_bytes(liveness_.budget) + " (set EMLX_MEMORY_BUDGET or the backend option memory_budget_kib)");
  }
}

void Program::load_constants(const NamedDataMap* named_data) {
  auto* consts = graph_->constants();
  auto* buffers = graph_->mutable_buffers();
  bool needs_data = consts->size() > 0;
  for (auto* b : *buffers) needs_data |= !b->zero_initial();
  if (needs_data && !named_data) throw ProgramError("program has constants but no named data map was provided");
  // Each weight is read once into MLX-owned memory, and ExecuTorch's copy
  // (a file mapping, or a region of the program buffer) is released at once.
  // MLX's CPU allocator cannot wrap foreign memory: mx::array(pointer, ...)
  // would copy as well, while keeping the source mapped (twice the weights).
  // The byte size of `w`, refused when it overflows.
  auto checked_bytes = [](const char* name, const WeightSpec& w) {
    size_t nbytes = mx::size_of(w.dtype);
    for (auto d : w.shape) {
      if (__builtin_mul_overflow(nbytes, static_cast<size_t>(d), &nbytes)) {
        throw ProgramError(std::string("constant '") + name + "': size overflows");
      }
    }
    return nbytes;
  };
  auto fresh = [](const WeightSpec& w, size_t nbytes) {
    return mx::array(mx::allocator::malloc(nbytes), w.shape, w.dtype);
  };
  // use(the named data's bytes), which must be `bytes` long
  auto with_data = [&](const char* name, size_t bytes, const std::function<void(const void*)>& use) {
    auto data = named_data->get_data(name);
    if (!data.ok()) throw ProgramError(std::string("constant '") + name + "' not found in named data");
    FreeableBuffer buf = std::move(data.get());
    if (buf.size() != bytes) {
      throw ProgramError(std::string("constant '") + name + "' has " + std::to_string(buf.size()) +
                         " bytes, expected " + std::to_string(bytes));
    }
    if (bytes > 0) use(buf.data());
    buf.Free();
  };
  // `a` with the named data's bytes (which must be as many as it holds)
  auto read_into = [&](const char* name, mx::array a) {
    with_data(name, a.nbytes(), [&](const void* bytes) { std::memcpy(a.data<void>(), bytes, a.nbytes()); });
    return a;
  };
  // A float32 matrix [N, K] the loader packs (packed_floats.h).
  struct Packing {
    size_t N, K;
    bool narrow;
  };
  const std::set<uint32_t> to_pack = float32_matrices_to_pack();
  std::vector<WeightSpec> specs;
  std::vector<size_t> sizes;
  std::vector<std::optional<Packing>> packing(consts->size());  // none: stored as it is
  for (auto* c : *consts) {
    mx::Shape shape;
    if (c->shape()) {
      for (auto d : *c->shape()) shape.push_back(checked_dim(d));
    }
    specs.push_back({std::move(shape), to_mlx_dtype(c->dtype())});
    sizes.push_back(checked_bytes(c->name()->c_str(), specs.back()));
    const auto& matrix = specs.back().shape;
    if (!to_pack.count(c->slot()) || matrix.size() != 2) continue;
    // how it packs, from a sample of its rows (ExecuTorch maps the data: only their pages are read)
    const size_t N = matrix[0], K = matrix[1];
    std::optional<bool> narrow;
    with_data(c->name()->c_str(), sizes.back(),
              [&](const void* floats) { narrow = packing_of(static_cast<const float*>(floats), N, K); });
    if (!narrow) continue;
    packing[specs.size() - 1] = Packing{N, K, *narrow};
    specs.back() = {{matrix[0], checked_dim(packed_row_bytes(K, *narrow))}, mx::uint8};
    sizes.back() = checked_bytes(c->name()->c_str(), specs.back());
  }
  // On a CPU the weights share a few allocations, aligned and in huge pages
  // (weight_arena.h); elsewhere each is MLX's own allocation.
  auto room = mx::default_device() == mx::Device::cpu ? weight_arrays(specs) : std::vector<mx::array>{};
  for (size_t i = 0; i < consts->size(); ++i) {
    auto* c = consts->Get(i);
    auto a = room.empty() ? fresh(specs[i], sizes[i]) : room[i];
    if (const auto& p = packing[i]) {
      with_data(c->name()->c_str(), p->N * p->K * sizeof(float), [&](const void* floats) {
        layouts_.packed.emplace(c->slot(),
                                pack_float32(static_cast<const float*>(floats), p->N, p->K, p->narrow, std::move(a)));
      });
      // The slot holds a stand-in of the matrix's shape and dtype, for the
      // nodes' checks: one NaN broadcast (evaluated now, as constants are),
      // never read (the two nodes read the packed matrix).
      auto stand_in = mx::broadcast_to(mx::array(std::numeric_limits<float>::quiet_NaN()),
                                       {static_cast<int>(p->N), static_cast<int>(p->K)});
      mx::eval(stand_in);
      constants_.emplace_back(c->slot(), std::move(stand_in));
      continue;
    }
    constants_.emplace_back(c->slot(), read_into(c->name()->c_str(), std::move(a)));
  }
  for (auto* b : *buffers) {
    mx::Shape shape;
    for (auto d : *b->shape()) shape.push_back(checked_dim(d));
    if (b->zero_initial()) {
      buffer_initial_.push_back(mx::zeros(shape, to_mlx_dtype(b->dtype())));
    } else {
      const WeightSpec w{std::move(shape), to_mlx_dtype(b->dtype())};
      buffer_initial_.push_back(read_into(b->initial()->c_str(), fresh(w, checked_bytes(b->initial()->c_str(), w))));
    }
  }
}

// The affine 4- and 8-bit matrices that QuantizedLinearNodes and
// GatherQuantizedLinearNodes with 8-bit activations read, in our CPU
// kernel's tiled layout (quantized_dot.h; an experts table's matrices each
// alone), rearranged in place: a decode step then reads each in one pass,
// and a prefill meets 16 rows at once. Only where that kernel runs (a CPU
// stream, CPU kernels not disabled), and only matrices no other node reads
// but a QuantizedEmbeddingNode (a tied embedding: it takes its rows from the
// tiles). The layers turn a tiled matrix back into rows for a call our
// kernel does not take.
void Program::tile_quantized_weights() {
  layouts_.tiled.assign(graph_->num_values(), false);
  if (!CpuKernel::serves(mx::default_stream(mx::default_device()))) return;
  std::map<uint32_t, mx::array*> constant;
  for (auto& [slot, a] : constants_) constant.emplace(slot, &a);
  struct Trio {
    uint32_t scales, biases;
    bool linear = false;  // read by a (Gather)QuantizedLinearNode, not only an embedding
  };
  std::map<uint32_t, Trio> trios;      // weight slot -> its scales and biases
  std::map<uint32_t, uint32_t> owner;  // scales or biases slot -> its weight
  std::set<uint32_t> kept;             // constants that stay in rows
  // A node reading (w, sc, bi) as its weight, scales and biases: each slot in one role, of one trio.
  auto claim = [&](uint32_t w, uint32_t sc, uint32_t bi, bool linear) {
    auto [at, added] = trios.emplace(w, Trio{sc, bi});
    if (!added && (at->second.scales != sc || at->second.biases != bi)) kept.insert(w);
    at->second.linear |= linear;
    for (uint32_t p : {sc, bi}) {
      auto [o, fresh] = owner.emplace(p, w);
      if (!fresh && o->second != w) kept.insert(p);
    }
    if (sc == bi) kept.insert(w);  // (a weight that is also scales or biases: the owner check below)
  };
  std::vector<int64_t> reads, writes;
  for (auto* node : *graph_->nodes()) {
    reads.clear();
    writes.clear();
    node_refs(node, reads, writes);
    const ir::Tid *w = nullptr, *sc = nullptr, *bi = nullptr;
    bool affine = false, linear = false;
    if (const auto* q = node->op_as_QuantizedLinearNode()) {
      w = q->weight(), sc = q->scales(), bi = q->biases(), linear = true;
      affine = q->mode() == ir::QuantMode::affine && (q->bits() == 4 || q->bits() == 8) && !q->float_activations();
    } else if (const auto* g = node->op_as_GatherQuantizedLinearNode()) {
      w = g->weight(), sc = g->scales(), bi = g->biases(), linear = true;
      affine = g->mode() == ir::QuantMode::affine && (g->bits() == 4 || g->bits() == 8) && !g->float_activations();
    } else if (const auto* e = node->op_as_QuantizedEmbeddingNode()) {
      w = e->weight(), sc = e->scales(), bi = e->biases();
      affine = e->mode() == ir::QuantMode::affine && (e->bits() == 4 || e->bits() == 8);
    }
    const bool takes = affine && w && sc && bi && constant.count(w->idx()) && constant.count(sc->idx()) &&
                       constant.count(bi->idx());
    for (auto r : reads) {
      if (!takes || (r != w->idx() && r != sc->idx() && r != bi->idx())) kept.insert(static_cast<uint32_t>(r));
    }
    if (takes) claim(w->idx(), sc->idx(), bi->idx(), linear);
  }
  for (auto* io : *graph_->outputs()) kept.insert(io->slot());
  for (auto& [w, trio] : trios) {
    if (!trio.linear || kept.count(w) || kept.count(trio.scales) || kept.count(trio.biases)) continue;
    if (trios.count(trio.scales) || trios.count(trio.biases) || owner.count(w)) continue;
    mx::array &weight = *constant[w], &scales = *constant[trio.scales], &biases = *constant[trio.biases];
    // [N, ...] or an experts table's [E, N, ...]; shapes the nodes would
    // refuse stay as they are (the nodes' own checks name them)
    const int rank = weight.ndim();
    if ((rank != 2 && rank != 3) || scales.ndim() != rank || scales.shape() != biases.shape() ||
        !std::equal(scales.shape().begin(), scales.shape().end() - 1, weight.shape().begin()) ||
        scales.dtype() != biases.dtype() || (scales.dtype() != mx::float32 && scales.dtype() != mx::bfloat16) ||
        (weight.dtype() != mx::uint32 && weight.dtype() != mx::int32) || weight.shape(-2) < 16) {
      continue;
    }
    const size_t matrices = rank == 3 ? weight.shape(0) : 1, N = weight.shape(-2), param = scales.itemsize();
    const size_t words = weight.shape(-1), groups = scales.shape(-1);
    for (size_t e = 0; e < matrices; ++e) {
      tile_in_place(weight.data<uint8_t>() + e * N * words * 4, N, words, 4);
      tile_in_place(scales.data<uint8_t>() + e * N * groups * param, N, groups, param);
      tile_in_place(biases.data<uint8_t>() + e * N * groups * param, N, groups, param);
    }
    layouts_.tiled[w] = layouts_.tiled[trio.scales] = layouts_.tiled[trio.biases] = true;
  }
}

std::set<uint32_t> Program::float32_matrices_to_pack() const {
  std::set<uint32_t> packable;
  if (!CpuKernel::serves(mx::default_stream(mx::default_device())) || !pack_float32_weights()) return packable;
  std::set<uint32_t> matrices, linear, other;
  for (auto* c : *graph_->constants()) {
    if (c->dtype() == ir::DType::float32 && c->shape() && c->shape()->size() == 2) matrices.insert(c->slot());
  }
  std::vector<int64_t> reads, writes;
  for (auto* node : *graph_->nodes()) {
    reads.clear();
    writes.clear();
    node_refs(node, reads, writes);
    // the slot each of the two reads a packed matrix in (once each)
    std::optional<uint32_t> weight, table;
    if (const auto* l = node->op_as_LinearNode()) weight = l->weight()->idx();
    if (const auto* t = node->op_as_TakeNode(); t && (t->axis() == 0 || t->axis() == -2)) table = t->a()->idx();
    for (auto r : reads) {
      const auto slot = static_cast<uint32_t>(r);
      if (weight == slot) {
        linear.insert(slot), weight.reset();
      } else if (table == slot) {
        table.reset();
      } else {
        other.insert(slot);
      }
    }
  }
  for (auto* io : *graph_->outputs()) other.insert(io->slot());
  for (uint32_t slot : linear) {
    if (matrices.count(slot) && !other.count(slot)) packable.insert(slot);
  }
  return packable;
}

mx::array Program::initial_value(size_t i) const {
  const auto& init = buffer_initial_[i];
  if (graph_->mutable_buffers()->Get(i)->zero_initial()) return mx::zeros(init.shape(), init.dtype());
  return mx::copy(init);
}

std::vector<mx::array> Program::initial_state() const {
  // Copies that own their memory: buffers are updated in place (donated)
  // during evaluation, and the initial values must survive that.
  std::vector<mx::array> state;
  for (size_t i = 0; i < buffer_initial_.size(); ++i) state.push_back(initial_value(i));
  mx::eval(state);
  return state;
}

void Program::reset_state() {
  std::lock_guard<std::mutex> lock(mlx_mutex());
  use_thread_stream();
  state_ = initial_state();
}

void reset_all_state() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (auto* p : stateful_programs()) p->reset_state();
}

std::vector<mx::array> Program::state() const {
  std::lock_guard<std::mutex> lock(mlx_mutex());
  return state_;
}

void Program::set_state(std::vector<mx::array> state) {
  std::lock_guard<std::mutex> lock(mlx_mutex());
  state_ = std::move(state);
}

namespace {
uint64_t next_snapshot_id() {
  static uint64_t next = 0;  // (under registry_mutex)
  return ++next;
}

// [start, stop) of row `row` of an array whose first axis is the rows.
std::pair<mx::Shape, mx::Shape> row_bounds(const mx::array& a, int64_t row) {
  mx::Shape start(a.ndim(), 0), stop = a.shape();
  start[0] = static_cast<int>(row), stop[0] = static_cast<int>(row + 1);
  return {start, stop};
}

// A copy of `a` in memory of its own. (MLX's copy of a contiguous array
// shares its buffer, which would keep the live cache from being updated in
// place: its next write would copy the whole cache.)
mx::array owned_copy(const mx::array& a) {
  mx::array src = a.flags().row_contiguous ? a : mx::contiguous(a);
  mx::eval(src);
  mx::array out(mx::allocator::malloc(src.nbytes()), src.shape(), src.dtype());
  if (src.nbytes() > 0) std::memcpy(out.data<char>(), src.data<char>(), src.nbytes());
  return out;
}

void check_rows(int64_t rows, std::initializer_list<int64_t> each) {
  for (int64_t r : each) {
    if (rows < 1 || r < 0 || r >= rows) {
      throw std::invalid_argument("row " + std::to_string(r) + " is not in [0, " + std::to_string(rows) + ")");
    }
  }
}
}  // namespace

uint64_t snapshot_all_state(size_t& bytes) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  const uint64_t id = next_snapshot_id();
  auto& snapshot = state_snapshots()[id];
  bytes = 0;
  for (auto* p : stateful_programs()) {
    snapshot[p] = p->state();
    bytes += p->state_bytes();
  }
  return id;
}

void restore_all_state(uint64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = state_snapshots().find(id);
  if (it == state_snapshots().end()) throw std::invalid_argument("no state snapshot " + std::to_string(id));
  for (auto* p : stateful_programs()) {
    auto held = it->second.find(p);
    if (held == it->second.end()) {
      p->reset_state();
    } else {
      p->set_state(held->second);
    }
  }
}

std::vector<mx::array> Program::row_state(int64_t row, int64_t rows, size_t& bytes) const {
  std::lock_guard<std::mutex> lock(mlx_mutex());
  use_thread_stream();
  std::vector<mx::array> held;
  for (const auto& live : state_) {
    if (live.ndim() < 1 || live.shape(0) != rows) {
      held.push_back(mx::array(0.0f));  // (not a row buffer: nothing kept)
      continue;
    }
    auto [start, stop] = row_bounds(live, row);
    held.push_back(owned_copy(mx::slice(live, start, stop)));  // (the live row changes on)
    bytes += held.back().nbytes();
  }
  return held;
}

void Program::copy_row(const std::vector<mx::array>& held, int64_t to, int64_t rows) {
  std::lock_guard<std::mutex> lock(mlx_mutex());
  use_thread_stream();
  if (held.size() != state_.size()) throw std::invalid_argument("the snapshot is not this program's state");
  for (size_t i = 0; i < state_.size(); ++i) {
    if (state_[i].ndim() < 1 || state_[i].shape(0) != rows) continue;
    auto [start, stop] = row_bounds(state_[i], to);
    mx::Shape one = state_[i].shape();
    one[0] = 1;
    if (held[i].shape() != one) continue;
    const mx::array live = state_[i];
    state_[i] = mx::slice_update(live, held[i], start, stop);
  }  // (`live` gone: the update alone holds the old buffer, so MLX writes the row in place)
  mx::eval(state_);
}

uint64_t snapshot_state_row(int64_t row, int64_t rows, size_t& bytes) {
  check_rows(rows, {row});
  std::lock_guard<std::mutex> lock(registry_mutex());
  const uint64_t id = next_snapshot_id();
  auto& snapshot = state_snapshots()[id];
  bytes = 0;
  for (auto* p : stateful_programs()) snapshot[p] = p->row_state(row, rows, bytes);
  return id;
}

void copy_state_row(uint64_t id, int64_t to, int64_t rows) {
  check_rows(rows, {to});
  std::lock_guard<std::mutex> lock(registry_mutex());
  auto it = state_snapshots().find(id);
  if (it == state_snapshots().end()) throw std::invalid_argument("no state snapshot " + std::to_string(id));
  for (auto* p : stateful_programs()) {
    auto held = it->second.find(p);
    if (held != it->second.end()) p->copy_row(held->second, to, rows);
  }
}

void drop_state_snapshot(uint64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex());
  state_snapshots().erase(id);
}

namespace {

// On the CPU, a task queued after the graph's tasks so far: once it has run,
// so have they (the stream's one thread runs its tasks in order). Waiting on
// it with help_until, the builder runs kernel items meanwhile rather than
// sleep; nullptr on other devices. With `more` (the graph is still being
// built) the stream thread lingers for the next batch (thread_pool.h).
using Done = std::shared_ptr<std::atomic<bool>>;
Done queued_so_far(bool more) {
  if (mx::default_device() != mx::Device::cpu) return nullptr;
  auto done = std::make_shared<std::atomic<bool>>(false);
  const uint64_t seen = dispatches();
  mx::scheduler::enqueue(mx::default_stream(mx::default_device()), [done, more, seen] {
    note_kernel_cpu();
    done->store(true, std::memory_order_release);
    wake_helpers();
    more ? linger(seen) : read_ahead_until_dispatch(seen);
  });
  return done;
}

void wait_helping(const Done& done) {
  help_until([&] { return done->load(std::memory_order_acquire); });
}

}  // namespace

void Program::build(Interpreter& st, const std::vector<mx::array>& inputs,
                    const std::function<void()>* evaluating) const {
  for (auto& [slot, arr] : constants_) st.set(slot, arr);
  for (auto& [slot, arr] : literals_) st.set(slot, arr);
  auto* ins = graph_->inputs();
  for (uint32_t i = 0; i < ins->size(); ++i) st.set(ins->Get(i)->slot(), inputs[i]);
  auto* nodes = graph_->nodes();
  bool started = false;
  // An array of each of the last two batches handed to MLX. Its eval lets at
  // most 10 tasks (of 10 dispatches, a node one or two) wait, and past that
  // the builder sleeps and wakes at the end of every task: dozens of times a
  // decode step, each wake-up taking a core from the products. Once a few
  // tasks wait, the builder instead waits once, until the batch before
  // last is done (the stream thread meanwhile runs the last one); on the
  // CPU it runs kernel items meanwhile.
  std::optional<mx::array> older, newer;
  Done older_done, newer_done;
  constexpr int kQueued = 4;
  for (uint32_t i = 0; i < nodes->size(); ++i) {
    st.run_node(i, nodes->Get(i));
    if (!evaluating || liveness_.evaluate_after[i].empty()) continue;
    std::vector<mx::array> written;
    for (auto slot : liveness_.evaluate_after[i]) {
      if (const auto* a = st.find(slot)) written.push_back(*a);
    }
    if (written.empty()) continue;
    if (!started) (*evaluating)();
    started = true;
    if (older && mx::scheduler::n_active_tasks() > kQueued) older_done ? wait_helping(older_done) : older->wait();
    mx::async_eval(written);
    step_aside();
    older = std::move(newer);
    newer = written[0];
    older_done = std::move(newer_done);
    newer_done = queued_so_far(true);
  }
}

void Program::reset_after_failure(const std::string& reason) {
  // The old state may be partly overwritten. The reason is kept even when
  // the reset fails as well.
  try {
    state_ = initial_state();
  } catch (const std::exception& again) {
    throw std::runtime_error(reason + "; resetting the program's state (KV cache) failed too: " + again.what());
  }
  throw std::runtime_error(reason + "; the program's state (KV cache) was reset");
}

std::vector<mx::array> Program::run(const std::vector<mx::array>& inputs, const std::vector<int64_t>& symbols) {
  std::lock_guard<std::mutex> lock(mlx_mutex());
  use_thread_stream();
  const KeptApart apart;
  auto* buffers = graph_->mutable_buffers();
  std::vector<mx::array> outs, updates;
  {
    Interpreter st(graph_->num_values(), symbols, liveness_, layouts_);
    // The state moves into the slot table, which lets go of it after its
    // last reader: the graph then holds the only reference, so MLX updates
    // it in place. Until evaluation starts, `untouched` keeps it for a build
    // that fails.
    std::vector<mx::array> untouched = state_;
    bool evaluated = false;
    const std::function<void()> evaluating = [&] {
      untouched.clear();
      evaluated = true;
    };
    for (uint32_t i = 0; i < state_.size(); ++i) st.set(buffers->Get(i)->slot(), std::move(state_[i]));
    try {
      build(st, inputs, &evaluating);
      for (auto* io : *graph_->outputs()) {
        auto a = st.at(io->slot());
        auto want = to_mlx_dtype(io->dtype());
        if (a.dtype() != want) a = mx::astype(a, want);
        outs.push_back(mx::contiguous(a));
      }
      for (uint32_t i = 0; i < state_.size(); ++i) {
        auto u = st.at(buffers->Get(i)->update());
        if (u.dtype() != buffer_initial_[i].dtype()) u = mx::astype(u, buffer_initial_[i].dtype());
        updates.push_back(std::move(u));
      }
    } catch (const std::exception& e) {
      if (!evaluated) {  // nothing ran: the state goes back untouched
        state_ = std::move(untouched);
        throw;
      }
      // Part of the graph was evaluated and may have updated the state in place.
      reset_after_failure(std::string("building the graph failed: ") + e.what());
    }
  }
  // The slot table is gone: intermediates are referenced by the graph alone,
  // so MLX can reuse (donate) their buffers during evaluation instead of
  // allocating fresh memory for every node. Inputs stay referenced by the
  // caller and constants by this Program, so their memory is never donated.
  std::vector<mx::array> all = outs;
  all.insert(all.end(), updates.begin(), updates.end());
  try {
    mx::async_eval(all);
    if (auto done = queued_so_far(false)) {
      wait_helping(done);
      remember_stream_thread();
    }
    mx::eval(all);  // (done by now on the CPU: this reports a failure)
  } catch (const std::exception& e) {
    reset_after_failure(std::string("evaluation failed: ") + e.what());
  }
  for (uint32_t i = 0; i < state_.size(); ++i) state_[i] = std::move(updates[i]);
  return outs;
}

}  // namespace emlx
