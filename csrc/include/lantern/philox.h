// Philox4x32-10, bit-identical to Triton's tl.philox / tl.rand (SPEC §5). Torch-free, C++17.
//
// key (k0, k1) = (low, high) 32-bit words of the 64-bit seed; counter (c0, c1, c2, c3) =
// (i, node, row, offset). Ten rounds of
//   c0' = umulhi(0xCD9E8D57, c2) ^ c1 ^ k0     c1' = 0xCD9E8D57 * c2
//   c2' = umulhi(0xD2511F53, c0) ^ c3 ^ k1     c3' = 0xD2511F53 * c0
//   k0 += 0x9E3779B9                           k1 += 0xBB67AE85
// and every lantern stream uses output word 0.
//
// Known answers (seed, (c0, c1, c2, c3) -> word 0, u = uint_to_uniform_float, E = exponential_key(u)):
//   0,               (0, 0, 0, 0)                  -> 0x6627e8d5, 0.7980929017066956, 1.5999475717544556
//   123456789012345, (0, 3, 5, 11)                 -> 0x9dfd5f02, 0.7657051682472229, 1.4511749744415283
//   42,              (0x80000000, 1, 0, 0)         -> 0x5e221a30, 0.7354156374931335, 1.3295950889587402
//   42,              (16383, 58, 7, 1000)          -> 0xb60ea391, 0.5776782035827637, 0.8619877099990845
//   2^64 - 1,        (0xffffffff, x4)              -> 0x408f276d, 0.5043686628341675, 0.7019228935241699
#pragma once

#include <cmath>
#include <cstdint>

#include "lantern/common.h"

namespace lantern {

// Counter word c0 of a node's acceptance uniform (SPEC §5); the exponential race uses the token id.
constexpr uint32_t kAcceptCounter = 0x80000000u;

LANTERN_HOST_DEVICE LANTERN_INLINE uint32_t umulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return static_cast<uint32_t>((static_cast<uint64_t>(a) * b) >> 32);
#endif
}

// Word 0 of Philox4x32-10(counter = (c0, c1, c2, c3), key = seed).
LANTERN_HOST_DEVICE LANTERN_INLINE uint32_t philox_word0(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2,
                                                         uint32_t c3) {
  uint32_t k0 = static_cast<uint32_t>(seed), k1 = static_cast<uint32_t>(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int round = 0; round < 10; ++round) {
    const uint32_t a0 = c0, a2 = c2;
    c0 = umulhi32(0xCD9E8D57u, a2) ^ c1 ^ k0;
    c2 = umulhi32(0xD2511F53u, a0) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * a2;
    c3 = 0xD2511F53u * a0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  return c0;
}

// Triton's uint_to_uniform_float: bitcast to int32, x < 0 -> ~x, int32 -> float32, times 2^-31
// (as the float32 constant 4.6566127342e-10f). Result in [0, 1).
LANTERN_HOST_DEVICE LANTERN_INLINE float uint_to_uniform_float(uint32_t bits) {
  int32_t x = static_cast<int32_t>(bits);
  if (x < 0) x = ~x;
  return static_cast<float>(x) * 4.6566127342e-10f;
}

LANTERN_HOST_DEVICE LANTERN_INLINE float philox_uniform(uint64_t seed, uint32_t c0, uint32_t c1, uint32_t c2,
                                                        uint32_t c3) {
  return uint_to_uniform_float(philox_word0(seed, c0, c1, c2, c3));
}

// Exponential race key E = -log1p(-u) in float32 (SPEC §5).
LANTERN_HOST_DEVICE LANTERN_INLINE float exponential_key(float u) {
#if defined(__CUDA_ARCH__)
  return -log1pf(-u);
#else
  return -std::log1p(-u);  // float overload
#endif
}

}  // namespace lantern
