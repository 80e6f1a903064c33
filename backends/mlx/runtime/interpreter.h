// A verified, loaded delegate program and the interpreter that runs it.
#pragma once

#include <mlx/mlx.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <functional>
#include <optional>
#include <set>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

#include "generated/schema_generated.h"
#include "kernels/packed_floats.h"

#include <executorch/runtime/core/freeable_buffer.h>

namespace executorch::runtime {
class NamedDataMap;
}  // namespace executorch::runtime

namespace emlx {

// Raised for any defect of a program found while loading it.
struct ProgramError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Raised for inputs that do not match the program's signature.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A size as an MLX dimension; throws unless it lies in [0, INT32_MAX].
mlx::core::ShapeElem checked_dim(int64_t d);
std::vector<int> to_ints(const flatbuffers::Vector<int32_t>* v);
mlx::core::Shape to_shape(const flatbuffers::Vector<int32_t>* v);

// Which values a run holds at once, for the memory budget (memory_budget.h):
// computed once per program from the graph.
struct Liveness {
  // dies_after[i]: the slots node i writes or reads for the last time (not
  // graph outputs or buffer updates, which live to the end of the run): node
  // outputs and mutable buffers, let go of then, so that the graph holds
  // the only reference and MLX may reuse their memory in place.
  std::vector<std::vector<uint32_t>> dies_after;
  // evaluate_after[i]: the slots node i writes when it carries much of a
  // run's work (a matrix product, attention, a scan), else none: their
  // evaluation starts once it is built, while the rest of the graph is
  // still being built.
  std::vector<std::vector<uint32_t>> evaluate_after;
  size_t state_bytes = 0;  // the mutable buffers, alive throughout
  size_t budget = 0;
};

// Constants our CPU kernels read in layouts of their own, set at load.
struct ConstantLayouts {
  std::vector<bool> tiled;  // per slot: in the tiled layout (quantized_dot.h)
  // float32 matrices packed (packed_floats.h), by slot: only LinearNodes
  // and TakeNodes read them (their slots hold a stand-in)
  std::unordered_map<uint32_t, PackedFloats> packed;
};

// Value slots of one execution.
class Interpreter {
 public:
  Interpreter(uint32_t num_values, std::vector<int64_t> symbols, const Liveness& liveness,
              const ConstantLayouts& layouts)
      : values_(num_values),
        counted_(num_values, 0),
        symbols_(std::move(symbols)),
        liveness_(liveness),
        layouts_(layouts) {}

  const mlx::core::array& get(const ir::Tid* t) const;
  std::optional<mlx::core::array> get_optional(const ir::Tid* t) const;
  std::vector<mlx::core::array> get_list(const flatbuffers::Vector<const ir::Tid*>* ts) const;
  mlx::core::Shape resolve_shape(const flatbuffers::Vector<const ir::IntOrSlot*>* dims) const;
  int64_t resolve_int(const ir::IntOrSlot* d) const;
  void set(const ir::Tid* t, mlx::core::array a);
  void set(uint32_t slot, mlx::core::array a);
  const mlx::core::array& at(uint32_t slot) const;
  // The value in a slot, or null (unwritten, or let go of after its last reader).
  const mlx::core::array* find(uint32_t slot) const {
    return slot < values_.size() && values_[slot] ? &*values_[slot] : nullptr;
  }
  // The size of dynamic dimension `i` in this execution.
  int64_t symbol(int64_t i) const;
  // Whether `t` is a constant stored in the tiled layout (quantized_dot.h).
  bool tiled(const ir::Tid* t) const { return t && t->idx() < layouts_.tiled.size() && layouts_.tiled[t->idx()]; }
  // The packed float32 matrix `t` is (packed_floats.h), or null.
  const PackedFloats* packed(const ir::Tid* t) const {
    if (!t || layouts_.packed.empty()) return nullptr;
    auto it = layouts_.packed.find(t->idx());
    return it == layouts_.packed.end() ? nullptr : &it->second;
  }

  // Runs node `i`: what it writes counts against the memory budget until
  // its last reader has run. Errors name the node.
  void run_node(uint32_t i, const ir::Node* node);

 private:
  std::vector<std::optional<mlx::core::array>> values_;
  std::vector<size_t> counted_;  // bytes of each node output still alive
  std::vector<int64_t> symbols_;
  const Liveness& liveness_;
  const ConstantLayouts& layouts_;
  size_t live_bytes_ = 0;
  int64_t node_ = -1;  // the node running, or -1 while binding inputs
};

// A program after `load`: the blob is verified, every reference checked,
// and constants bound. Immutable afterwards.
class Program {
 public:
  // Verifies `data` (kept alive by the caller for the Program's lifetime)
  // and loads its constants from `named_data`. Every run (a dry run at load
  // included) may hold at most `memory_budget` bytes (memory_budget.h).
  // Throws ProgramError.
  Program(const void* data, size_t size, const executorch::runtime::NamedDataMap* named_data,
          size_t memory_budget);

