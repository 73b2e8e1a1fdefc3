// Host stand-in for <cuda_bf16.h> under the SIMT emulator (simt_emu.h): __nv_bfloat16 as raw bits.
#pragma once
#include <cstdint>

#include "lantern/cpu/dtype.h"

struct __nv_bfloat16 {
  uint16_t x;
};
inline float __bfloat162float(__nv_bfloat16 h) { return lantern::cpu::bf16_to_float(h.x); }
