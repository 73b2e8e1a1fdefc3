// Element types of lantern's CPU kernels and their conversion to float32. Torch-free, C++17, host only.
//
// Kernels load rows into float32 (or, where they mirror the reference's float64 path, float64) scratch.
#pragma once

#include <cstdint>
#include <cstring>

namespace lantern::cpu {

enum class DType : int { kFloat32, kFloat64, kBFloat16, kFloat16 };

inline float bf16_to_float(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// IEEE binary16 -> binary32 (exact; subnormals, infinities and NaNs preserved).
inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0x1fu) {
    bits = sign | 0x7f800000u | (man << 13);  // inf / NaN
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);  // normal: rebias 15 -> 127
  } else if (man == 0) {
    bits = sign;  // +-0
  } else {  // subnormal: normalise the mantissa
    exp = 113u;
    while ((man & 0x400u) == 0) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// out[i] = Real(src[offset + i]) for i < n (Real = float or double); src holds elements of type t.
template <class Real>
inline void load_row(const void* src, DType t, int64_t offset, int64_t n, Real* out) {
  switch (t) {
    case DType::kFloat32: {
      const float* s = static_cast<const float*>(src) + offset;
      if constexpr (sizeof(Real) == sizeof(float)) {
        std::memcpy(out, s, static_cast<size_t>(n) * sizeof(float));
      } else {
        for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Real>(s[i]);
      }
      break;
    }
    case DType::kFloat64: {
      const double* s = static_cast<const double*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Real>(s[i]);
      break;
    }
    case DType::kBFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Real>(bf16_to_float(s[i]));
      break;
    }
    case DType::kFloat16: {
      const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
      for (int64_t i = 0; i < n; ++i) out[i] = static_cast<Real>(fp16_to_float(s[i]));
      break;
    }
  }
}

inline void load_f32(const void* src, DType t, int64_t offset, int64_t n, float* out) {
  load_row<float>(src, t, offset, n, out);
}

// float32 -> element type t, round to nearest even (for outputs).
inline uint16_t float_to_bf16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // quiet NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

inline uint16_t float_to_fp16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  const uint32_t ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to inf (>= 65520)
  if (ax < 0x38800000u) {  // result subnormal or zero: value / 2^-24, rounded to nearest even
    if (ax < 0x33000000u) return sign;  // < 2^-25: rounds to 0
    const uint32_t e = ax >> 23, man = (ax & 0x7fffffu) | 0x800000u;
    const uint32_t shift = 126u - e;  // 14..24 (value = man * 2^(e-150); subnormal unit 2^-24)
    uint32_t r = man >> shift;
    const uint32_t rem = man & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return static_cast<uint16_t>(sign | r);
  }
  uint32_t r = ((ax - 0x38000000u) >> 13);  // rebias 127 -> 15
  const uint32_t rem = ax & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (r & 1u))) ++r;
  return static_cast<uint16_t>(sign | r);
}

// dst[offset + i] = src[i] converted to t, for i < n.
inline void store_from_f32(const float* src, int64_t n, void* dst, DType t, int64_t offset) {
  switch (t) {
    case DType::kFloat32:
      std::memcpy(static_cast<float*>(dst) + offset, src, static_cast<size_t>(n) * sizeof(float));
      break;
    case DType::kFloat64:
      for (int64_t i = 0; i < n; ++i) static_cast<double*>(dst)[offset + i] = src[i];
      break;
    case DType::kBFloat16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[offset + i] = float_to_bf16(src[i]);
      break;
    case DType::kFloat16:
      for (int64_t i = 0; i < n; ++i) static_cast<uint16_t*>(dst)[offset + i] = float_to_fp16(src[i]);
      break;
  }
}

}  // namespace lantern::cpu