  const ir::Graph& graph() const { return *graph_; }

  ~Program();

  // Runs the graph on `inputs` (one per graph input; ints/floats/bools as
  // 0-d arrays; `symbols` the sizes of the graph's dynamic dimensions) and
  // returns the evaluated, row-contiguous outputs. The caller's references
  // keep the inputs' memory from being reused by MLX. Mutable buffers take
  // their updated values.
  std::vector<mlx::core::array> run(const std::vector<mlx::core::array>& inputs,
                                    const std::vector<int64_t>& symbols);

  // Sets every mutable buffer back to its initial value (a new conversation).
  void reset_state();

  // The mutable buffers' current values, and setting them: references, not
  // copies (a run then updates a copy, as MLX donates only unshared buffers).
  std::vector<mlx::core::array> state() const;
  void set_state(std::vector<mlx::core::array> state);
  // Row `row` of every buffer with `rows` rows (a batched program's caches),
  // copied (adds their bytes to `bytes`); and such a row put back as row `to`
  // of the live state, in place.
  std::vector<mlx::core::array> row_state(int64_t row, int64_t rows, size_t& bytes) const;
  void copy_row(const std::vector<mlx::core::array>& held, int64_t to, int64_t rows);
  size_t state_bytes() const { return liveness_.state_bytes; }

 private:
  void verify(const void* data, size_t size);
  void plan_liveness();
  void load_constants(const executorch::runtime::NamedDataMap* named_data);
  void tile_quantized_weights();
  // The float32 constants to pack at load (packed_floats.h): matrices only
  // LinearNodes (as their weight) and TakeNodes (rows) read, one at least a
  // LinearNode; none where our CPU kernels do not run or packing is off.
  std::set<uint32_t> float32_matrices_to_pack() const;
  // Builds the graph on `inputs`. `evaluating`, when given, is called before
  // evaluation first starts (Liveness::evaluate_after) and it starts there;
  // otherwise nothing is evaluated.
  void build(Interpreter& st, const std::vector<mlx::core::array>& inputs,
             const std::function<void()>* evaluating = nullptr) const;
  // After a run failed part way: the state back to its initial value, and
  // a runtime_error saying `reason` and that (never returns).
  [[noreturn]] void reset_after_failure(const std::string& reason);
  // A fresh, unevaluated initial value of mutable buffer `i`, made on the
  // calling thread's stream.
  mlx::core::array initial_value(size_t i) const;
  // Fresh (writable, evaluated) initial values of the mutable buffers.
  std::vector<mlx::core::array> initial_state() const;

  const ir::Graph* graph_ = nullptr;
  Liveness liveness_;
  std::vector<std::pair<uint32_t, mlx::core::array>> constants_;
  ConstantLayouts layouts_;
  std::vector<std::pair<uint32_t, mlx::core::array>> literals_;
  // Initial values of the mutable buffers (loaded constants, evaluated; or
  // zeros, never evaluated: see initial_value)
  // and their current values, owned here between calls.
  std::vector<mlx::core::array> buffer_initial_;
  std::vector<mlx::core::array> state_;
};

// Resets the mutable state of every live Program in the process.
void reset_all_state();

// Snapshots of the mutable state of every live Program (a prompt cache
// across conversations): `snapshot_all_state` returns a snapshot's id (> 0)
// and its bytes; restoring it sets each program it holds back to it and
// resets those loaded since; a snapshot is held until dropped (or its
// programs are gone).
uint64_t snapshot_all_state(size_t& bytes);
void restore_all_state(uint64_t id);
// A batched program's cache row: `snapshot_state_row` keeps row `row` of
// every program's buffers with `rows` rows (a copy: its bytes), in the same
// registry as the snapshots above; `copy_state_row` puts such a snapshot
// back as row `to`, the other rows as they are.
uint64_t snapshot_state_row(int64_t row, int64_t rows, size_t& bytes);
void copy_state_row(uint64_t id, int64_t to, int64_t rows);
void drop_state_snapshot(uint64_t id);

// Human-readable reason of the last failure on this thread (for Python).
void set_last_error(const std::string& msg);
const std::string& last_error();

}  // namespace emlx
