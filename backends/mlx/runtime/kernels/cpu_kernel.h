// The base of our CPU kernels. Each op of ours is defined by its MLX-ops
// composition, the fallback: what every stream but a CPU one runs (Apple and
// CUDA GPUs), and what EMLX_DISABLE_CPU_KERNELS=1 selects everywhere. On a CPU
// stream a primitive of ours computes the same thing as one task.
//
// The choice is made when the graph is built, from the stream the op is built
// on (as mlx::core::fast does for ops without a kernel on a device), so a
// primitive of ours only ever exists on a CPU stream.
#pragma once

#include <mlx/mlx.h>
#include <mlx/primitives.h>

#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace emlx {

// Up to this many rows of x (or queries), the linear and attention kernels
// compute each row exactly as a one-row call does: a verify call of
// speculative decoding (1 + the drafts, llm/export/speculative.py; export caps the
// drafts at kDotRows - 1) gives bit for bit the logits of decode steps.
// More rows (prefill) take OpenBLAS's sgemm for float weights and attention
// (quantized weights stay on their integer kernel for any number of rows).
constexpr int kDotRows = 16;

// The work of one call: reads `inputs` and fills `out`, whose buffer is
// allocated. It runs on the stream's worker thread, possibly after MLX has
// dropped the primitive, so it must own what it uses.
using CpuTask = std::function<void(const std::vector<mlx::core::array>& inputs, mlx::core::array& out)>;

// The same op as MLX ops, on the kernel's inputs, on the given stream.
using Fallback = std::function<mlx::core::array(const std::vector<mlx::core::array>& inputs, mlx::core::Stream s)>;

class CpuKernel : public mlx::core::UnaryPrimitive {
 public:
  using mlx::core::UnaryPrimitive::UnaryPrimitive;

  // `make(s)`'s primitive over `inputs` with an output of `shape` and `dtype`
  // when the op is `supported` by the kernel and `s` is a CPU stream with our
  // kernels on; otherwise `fallback(inputs, s)`.
  template <class Make>
  static mlx::core::array build(mlx::core::StreamOrDevice sd, bool supported, std::vector<mlx::core::array> inputs,
                                mlx::core::Shape shape, mlx::core::Dtype dtype, const Fallback& fallback, Make&& make) {
    const mlx::core::Stream s = mlx::core::to_stream(sd);
    if (!supported || !serves(s)) return fallback(inputs, s);
    return mlx::core::array(std::move(shape), dtype, make(s), std::move(inputs));
  }

  // Whether our kernels run on `s`: a CPU stream, unless
  // EMLX_DISABLE_CPU_KERNELS is set.
  static bool serves(const mlx::core::Stream& s);

  void eval_cpu(const std::vector<mlx::core::array>& inputs, mlx::core::array& out) final;

  // Unreachable: build() makes these primitives on CPU streams only.
  void eval_gpu(const std::vector<mlx::core::array>& inputs, mlx::core::array& out) final;

 protected:
  virtual CpuTask task() const = 0;

  // Whether the output may take its first input's buffer (same shape and
  // type) when nothing else holds that input, as MLX's own scatter does: a
  // KV cache then gets its new tokens written in place. The task finds out
  // which happened by comparing the two arrays' data pointers.
  virtual bool updates_first_input() const { return false; }
};

// In the task of a kernel that updates_first_input: `out` as `first` was,
// unless MLX let it take `first`'s buffer (then it already is).
void copy_unless_donated(const mlx::core::array& first, mlx::core::array& out);

}  // namespace emlx
