// Sort-free selections over float32 / float64 values by radix histograms (SPEC §1 top-k / top-p thresholds).
// Torch-free, C++17, host only. Every function is defined for any input bits (NaN included): it never
// reads or writes out of bounds and never converts a floating value to an integer.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace lantern::cpu {

// The unsigned integer type of Real's bit pattern.
template <class Real>
using KeyOf = std::conditional_t<sizeof(Real) == 4, uint32_t, uint64_t>;

// An unsigned key whose order is the order of the values (-inf < ... < -0 < +0 < ... < +inf; NaNs sort
// beyond the infinities by their sign). Values that compare equal map to equal keys except -0 / +0, which
// callers only ever compare back as values.
template <class Real>
inline KeyOf<Real> order_key(Real f) {
  using Key = KeyOf<Real>;
  constexpr Key sign = Key{1} << (8 * sizeof(Key) - 1);
  Key b;
  std::memcpy(&b, &f, sizeof(Key));
  return (b & sign) ? ~b : (b | sign);
}

template <class Real>
inline Real from_order_key(KeyOf<Real> k) {
  using Key = KeyOf<Real>;
  constexpr Key sign = Key{1} << (8 * sizeof(Key) - 1);
  const Key b = (k & sign) ? (k & ~sign) : ~k;
  Real f;
  std::memcpy(&f, &b, sizeof(Key));
  return f;
}

// Radix digits of 11 bits from the top: 3 levels for 32-bit keys, 6 for 64-bit keys.
constexpr int kRadixBits = 11;
constexpr int kRadixBins = 1 << kRadixBits;

template <class Key>
constexpr int radix_levels() {
  return (8 * static_cast<int>(sizeof(Key)) + kRadixBits - 1) / kRadixBits;
}

template <class Key>
inline uint32_t radix_digit(Key key, int level) {
  const int shift = 8 * static_cast<int>(sizeof(Key)) - kRadixBits * (level + 1);
  return shift >= 0 ? static_cast<uint32_t>((key >> shift) & (kRadixBins - 1))
                    : static_cast<uint32_t>((key << -shift) & (kRadixBins - 1));
}

template <class Real>
struct SelectScratch {
  std::vector<KeyOf<Real>> keys;  // candidate keys of the current bucket
  std::vector<Real> values;       // their values (top-p)
  uint32_t count[kRadixBins];
  double mass[kRadixBins];
};

// The top_k-th largest of x[0..n) as a value: the reference's sort(descending)[top_k - 1] (top_k clamped
// to [1, n]).
template <class Real>
inline Real kth_largest(const Real* x, int64_t n, int64_t top_k, SelectScratch<Real>& s) {
  using Key = KeyOf<Real>;
  int64_t rank = top_k < 1 ? 1 : (top_k > n ? n : top_k);  // 1-based rank from the top inside the bucket
  s.keys.clear();
  for (int level = 0; level < radix_levels<Key>(); ++level) {
    std::memset(s.count, 0, sizeof(s.count));
    if (level == 0) {
      for (int64_t i = 0; i < n; ++i) ++s.count[radix_digit(order_key(x[i]), 0)];
    } else {
      for (Key key : s.keys) ++s.count[radix_digit(key, level)];
    }
    uint32_t chosen = 0;
    for (int d = kRadixBins - 1; d >= 0; --d) {
      if (rank <= static_cast<int64_t>(s.count[d])) {
        chosen = static_cast<uint32_t>(d);
        break;
      }
      rank -= static_cast<int64_t>(s.count[d]);
    }
    if (level == 0) {
      for (int64_t i = 0; i < n; ++i) {
        const Key key = order_key(x[i]);
        if (radix_digit(key, 0) == chosen) s.keys.push_back(key);
      }
    } else {
      size_t kept = 0;
      for (Key key : s.keys)
        if (radix_digit(key, level) == chosen) s.keys[kept++] = key;
      s.keys.resize(kept);
    }
  }
  return s.keys.empty() ? from_order_key<Real>(0) : from_order_key<Real>(s.keys.front());
}

// Top-p threshold (SPEC §1): the smallest value v among pi[idx[0..n)] whose tie group satisfies
//   S(v) = sum_{j : pi_j > v} pi_j <= top_p,
// so token i is kept iff pi_i >= v. Entries with pi <= 0 (or NaN) are ignored (their final probability is
// 0 whatever the rule says). S is summed in double, as the reference's float64 cumsum. Returns +inf when
// no entry is positive.
template <class Real>
inline Real top_p_threshold(const Real* pi, const int32_t* idx, int64_t n, double top_p, SelectScratch<Real>& s) {
  using Key = KeyOf<Real>;
  s.keys.clear();
  s.values.clear();
  for (int64_t t = 0; t < n; ++t) {
    const Real v = pi[idx[t]];
    if (v > Real(0)) {
      s.keys.push_back(order_key(v));
      s.values.push_back(v);
    }
  }
  if (s.keys.empty()) return from_order_key<Real>(order_key(static_cast<Real>(INFINITY)));
  double above = 0.0;  // mass strictly above every candidate
  for (int level = 0; level < radix_levels<Key>(); ++level) {
    std::memset(s.count, 0, sizeof(s.count));
    std::memset(s.mass, 0, sizeof(s.mass));
    for (size_t t = 0; t < s.keys.size(); ++t) {
      const uint32_t d = radix_digit(s.keys[t], level);
      ++s.count[d];
      s.mass[d] += static_cast<double>(s.values[t]);
    }
    // Scanning buckets downward, the largest element of bucket d has S = above + mass(buckets > d); the
    // threshold lies in the lowest bucket whose largest element still has S <= top_p.
    double run = above;
    int chosen = -1;
    for (int d = kRadixBins - 1; d >= 0; --d) {
      if (s.count[d] == 0) continue;
      if (!(run <= top_p)) break;
      chosen = d;
      above = run;
      run += s.mass[d];
    }
    if (chosen < 0) break;  // only for top_p < 0 or NaN, which callers never pass
    size_t kept = 0;
    for (size_t t = 0; t < s.keys.size(); ++t) {
      if (radix_digit(s.keys[t], level) == static_cast<uint32_t>(chosen)) {
        s.keys[kept] = s.keys[t];
        s.values[kept] = s.values[t];
        ++kept;
      }
    }
    s.keys.resize(kept);
    s.values.resize(kept);
  }
  return from_order_key<Real>(s.keys.front());
}

}  // namespace lantern::cpu
