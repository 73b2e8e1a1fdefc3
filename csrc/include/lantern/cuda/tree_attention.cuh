// Tree attention (SPEC §6) on CUDA: one launch per layer, flash-style online softmax. Torch-free (CUDA
// runtime types only); lantern/cuda/tree_attention.h holds its launch parameters and the sizes the binding
// computes, csrc/cuda/tree_attention.cu is its launcher.
//
// Work split. A CTA (kWarps = 4 warps) owns kRows = 16 query rows of one (batch row b, kv head g) pair;
// rows are the group's (query head, node) pairs packed as r = (h - g * G) * T + t (G = H / Hkv), so the
// G query heads sharing kv head g read each K/V tile once (GQA). Warp w owns rows 4w .. 4w + 3 of the CTA.
// The CTA streams the keys in tiles of tree_attn_tile(Dp) positions: first the prefix [0, cache_len[b]) (no mask;
// only the row length bounds the last tile), then the tree block cache_len[b] + j, j < T, where query t
// keeps key j iff bit j of tree_mask[b, t] is set (only these tiles read the packed bits).
//
// Per tile: all 128 threads copy K and V rows into shared memory as float32 (16-byte loads when aligned,
// coalesced along Dh), then each lane scores keys j = lane + 32 k against its warp's 4 rows (float4 reads:
// the K row stride Dp + 4 makes them bank-conflict free, the query rows are warp-wide broadcasts), the warp
// updates the running max / normaliser with shuffles, writes P = 2^(s - m) to a per-warp buffer, and each
// lane accumulates the output columns lane + 32 c of its 4 rows from P (broadcast) and V (conflict free).
//
// SIMT on purpose, no tensor cores: written without a GPU to test on, a plain FMA kernel whose every
// index can be checked by reading is the safer choice than hand-written mma.sync fragment layouts. The
// cost: at LlamaGen's verification shape it is bound by shared-memory traffic and FMAs, not by the K/V
// bytes (estimate in docs/cuda.md).
//
// Head dims: one instance per padded width Dp in {32, 64, 128, 256} (Dh <= Dp; the columns past Dh are
// zero in q, K and V and never stored), so 32, 64 and 128 run unpadded and any Dh <= 256, odd ones
// included, is exact; larger Dh is refused by the binding with a message naming Dh.
//
// Numerics: float32 everywhere (float64 inputs are read into float32, like the CPU backend and the
// reference: float32 math for every dtype). Scores are in the log2 domain (log2(e) / sqrt(Dh) folded into
// q), exp2f for the exponentials. The running max starts at -inf; while a row has attended nothing yet the
// update subtracts 0 instead of -inf, so no inf - inf arises and its P, l and accumulator stay 0. A query
// that attends nothing at all (impossible for valid trees: a node sees itself) gets NaN, as the
// reference's softmax over an empty set does; the final division is never by 0.
//
// Non-finite inputs are never hidden (as the reference and the CPU kernel): a query row with a non-finite
// score (q or an attended key holds NaN / inf) or a non-finite value at a position it attends to is written
// as NaN in full. A V tile with a non-finite element (the loader's threads flag it) is screened before use:
// non-finite values become 0 (so 0 x NaN cannot reach rows that do not attend to them) and their keys are
// stamped in bad_value_s with the tile's index (one more barrier, on that rare path only); the scoring step gives a
// kept key with a non-finite score or a stamp of the current tile the score NaN, which makes the row's
// running sum l NaN for good (fmaxf skips NaN, so the running max stays finite), hence its output.
//
// Invalid rows. Without a host sync the kernel cannot raise. A batch row with cache_len[b] < 0 or
// cache_len[b] + T > Lmax is skipped: no K/V/q/mask element of it is read and its whole output
// o[b] is NaN. lantern.ops.tree_attention checks cache_len on the host before dispatching here.
//
// Resources (nvcc 13.0, -O3, -Xptxas -v, 128 threads/CTA, __launch_bounds__(128, 5); the same for float32,
// float64, float16 and bfloat16 up to +-4 registers; 0 bytes of spill stores/loads in every instance).
// Occupancy = resident CTAs per SM (warps / 64), the tighter of the register and shared-memory limits
// (A100 164 KiB, H100 228 KiB of shared memory per SM, 1 KiB reserved per CTA):
// (smem/CTA: the q, K, V and P tiles; the non-finite stamps add 4 bytes per key plus 4, 260 bytes at most.)
//   Dp   keys/tile  smem/CTA   registers sm_80 | sm_90   CTAs/SM sm_80 (A100)   CTAs/SM sm_90 (H100)
//   32   64         23.3 KiB   84-86      | 86-88         5 (31%), registers     5 (31%), registers
//   64   64         41.3 KiB   86-88      | 86-88         3 (19%), smem          5 (31%), both
//   128  32         42.6 KiB   79-82      | 80-82         3 (19%), smem          5 (31%), both
//   256  32         82.6 KiB   95-96      | 96            1 (6%), smem           2 (13%), smem
// (Dp = 256 is over the default 48 KiB: the launcher opts in; the binding refuses a GPU that cannot give it.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "lantern/cuda/tree_attention.h"

