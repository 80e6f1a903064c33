// Conversions between the IR's, MLX's and ExecuTorch's element types.
#pragma once

#include <mlx/dtype.h>
#include <executorch/runtime/core/exec_aten/exec_aten.h>

#include <optional>
#include <stdexcept>
#include <string>

#include "generated/schema_generated.h"

namespace emlx {

inline bool valid_dtype(ir::DType d) {
  return static_cast<int>(d) >= static_cast<int>(ir::DType::MIN) &&
         static_cast<int>(d) <= static_cast<int>(ir::DType::MAX);
}

inline mlx::core::Dtype to_mlx_dtype(ir::DType d) {
  switch (d) {
    case ir::DType::float32: return mlx::core::float32;
    case ir::DType::float16: return mlx::core::float16;
    case ir::DType::bfloat16: return mlx::core::bfloat16;
    case ir::DType::int64: return mlx::core::int64;
    case ir::DType::int32: return mlx::core::int32;
    case ir::DType::int16: return mlx::core::int16;
    case ir::DType::int8: return mlx::core::int8;
    case ir::DType::uint8: return mlx::core::uint8;
    case ir::DType::bool_: return mlx::core::bool_;
    case ir::DType::uint32: return mlx::core::uint32;
    case ir::DType::uint64: return mlx::core::uint64;
  }
  throw std::invalid_argument("dtype " + std::to_string(static_cast<int>(d)) + " is not a DType");
}

// The ExecuTorch scalar type for an IR dtype that can cross the delegate
// boundary (nullopt for uint32/uint64, which ExecuTorch tensors lack).
inline std::optional<executorch::aten::ScalarType> to_et_dtype(ir::DType d) {
  using executorch::aten::ScalarType;
  switch (d) {
    case ir::DType::float32: return ScalarType::Float;
    case ir::DType::float16: return ScalarType::Half;
    case ir::DType::bfloat16: return ScalarType::BFloat16;
    case ir::DType::int64: return ScalarType::Long;
    case ir::DType::int32: return ScalarType::Int;
    case ir::DType::int16: return ScalarType::Short;
    case ir::DType::int8: return ScalarType::Char;
    case ir::DType::uint8: return ScalarType::Byte;
    case ir::DType::bool_: return ScalarType::Bool;
    default: return std::nullopt;
  }
}

}  // namespace emlx
