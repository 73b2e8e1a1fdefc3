// Order-preserving keys and radix digits for sort-free selections (SPEC §1 top-k / top-p thresholds), and the
// sequential bin scan of the top-p search. Torch-free, C++17, host and device (LANTERN_HOST_DEVICE), so CPU
// tests can call what the CUDA kernels run. The digit layout (11-bit digits from the top) is the CPU's
// (lantern/cpu/select.h): with the same digits the top-p bin masses, and so the threshold, are the CPU's.
#pragma once

#include <cstdint>
#include <cstring>

#include "lantern/common.h"

namespace lantern::cuda {

template <class Real>
struct KeyType {
  using type = uint32_t;
};
template <>
struct KeyType<double> {
  using type = uint64_t;
};
// The unsigned integer type of Real's bit pattern.
template <class Real>
using KeyOf = typename KeyType<Real>::type;

// An unsigned key whose order is the order of the values (-inf < ... < -0 < +0 < ... < +inf).
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE KeyOf<Real> order_key(Real f) {
  using Key = KeyOf<Real>;
  constexpr Key sign = Key{1} << (8 * sizeof(Key) - 1);
  Key b;
  memcpy(&b, &f, sizeof(Key));
  return (b & sign) ? ~b : (b | sign);
}

template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE Real from_order_key(KeyOf<Real> k) {
  using Key = KeyOf<Real>;
  constexpr Key sign = Key{1} << (8 * sizeof(Key) - 1);
  const Key b = (k & sign) ? (k & ~sign) : ~k;
  Real f;
  memcpy(&f, &b, sizeof(Key));
  return f;
}

// Radix digits of 11 bits from the top: 3 levels for 32-bit keys, 6 for 64-bit keys. The last digit of a
// level count that does not divide the key width is left-aligned (its low bits are always 0).
constexpr int kRadixBits = 11;
constexpr int kRadixBins = 1 << kRadixBits;

template <class Key>
LANTERN_HOST_DEVICE constexpr int radix_levels() {
  return (8 * static_cast<int>(sizeof(Key)) + kRadixBits - 1) / kRadixBits;
}

template <class Key>
LANTERN_HOST_DEVICE LANTERN_INLINE int digit_shift(int level) {
  return 8 * static_cast<int>(sizeof(Key)) - kRadixBits * (level + 1);
}

template <class Key>
LANTERN_HOST_DEVICE LANTERN_INLINE uint32_t radix_digit(Key key, int level) {
  const int shift = digit_shift<Key>(level);
  return shift >= 0 ? static_cast<uint32_t>((key >> shift) & (kRadixBins - 1))
                    : static_cast<uint32_t>((key << -shift) & (kRadixBins - 1));
}

// The key bits that digit `level` reads, and digit d put back in place: after every level,
// (key & mask) == prefix selects the keys whose digits so far are the chosen ones, and after the last level
// prefix is the selected key itself.
template <class Key>
LANTERN_HOST_DEVICE LANTERN_INLINE Key digit_mask(int level) {
  const int shift = digit_shift<Key>(level);
  const Key bins = static_cast<Key>(kRadixBins - 1);
  return shift >= 0 ? static_cast<Key>(bins << shift) : static_cast<Key>(bins >> -shift);
}

template <class Key>
LANTERN_HOST_DEVICE LANTERN_INLINE Key digit_bits(uint32_t digit, int level) {
  const int shift = digit_shift<Key>(level);
  return shift >= 0 ? static_cast<Key>(static_cast<Key>(digit) << shift) : static_cast<Key>(digit >> -shift);
}

// The top-p bin scan of one radix level (lantern/cpu/select.h top_p_threshold, op for op): bins are offered
// from the highest digit down; `run` is the mass strictly above the bin being offered (in double, summed in
// this order); the threshold lies in the lowest non-empty bin whose largest element still has run <= top_p.
struct TopPScan {
  double run;    // mass strictly above the next bin
  double above;  // mass strictly above the chosen bin
  int32_t chosen;  // -1 until a bin is chosen
  bool done;
};

LANTERN_HOST_DEVICE LANTERN_INLINE TopPScan top_p_scan_start(double above) { return {above, above, -1, false}; }

// Offer bin d (count elements of total mass `mass`); returns false once the scan is over.
LANTERN_HOST_DEVICE LANTERN_INLINE bool top_p_scan_offer(TopPScan& s, int32_t d, uint32_t count, double mass,
                                                         double top_p) {
  if (s.done) return false;
  if (count == 0) return true;
  if (!(s.run <= top_p)) {
    s.done = true;
    return false;
  }
  s.chosen = d;
  s.above = s.run;
  s.run += mass;
  return true;
}

}  // namespace lantern::cuda