namespace lantern::cuda {

// ---- element conversions (explicit intrinsics: torch builds with __CUDA_NO_HALF_CONVERSIONS__) ----------

template <typename T>
__device__ __forceinline__ float tree_attn_to_float(T x);
template <>
__device__ __forceinline__ float tree_attn_to_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ float tree_attn_to_float<double>(double x) {
  return static_cast<float>(x);
}
template <>
__device__ __forceinline__ float tree_attn_to_float<__half>(__half x) {
  return __half2float(x);
}
template <>
__device__ __forceinline__ float tree_attn_to_float<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

template <typename T>
__device__ __forceinline__ T tree_attn_from_float(float x);
template <>
__device__ __forceinline__ float tree_attn_from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ double tree_attn_from_float<double>(float x) {
  return static_cast<double>(x);
}
template <>
__device__ __forceinline__ __half tree_attn_from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 tree_attn_from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// The 16 bytes of `raw` (16 / sizeof(T) consecutive elements, little-endian) as floats.
template <typename T>
__device__ __forceinline__ void tree_attn_chunk_to_float(uint4 raw, float* f);
template <>
__device__ __forceinline__ void tree_attn_chunk_to_float<float>(uint4 raw, float* f) {
  f[0] = __uint_as_float(raw.x);
  f[1] = __uint_as_float(raw.y);
  f[2] = __uint_as_float(raw.z);
  f[3] = __uint_as_float(raw.w);
}
template <>
__device__ __forceinline__ void tree_attn_chunk_to_float<double>(uint4 raw, float* f) {
  f[0] = static_cast<float>(__hiloint2double(static_cast<int>(raw.y), static_cast<int>(raw.x)));
  f[1] = static_cast<float>(__hiloint2double(static_cast<int>(raw.w), static_cast<int>(raw.z)));
}
template <>
__device__ __forceinline__ void tree_attn_chunk_to_float<__half>(uint4 raw, float* f) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] & 0xffffu)));
    f[2 * i + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(w[i] >> 16)));
  }
}
template <>
__device__ __forceinline__ void tree_attn_chunk_to_float<__nv_bfloat16>(uint4 raw, float* f) {
  const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// ---- the K/V tile copy ---------------------------------------------------------------------------------

__device__ __forceinline__ bool tree_attn_nonfinite(float x) { return !(fabsf(x) <= 3.402823466e+38f); }

// dst[j * ld + d] = float(src[(pos0 + j) * sl + d]) for j < N, d < Dp; zero where j >= n or d >= Dh (so
// padded keys and columns contribute exactly 0 and never NaN). All threads of the CTA take part; returns
// whether this thread copied a non-finite element (one flag: screening here would cost registers the
// Dp = 256 instances do not have).
template <typename T, int Dp, int N>
__device__ __forceinline__ bool tree_attn_load_tile(const T* __restrict__ src, int64_t sl, int n, int Dh, bool vec,
                                                    float* __restrict__ dst, int ld) {
  bool nonfinite = false;
  if (vec) {  // Dh == Dp, 16-byte aligned rows: one 16-byte chunk of kE elements per step
    constexpr int kE = 16 / static_cast<int>(sizeof(T));
    constexpr int kChunksPerRow = Dp / kE;
#pragma unroll 2
    for (int c = threadIdx.x; c < N * kChunksPerRow; c += kTreeAttnThreads) {
      const int j = c / kChunksPerRow, d0 = (c % kChunksPerRow) * kE;
      float f[kE];
      if (j < n) {
        tree_attn_chunk_to_float<T>(*reinterpret_cast<const uint4*>(src + j * sl + d0), f);
#pragma unroll
        for (int i = 0; i < kE; ++i) nonfinite |= tree_attn_nonfinite(f[i]);
      } else {
#pragma unroll
        for (int i = 0; i < kE; ++i) f[i] = 0.f;
      }
      float* out = dst + j * ld + d0;  // 8-byte aligned (kE >= 2, ld and d0 even); 16 when kE % 4 == 0
      if constexpr (kE % 4 == 0) {
#pragma unroll
        for (int i = 0; i < kE; i += 4)
          *reinterpret_cast<float4*>(out + i) = make_float4(f[i], f[i + 1], f[i + 2], f[i + 3]);
      } else {
        *reinterpret_cast<float2*>(out) = make_float2(f[0], f[1]);
      }
    }
  } else {
#pragma unroll 1
    for (int c = threadIdx.x; c < N * Dp; c += kTreeAttnThreads) {
      const int j = c / Dp, d = c % Dp;
      const float x = j < n && d < Dh ? tree_attn_to_float<T>(src[j * sl + d]) : 0.f;
      nonfinite |= tree_attn_nonfinite(x);
      dst[j * ld + d] = x;
    }
  }
  return nonfinite;
}

// The rare path of a V tile [n, Dp] (row stride Dp) holding a non-finite element: each one becomes 0 and
// stamps[j] = stamp for its key j. All threads of the CTA take part.
template <int Dp>
__device__ __forceinline__ void tree_attn_screen_values(float* v, int n, int* stamps, int stamp) {
#pragma unroll 1
  for (int c = threadIdx.x; c < n * Dp; c += kTreeAttnThreads) {
    if (tree_attn_nonfinite(v[c])) {
      v[c] = 0.f;
      stamps[c / Dp] = stamp;  // every writer of a key stores the same value
    }
  }
}

// ---- the kernel ------------------------------------------------------------------------------------------

__device__ __forceinline__ float tree_attn_warp_max(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float tree_attn_warp_sum(float x) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

// Writes NaN to every output row this CTA owns (the batch row's cache_len is out of range).
template <typename T>
__device__ __forceinline__ void tree_attn_poison_rows(const TreeAttnParams& p, int b, int g, int r0, int rows) {
  const int G = p.H / p.Hkv, r1 = r0 + kTreeAttnRows < rows ? r0 + kTreeAttnRows : rows;
  T* o = static_cast<T*>(p.o);
  const T nan = tree_attn_from_float<T>(__int_as_float(0x7fffffff));
  for (int r = r0; r < r1; ++r) {
    const int h = g * G + r / p.T, t = r % p.T;
    T* out = o + ((static_cast<int64_t>(b) * p.H + h) * p.T + t) * p.Dh;
    for (int d = threadIdx.x; d < p.Dh; d += kTreeAttnThreads) out[d] = nan;
  }
}

// Grid: one CTA per (b, kv head g, block of kTreeAttnRows packed rows), x = (b * Hkv + g) * blocks + blk.
// Block: kTreeAttnThreads. Dynamic shared memory: tree_attn_smem_bytes(Dp). Dh <= Dp.
template <typename T, int Dp>
__global__ void __launch_bounds__(kTreeAttnThreads, kTreeAttnMinBlocks) tree_attention_kernel(const TreeAttnParams p) {
  constexpr int N = tree_attn_tile(Dp);  // keys per tile
  constexpr int kKeysPerLane = N / 32;
  constexpr int kCols = Dp / 32;  // output columns per lane: lane + 32 c
  constexpr int R = kTreeAttnRowsPerWarp;
  static_assert(R == 4, "P is written and read as one float4 per key");
  static_assert(Dp % 32 == 0 && Dp <= kTreeAttnMaxDh, "Dp: a multiple of 32, at most kTreeAttnMaxDh");
  constexpr int kLdK = Dp + 4;  // K row stride in shared memory: conflict-free float4 reads down the keys
#ifdef LANTERN_SIMT_EMULATION  // host logic tests (csrc/tests/cuda_emulation) supply the dynamic shared memory
  float* smem = lantern_emu_dynamic_smem();
#else
  extern __shared__ __align__(16) float smem[];
#endif
  float* q_s = smem;                        // [kRows, Dp] scaled queries
  float* k_s = q_s + kTreeAttnRows * Dp;    // [N, kLdK]
  float* v_s = k_s + N * kLdK;              // [N, Dp]
  float* p_s = v_s + N * Dp;                // [kWarps, N, R] probabilities, row-fastest
  int* bad_value_s = reinterpret_cast<int*>(p_s + kTreeAttnWarps * N * R);  // [N] tile index of a non-finite V
  int* bad_tile_s = bad_value_s + N;  // the index of the last tile with a non-finite V element

  const int blk = static_cast<int>(blockIdx.x) % p.blocks_per_head,
            bg = static_cast<int>(blockIdx.x) / p.blocks_per_head;
  const int g = bg % p.Hkv, b = bg / p.Hkv;
  const int G = p.H / p.Hkv, rows = G * p.T, r0 = blk * kTreeAttnRows;
  const int64_t L = p.cache_len[b];
  if (L < 0 || L > p.Lmax - p.T) {  // uniform over the CTA: every thread returns before any barrier
    tree_attn_poison_rows<T>(p, b, g, r0, rows);
    return;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  // Scaled queries, zero for padded columns and for rows past the group.
  const T* q = static_cast<const T*>(p.q);
#pragma unroll 1
  for (int c = threadIdx.x; c < kTreeAttnRows * Dp; c += kTreeAttnThreads) {
    const int r = c / Dp, d = c % Dp, row = r0 + r;
    float x = 0.f;
    if (row < rows && d < p.Dh) {
      const int h = g * G + row / p.T, t = row % p.T;
      x = tree_attn_to_float<T>(q[b * p.q_sb + h * p.q_sh + t * p.q_st + d]) * p.qk_scale;
    }
    q_s[c] = x;
  }

  // This warp's rows: offset of node t's mask words in mask_b (for the tree bits), and whether the row exists.
  int mask_row[R];
  bool live[R];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    const int row = r0 + warp * R + i;
    live[i] = row < rows;
    mask_row[i] = live[i] ? row % p.T * p.W : 0;
  }
  for (int j = threadIdx.x; j <= N; j += kTreeAttnThreads) bad_value_s[j] = -1;  // and bad_tile_s: no tile yet
  float m[R], l[R], acc[R][kCols];
#pragma unroll
  for (int i = 0; i < R; ++i) {
    m[i] = -INFINITY;
    l[i] = 0.f;
#pragma unroll
    for (int c = 0; c < kCols; ++c) acc[i][c] = 0.f;
  }

  const T* kbase = static_cast<const T*>(p.k) + b * p.k_sb + g * p.k_sh;
  const T* vbase = static_cast<const T*>(p.v) + b * p.v_sb + g * p.v_sh;
  const int32_t* mask_b = p.tree_mask + static_cast<int64_t>(b) * p.T * p.W;  // [T, W]
  const int64_t prefix_tiles = (L + N - 1) / N, tiles = prefix_tiles + (p.T + N - 1) / N;
  const float* q_w = q_s + warp * R * Dp;
  float* p_w = p_s + warp * N * R;

  for (int64_t tile = 0; tile < tiles; ++tile) {
    const bool tree = tile >= prefix_tiles;
    const int64_t first = tree ? (tile - prefix_tiles) * N : tile * N;  // tree node / prefix position
    const int64_t left = (tree ? static_cast<int64_t>(p.T) : L) - first;
    const int n = left < N ? static_cast<int>(left) : N;  // keys of this tile, 1..N
    const int64_t pos0 = tree ? L + first : first;

    __syncthreads();  // the previous tile's K/V reads are done (and, first time, nothing to wait for)
    tree_attn_load_tile<T, Dp, N>(kbase + pos0 * p.k_sl, p.k_sl, n, p.Dh, p.vec_loads, k_s, kLdK);
    if (tree_attn_load_tile<T, Dp, N>(vbase + pos0 * p.v_sl, p.v_sl, n, p.Dh, p.vec_loads, v_s, Dp))
      *bad_tile_s = static_cast<int>(tile);
    __syncthreads();  // K, V (and, first time, q) visible to every warp
    if (*bad_tile_s == static_cast<int>(tile)) {  // the same for the whole CTA
      tree_attn_screen_values<Dp>(v_s, n, bad_value_s, static_cast<int>(tile));
      __syncthreads();
    }

    // Scores s[i][kk] of row i and key j = lane + 32 kk, log2 domain; -inf where masked.
    float s[R][kKeysPerLane];
#pragma unroll
    for (int i = 0; i < R; ++i)
#pragma unroll
      for (int kk = 0; kk < kKeysPerLane; ++kk) s[i][kk] = 0.f;
#pragma unroll 1
    for (int d = 0; d < Dp; d += 4) {
      float4 kv[kKeysPerLane];
#pragma unroll
      for (int kk = 0; kk < kKeysPerLane; ++kk)
        kv[kk] = *reinterpret_cast<const float4*>(k_s + (lane + 32 * kk) * kLdK + d);
#pragma unroll
      for (int i = 0; i < R; ++i) {
        const float4 qv = *reinterpret_cast<const float4*>(q_w + i * Dp + d);
#pragma unroll
        for (int kk = 0; kk < kKeysPerLane; ++kk)
          s[i][kk] += qv.x * kv[kk].x + qv.y * kv[kk].y + qv.z * kv[kk].z + qv.w * kv[kk].w;
      }
    }
#pragma unroll
    for (int kk = 0; kk < kKeysPerLane; ++kk) {
      const int j = lane + 32 * kk;
#pragma unroll
      for (int i = 0; i < R; ++i) {
        bool keep = j < n;
        if (keep && tree && live[i]) {
          const int node = static_cast<int>(first) + j;  // < T
          const uint32_t word = static_cast<uint32_t>(mask_b[mask_row[i] + (node >> 5)]);
          keep = (word >> (node & 31)) & 1u;
        }
        if (!keep) s[i][kk] = -INFINITY;
        // a kept key with a non-finite score or value: a NaN score makes P, then the row's sum l, NaN for good
        // (no register to spare for a flag at Dp = 256), so the row is written as NaN
        else if (tree_attn_nonfinite(s[i][kk]) || bad_value_s[j] == static_cast<int>(tile))
          s[i][kk] = NAN;
      }
    }

    // Online softmax: m' = max(m, max_j s), P = 2^(s - m'), l = l 2^(m - m') + sum P, acc *= 2^(m - m').
#pragma unroll
    for (int i = 0; i < R; ++i) {
      float mx = s[i][0];
#pragma unroll
      for (int kk = 1; kk < kKeysPerLane; ++kk) mx = fmaxf(mx, s[i][kk]);
      const float m_new = fmaxf(m[i], tree_attn_warp_max(mx));
      const float m_use = m_new == -INFINITY ? 0.f : m_new;  // nothing attended yet: P = 0, state stays 0
      const float alpha = exp2f(m[i] - m_use);
      float sum = 0.f;
#pragma unroll
      for (int kk = 0; kk < kKeysPerLane; ++kk) {
        s[i][kk] = exp2f(s[i][kk] - m_use);
        sum += s[i][kk];
      }
      l[i] = l[i] * alpha + tree_attn_warp_sum(sum);
      m[i] = m_new;
#pragma unroll
      for (int c = 0; c < kCols; ++c) acc[i][c] *= alpha;
    }
#pragma unroll
    for (int kk = 0; kk < kKeysPerLane; ++kk)
      *reinterpret_cast<float4*>(p_w + (lane + 32 * kk) * R) = make_float4(s[0][kk], s[1][kk], s[2][kk], s[3][kk]);
    __syncwarp();  // P of every lane visible to the warp

    // acc[i][c] += sum_j P[j][i] V[j][lane + 32 c] over the tile's n keys (P = 0 beyond n anyway).
#pragma unroll 2
    for (int j = 0; j < n; ++j) {
      const float4 pj = *reinterpret_cast<const float4*>(p_w + j * R);
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const float vj = v_s[j * Dp + lane + 32 * c];
        acc[0][c] += pj.x * vj;
        acc[1][c] += pj.y * vj;
        acc[2][c] += pj.z * vj;
        acc[3][c] += pj.w * vj;
      }
    }
    __syncwarp();  // P reads done before the next tile overwrites p_w
  }

  T* o = static_cast<T*>(p.o);
#pragma unroll
  for (int i = 0; i < R; ++i) {
    if (!live[i]) continue;
    const int row = r0 + warp * R + i, h = g * G + row / p.T, t = row % p.T;
    // l >= 1 once anything was attended (the row's max contributes 2^0), so the fast reciprocal is exact to
    // ~1 ulp there; l = 0 means the query attended nothing: NaN, like the reference's empty softmax.
    const float inv = l[i] > 0.f ? __frcp_rn(l[i]) : __int_as_float(0x7fffffff);  // NaN l: a poisoned row
    T* out = o + ((static_cast<int64_t>(b) * p.H + h) * p.T + t) * p.Dh;
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int d = lane + 32 * c;
      if (d < p.Dh) out[d] = tree_attn_from_float<T>(acc[i][c] * inv);
    }
  }
}

}  // namespace lantern::cuda
