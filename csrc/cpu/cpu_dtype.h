// The element type of a tensor a CPU kernel reads through lantern::cpu::load_row (csrc/include/lantern/cpu/dtype.h):
// float64, bfloat16, float16, and float32 for every other (the ops' checks admit only these four).
#pragma once

#include <ATen/core/Tensor.h>

#include "lantern/cpu/dtype.h"

namespace lantern::cpu {

inline DType cpu_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kDouble:
      return DType::kFloat64;
    case at::kBFloat16:
      return DType::kBFloat16;
    case at::kHalf:
      return DType::kFloat16;
    default:
      return DType::kFloat32;
  }
}

}  // namespace lantern::cpu
