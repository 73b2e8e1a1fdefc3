// Row validation of compact_kv (SPEC §6), shared by the CPU kernel (which raises) and the CUDA kernel
// (which skips an invalid row, so it never reads or writes outside the cache). Torch-free, C++17.
#pragma once

#include <cstdint>

#include "lantern/common.h"

namespace lantern {

enum class CompactKVError : int { kOk, kNKeep, kCacheLen, kPadding, kSource };

struct CompactKVRowCheck {
  CompactKVError error;
  int64_t i;  // the offending path entry, for kPadding / kSource
};

// A row keeping n nodes of the tree at position `start` is valid iff 0 <= n <= P and, when n > 0, every
// destination start + i (i < n) and every source start + path[i] lies in [0, Lmax); path[i] = -1 (padding)
// or any other negative entry is invalid. The order of the kept nodes is free (sources are read first).
LANTERN_HOST_DEVICE LANTERN_INLINE CompactKVRowCheck compact_kv_check_row(int64_t n, int64_t start, const int64_t* path,
                                                                          int64_t P, int64_t Lmax) {
  if (n < 0 || n > P) return {CompactKVError::kNKeep, 0};
  if (n == 0) return {CompactKVError::kOk, 0};
  if (start < 0 || start > Lmax - n) return {CompactKVError::kCacheLen, 0};
  for (int64_t i = 0; i < n; ++i) {
    if (path[i] == -1) return {CompactKVError::kPadding, i};
    if (path[i] < 0 || path[i] >= Lmax - start) return {CompactKVError::kSource, i};
  }
  return {CompactKVError::kOk, 0};
}

}  // namespace lantern
