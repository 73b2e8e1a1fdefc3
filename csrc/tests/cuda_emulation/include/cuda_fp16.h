// Host stand-in for <cuda_fp16.h> under the SIMT emulator (simt_emu.h): __half as raw bits, exact conversion.
#pragma once
#include <cstdint>

#include "lantern/cpu/dtype.h"

struct __half {
  uint16_t x;
};
inline float __half2float(__half h) { return lantern::cpu::fp16_to_float(h.x); }
