// Block-wide building blocks for lantern's CUDA kernels: reductions of any small trivially copyable value,
// an exclusive scan, and the radix selection step over a shared-memory histogram. Torch-free (CUDA only).
//
// Every function here is a block-wide collective: all NT threads of the block must call it with uniform
// control flow. Results are deterministic for a given NT (fixed combination order); the combining operator
// decides whether they also equal a sequential loop (max/argmin/top-2 orders do, floating sums do not).
#pragma once

#include <cstdint>
#include <cstring>

#include "lantern/common.h"
#include "lantern/cuda/radix.h"

namespace lantern::cuda {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kSlotBytes = 32;  // one reduction slot: the largest value reduced (Top2<double>)

// Shared memory of the collectives below, for a block of NT threads.
template <int NT>
struct BlockShared {
  static_assert(NT % 32 == 0 && NT >= 64 && NT <= 1024 && (NT & (NT - 1)) == 0, "NT: a power of 2 in [64, 1024]");
  static constexpr int kWarps = NT / 32;
  __align__(16) unsigned char slots[(kWarps + 1) * kSlotBytes];  // per-warp partials, then the result
  uint32_t scan[kWarps];
};

// __shfl_down_sync of any trivially copyable T whose size is a multiple of 4 (word by word).
template <class T>
__device__ LANTERN_INLINE T shfl_down_any(const T& v, unsigned delta) {
  static_assert(sizeof(T) % 4 == 0, "shfl_down_any: size must be a multiple of 4");
  constexpr int kWords = sizeof(T) / 4;
  uint32_t w[kWords];
  memcpy(w, &v, sizeof(T));
#pragma unroll
  for (int i = 0; i < kWords; ++i) w[i] = __shfl_down_sync(kFullMask, w[i], delta);
  T out;
  memcpy(&out, w, sizeof(T));
  return out;
}

// op(a, b) -> a combined with b; every thread gets the combination of every thread's v.
template <int NT, class T, class Op>
__device__ LANTERN_INLINE T block_reduce(T v, Op op, BlockShared<NT>& sh) {
  static_assert(sizeof(T) <= kSlotBytes, "block_reduce: value too large for a slot");
  constexpr int kWarps = BlockShared<NT>::kWarps;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) v = op(v, shfl_down_any(v, d));
  if (lane == 0) memcpy(sh.slots + warp * kSlotBytes, &v, sizeof(T));
  __syncthreads();
  if (warp == 0) {
    memcpy(&v, sh.slots + (lane < kWarps ? lane : 0) * kSlotBytes, sizeof(T));
#pragma unroll
    for (int d = kWarps / 2; d > 0; d >>= 1) v = op(v, shfl_down_any(v, d));
    if (lane == 0) memcpy(sh.slots + kWarps * kSlotBytes, &v, sizeof(T));
  }
  __syncthreads();
  T out;
  memcpy(&out, sh.slots + kWarps * kSlotBytes, sizeof(T));
  return out;
}

template <int NT>
__device__ LANTERN_INLINE double block_sum(double v, BlockShared<NT>& sh) {
  return block_reduce<NT>(v, [](double a, double b) { return a + b; }, sh);
}

// Two sums at once (one pair of barriers).
struct DoublePair {
  double a, b;
};

template <int NT>
__device__ LANTERN_INLINE DoublePair block_sum2(DoublePair v, BlockShared<NT>& sh) {
  return block_reduce<NT>(v, [](DoublePair x, DoublePair y) { return DoublePair{x.a + y.a, x.b + y.b}; }, sh);
}

// Exclusive prefix sum of v over thread order.
template <int NT>
__device__ LANTERN_INLINE uint32_t block_exclusive_scan(uint32_t v, BlockShared<NT>& sh) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  uint32_t x = v;
#pragma unroll
  for (int d = 1; d < 32; d <<= 1) {
    const uint32_t y = __shfl_up_sync(kFullMask, x, d);
    if (lane >= d) x += y;
  }
  if (lane == 31) sh.scan[warp] = x;
  __syncthreads();
  uint32_t before = 0;
  for (int w = 0; w < warp; ++w) before += sh.scan[w];
  __syncthreads();  // sh.scan may be rewritten by the next call
  return before + x - v;
}

// A value and its index, best = largest value, lowest index on ties; index -1 = none (worst).
template <class Real>
struct ArgBest {
  Real v;
  int64_t i;
};

template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE bool better_at_lower_index(Real v, int64_t i, Real w, int64_t j) {
  return j < 0 || (i >= 0 && (v > w || (v == w && i < j)));
}

// The radix selection step (lantern/cpu/select.h kth_largest): given the histogram count[kRadixBins] of the
// candidates' current digit and the 1-based rank from the top among them, the bin holding that rank and the
// rank inside it. Thread t owns kRadixBins / NT bins from the top.
struct RankedBin {
  uint32_t bin;
  uint32_t rank;
};

template <int NT>
struct SelectShared {
  RankedBin found;
};

template <int NT>
__device__ LANTERN_INLINE RankedBin select_bin_from_top(const uint32_t* count, uint32_t rank, BlockShared<NT>& sh,
                                                        SelectShared<NT>& sel) {
  static_assert(kRadixBins % NT == 0, "select_bin_from_top: NT must divide the bin count");
  constexpr int kPer = kRadixBins / NT;
  const int hi = kRadixBins - kPer * static_cast<int>(threadIdx.x);  // bins [hi - kPer, hi)
  uint32_t mine = 0;
#pragma unroll
  for (int j = 1; j <= kPer; ++j) mine += count[hi - j];
  const uint32_t above = block_exclusive_scan<NT>(mine, sh);
  int64_t r = static_cast<int64_t>(rank) - static_cast<int64_t>(above);
  bool found = false;
#pragma unroll
  for (int j = 1; j <= kPer; ++j) {
    const uint32_t c = count[hi - j];
    if (!found && r >= 1 && r <= static_cast<int64_t>(c)) {
      sel.found = {static_cast<uint32_t>(hi - j), static_cast<uint32_t>(r)};
      found = true;
    }
    r -= static_cast<int64_t>(c);
  }
  // Exactly one thread finds the bin when 1 <= rank <= the histogram's total (always, for valid counts).
  if (!__syncthreads_or(found)) return {0u, rank};
  return sel.found;
}

}  // namespace lantern::cuda
