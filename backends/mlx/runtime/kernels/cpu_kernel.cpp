#include "cpu_kernel.h"

#include <mlx/allocator.h>
#include <mlx/backend/cpu/encoder.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cpu_arrays.h"
#include "thread_pool.h"

namespace emlx {

namespace mx = mlx::core;

bool CpuKernel::serves(const mx::Stream& s) {
  static const bool disabled = std::getenv("EMLX_DISABLE_CPU_KERNELS") != nullptr;
  return !disabled && s.device == mx::Device::cpu;
}

void CpuKernel::eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) {
  const bool donated = updates_first_input() && !inputs.empty() && inputs[0].is_donatable() &&
                       inputs[0].flags().row_contiguous && inputs[0].dtype() == out.dtype() &&
                       inputs[0].shape() == out.shape();
  if (donated) out.copy_shared_buffer(inputs[0]);
  else out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (const auto& in : inputs) enc.set_input_array(in);
  enc.set_output_array(out);
  // The task holds references to its arrays: MLX may drop its own first.
  enc.dispatch([inputs, out, run = task()]() mutable {
    note_kernel_cpu();
    run(inputs, out);
  });
  note_dispatch();
}

void copy_unless_donated(const mx::array& first, mx::array& out) {
  uint8_t* dst = out.data<uint8_t>();
  if (dst == first.data<uint8_t>()) return;
  if (first.flags().row_contiguous) {
    std::memcpy(dst, first.data<uint8_t>(), out.nbytes());
  } else {
    const auto bytes = row_major_bytes(first);
    std::memcpy(dst, bytes.data(), bytes.size());
  }
}

void CpuKernel::eval_gpu(const std::vector<mx::array>&, mx::array&) {
  throw std::logic_error(std::string(name()) + ": a CPU kernel built on a GPU stream (CpuKernel::build gives GPUs the MLX ops)");
}

}  // namespace emlx
