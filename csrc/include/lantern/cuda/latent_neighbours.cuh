// The latent neighbour table (SPEC §2) on CUDA: one launch, one CTA of kNbrThreads threads per code x.
// Torch-free (CUDA runtime types only); csrc/cuda/latent_neighbours.cu is its launcher.
//
// Order. Candidate y of row x is ranked by the uint64 key (float32 bits of dist(x, y)) << 32 | y, as in the
// reference and the CPU kernel: for dist >= 0 (+inf included) the bits increase with the value, so key order
// is (dist, y) order and keys are unique. x itself gets the key UINT64_MAX, the unique largest (y < 2^31),
// so it is never among the K <= V - 1 smallest, whatever the codebook holds. (A NaN distance, possible only
// for a non-finite codebook, which lantern.ops rejects, would rank differently from the reference's signed
// view of the bits; the kernel stays in bounds either way.)
//
// Exactness. dist = sum_j (c_xj - c_yj)^2 is accumulated as the reference does, acc = 0; for j in order:
// acc += diff * diff, in float32 with __fsub_rn / __fmul_rn / __fadd_rn so no FMA contraction changes a
// rounding. Inputs are converted to float32 exactly as torch's .to(float32) does (half/bf16 exactly,
// double rounded to nearest even); normalisation, when asked, is done by the binding with the same ATen ops
// as the reference (F.normalize) and the CPU binding, on the device before the launch.
//
// Per CTA (row x):
// 1. kCached: the row's V distance bits are computed once into shared memory (4 V bytes); otherwise every
//    pass below recomputes them from the codebook (the binding picks kCached when they fit).
// 2. Radix select of the rank-r key (r = the segment's last output position + 1): up to 8 passes of
//    8-bit digits from the top of the 64-bit key, each a 256-bin shared histogram (warp-aggregated with
//    __match_any_sync) of the keys still matching the prefix, then warp 0 finds the digit. It stops as
//    soon as the chosen bucket holds exactly the ranks still needed (for tie-free rows after at most the 4
//    distance digits): the boundary is then the prefix with every lower bit set, and {key <= boundary} is
//    exactly the r smallest keys.
// 3. Gather: the keys in (previous boundary, boundary] (exactly the segment's n <= seg_cap keys) are
//    appended to a shared buffer with warp-aggregated atomics, in any order.
// 4. Bitonic sort of the n keys (padded with UINT64_MAX to a power of two) in shared memory; the low 32
//    bits (ids) are written to out[x, start .. start + n), nearest first.
// Steps 2-4 run once per segment of seg_cap = min(next_pow2(K), kNbrMaxSegment) outputs until K ids are
// written, so every K in [1, V - 1] works; K <= kNbrMaxSegment is a single segment. Memory: the [V, K] output plus
// per-CTA shared memory (8 seg_cap bytes, + 4 V when kCached, + ~1.1 KiB); nothing O(V^2).
//
// Resources (nvcc 13.0, -O3, -Xptxas -v, __launch_bounds__(512, 3); 0 spill bytes in every instance;
// static shared memory 1040 bytes):
//   registers/thread            float  double  half  bf16
//   sm_80  kCached = true         28     32     28    28
//   sm_80  kCached = false        31     36     39    37
//   sm_90  kCached = true         38     38     38    38
//   sm_90  kCached = false        34     40     34    34
// Theoretical occupancy at V = 16384, K = 1000 (kCached, seg_cap 1024: 8 KiB + 64 KiB dynamic + 1 KiB
// static + 1 KiB reserved = 74 KiB per CTA of 512 threads): sm_80 (A100, 164 KiB/SM) 2 CTAs = 1024 threads
// = 50%; sm_90 (H100, 228 KiB/SM) 3 CTAs = 1536 threads = 75%; shared memory is the limit (registers,
// <= 40, allow 3 CTAs). The distances are cached up to V = 39420 (A100) / 55804 (H100) at K <= 1024.
// Uncached (larger V): 9-34 KiB of shared memory, 3 CTAs = 75% (4 = 100% for float on sm_80, 31 registers).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace lantern::cuda {

constexpr int kNbrThreads = 512;            // threads per CTA (one CTA per code)
constexpr int kNbrBins = 256;               // radix digit: 8 bits of the 64-bit key per pass
constexpr uint32_t kNbrMaxSegment = 4096;   // outputs sorted per segment (32 KiB of keys)
constexpr uint64_t kNbrSelfKey = ~uint64_t{0};

namespace nbr {

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(double v) { return __double2float_rn(v); }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// Block-wide scalars of the select / gather steps.
struct Shared {
  uint32_t hist[kNbrBins];
  uint32_t digit;      // the chosen digit of the current pass
  uint32_t remaining;  // rank still to find inside the chosen bucket (1-based)
  uint32_t bucket;     // number of keys in the chosen bucket
  uint32_t fill;       // keys gathered so far in this segment
};

// float32 bits of sum_j (x_j - y_j)^2 over j in order; ct is the codebook transposed, [d, V].
template <typename T>
__device__ __forceinline__ uint32_t distance_bits(const T* __restrict__ ct, int64_t V, int64_t d, uint32_t x,
                                                  uint32_t y) {
  const T* px = ct + x;
  const T* py = ct + y;
  float acc = 0.f;
#pragma unroll 2
  for (int64_t j = 0; j < d; ++j, px += V, py += V) {
    const float diff = __fsub_rn(to_float(*px), to_float(*py));
    acc = __fadd_rn(acc, __fmul_rn(diff, diff));
  }
  return __float_as_uint(acc);
}

// The ranking keys of row x: from the shared cache of distance bits, or recomputed.
template <typename T, bool kCached>
struct RowKeys {
  const T* __restrict__ ct;  // [d, V]
  int64_t V, d;
  uint32_t x;
  const uint32_t* cache;  // [V] distance bits when kCached

  // y < V < 2^31
  __device__ __forceinline__ uint64_t operator()(uint32_t y) const {
    if (y == x) return kNbrSelfKey;
    const uint32_t bits = kCached ? cache[y] : distance_bits(ct, V, d, x, y);
    return (static_cast<uint64_t>(bits) << 32) | static_cast<uint64_t>(y);
  }
};

// Adds 1 to hist[digit] for every lane with `in`; one atomic per distinct digit in the warp.
// Called by all 32 lanes of the warp.
__device__ __forceinline__ void count_digit(uint32_t* hist, bool in, uint32_t digit) {
  const unsigned active = __ballot_sync(0xffffffffu, in);
  if (in) {
    const unsigned peers = __match_any_sync(active, digit);
    if (static_cast<int>(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&hist[digit], __popc(peers));
  }
}

// Warp 0: the digit whose bucket holds rank `rank` (1 <= rank <= total count) -> s.digit, s.remaining,
// s.bucket. Lane l owns bins 8l .. 8l + 7.
__device__ __forceinline__ void find_bucket(Shared& s, uint32_t rank) {
  const uint32_t lane = threadIdx.x;
  uint32_t own = 0;
#pragma unroll
  for (uint32_t i = 0; i < 8; ++i) own += s.hist[lane * 8 + i];
  uint32_t upto = own;  // inclusive prefix sum over lanes
#pragma unroll
  for (uint32_t off = 1; off < 32; off <<= 1) {
    const uint32_t t = __shfl_up_sync(0xffffffffu, upto, off);
    if (lane >= off) upto += t;
  }
  uint32_t below = upto - own;
  if (below < rank && rank <= upto) {
    for (uint32_t i = 0; i < 8; ++i) {
      const uint32_t c = s.hist[lane * 8 + i];
      if (rank <= below + c) {
        s.digit = lane * 8 + i;
        s.remaining = rank - below;
        s.bucket = c;
        break;
      }
      below += c;
    }
  }
}

// The largest key B such that exactly `rank` keys of the row are <= B (1 <= rank <= V - 1). Called by the
// whole CTA; returns the same value in every thread.
template <typename Keys>
__device__ uint64_t select_boundary(const Keys& keys, uint32_t rank, Shared& s) {
  uint64_t prefix = 0, fixed = 0;  // the boundary's digits decided so far, and their bit mask
  for (int shift = 56; shift >= 0; shift -= 8) {
    for (int b = threadIdx.x; b < kNbrBins; b += blockDim.x) s.hist[b] = 0;
    __syncthreads();
    for (uint32_t base = 0; base < keys.V; base += blockDim.x) {  // uniform trip count: whole warps
      const uint32_t y = base + threadIdx.x;  // < 2^31 + kNbrThreads: no wrap
      bool in = false;
      uint32_t digit = 0;
      if (y < keys.V) {
        const uint64_t key = keys(y);
        in = (key & fixed) == prefix;
        digit = static_cast<uint32_t>(key >> shift) & (kNbrBins - 1);
      }
      count_digit(s.hist, in, digit);
    }
    __syncthreads();
    if (threadIdx.x < 32) find_bucket(s, rank);
    __syncthreads();
    // s.digit etc. are rewritten only after the next pass's first __syncthreads, which every thread
    // reaches after these reads.
    prefix |= static_cast<uint64_t>(s.digit) << shift;
    fixed |= static_cast<uint64_t>(kNbrBins - 1) << shift;
    rank = s.remaining;
    if (s.bucket == rank) return prefix | ~fixed;  // the whole bucket is taken
  }
  return prefix;  // not reached: with all 64 bits fixed the bucket is the single key of rank `rank`
}

// Appends every key in (lower, upper] (any key <= upper when !has_lower) to buf (capacity cap) at
// positions from s.fill, in any order. s.fill must be 0 and visible to all threads on entry.
template <typename Keys>
__device__ void gather_keys(const Keys& keys, bool has_lower, uint64_t lower, uint64_t upper, uint64_t* buf,
                            uint32_t cap, Shared& s) {
  const uint32_t lane = threadIdx.x & 31;
  for (uint32_t base = 0; base < keys.V; base += blockDim.x) {  // uniform trip count: whole warps
    const uint32_t y = base + threadIdx.x;
    uint64_t key = 0;
    bool take = false;
    if (y < keys.V) {
      key = keys(y);
      take = key <= upper && (!has_lower || key > lower);
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, take);
    if (ballot == 0) continue;  // warp-uniform
    const int leader = __ffs(ballot) - 1;
    uint32_t first = 0;
    if (static_cast<int>(lane) == leader) first = atomicAdd(&s.fill, static_cast<uint32_t>(__popc(ballot)));
    first = __shfl_sync(0xffffffffu, first, leader);
    if (take) {
      const uint32_t pos = first + static_cast<uint32_t>(__popc(ballot & ((1u << lane) - 1u)));
      if (pos < cap) buf[pos] = key;  // pos < n <= cap by construction; the test keeps a bug in bounds
    }
  }
}

// Sorts buf[0, n) ascending, n a power of two. Called by the whole CTA; ends with __syncthreads.
__device__ __forceinline__ void bitonic_sort(uint64_t* buf, uint32_t n) {
  for (uint32_t k = 2; k <= n; k <<= 1) {
    for (uint32_t j = k >> 1; j > 0; j >>= 1) {
      for (uint32_t i = threadIdx.x; i < n / 2; i += blockDim.x) {
        const uint32_t lo = ((i & ~(j - 1)) << 1) | (i & (j - 1)), hi = lo + j;  // lo has bit j clear
        const uint64_t a = buf[lo], b = buf[hi];
        if ((a > b) == ((lo & k) == 0)) {
          buf[lo] = b;
          buf[hi] = a;
        }
      }
      __syncthreads();
    }
  }
}

}  // namespace nbr

// Outputs per segment: a power of two >= min(K, kNbrMaxSegment).
inline uint32_t nbr_segment_capacity(int64_t K) {
  uint32_t cap = 1;
  while (cap < kNbrMaxSegment && cap < K) cap <<= 1;
  return cap;
}

// Dynamic shared memory of one CTA: the sort buffer, then the distance cache when kCached.
inline size_t nbr_shared_bytes(int64_t V, uint32_t seg_cap, bool cached) {
  return static_cast<size_t>(seg_cap) * sizeof(uint64_t) + (cached ? static_cast<size_t>(V) * sizeof(uint32_t) : 0);
}

// ct [d, V] (codebook transposed, T = float / double / __half / __nv_bfloat16) -> out [V, K] int32.
// Grid: V CTAs of kNbrThreads threads; dynamic shared memory nbr_shared_bytes(V, seg_cap, kCached);
// seg_cap = nbr_segment_capacity(K); 1 <= K <= V - 1, 2 <= V < 2^31.
template <typename T, bool kCached>
__global__ void __launch_bounds__(kNbrThreads, 3)
    latent_neighbours_kernel(const T* __restrict__ ct, int64_t V, int64_t d, int64_t K, uint32_t seg_cap,
                             int32_t* __restrict__ out) {
  extern __shared__ __align__(16) unsigned char nbr_smem[];
  __shared__ nbr::Shared s;
  uint64_t* buf = reinterpret_cast<uint64_t*>(nbr_smem);          // [seg_cap]
  uint32_t* cache = reinterpret_cast<uint32_t*>(buf + seg_cap);  // [V] when kCached
  const uint32_t x = blockIdx.x;
  if constexpr (kCached) {
    for (uint32_t y = threadIdx.x; y < V; y += blockDim.x) cache[y] = nbr::distance_bits(ct, V, d, x, y);
    __syncthreads();
  }
  const nbr::RowKeys<T, kCached> keys{ct, V, d, x, cache};
  int32_t* row = out + static_cast<int64_t>(x) * K;
  uint64_t lower = 0;
  for (int64_t start = 0; start < K; start += seg_cap) {
    const int64_t end = start + seg_cap < K ? start + seg_cap : K;
    const uint32_t n = static_cast<uint32_t>(end - start);
    const uint64_t upper = nbr::select_boundary(keys, static_cast<uint32_t>(end), s);
    if (threadIdx.x == 0) s.fill = 0;
    __syncthreads();
    nbr::gather_keys(keys, start > 0, lower, upper, buf, seg_cap, s);
    uint32_t padded = 1;
    while (padded < n) padded <<= 1;
    for (uint32_t i = n + threadIdx.x; i < padded; i += blockDim.x) buf[i] = kNbrSelfKey;
    __syncthreads();
    nbr::bitonic_sort(buf, padded);
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) row[start + i] = static_cast<int32_t>(buf[i] & 0xffffffffu);
    lower = upper;
    __syncthreads();  // buf is read before the next segment gathers into it
  }
}

}  // namespace lantern::cuda
