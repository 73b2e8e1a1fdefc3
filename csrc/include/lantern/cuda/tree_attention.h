// The launch contract of the CUDA tree attention kernel (lantern/cuda/tree_attention.cuh, which documents the
// work split and the shared-memory budget): its parameters and the sizes the binding computes from them.
// Host C++, no CUDA types, so the torch binding (csrc/cuda/bindings.cpp) compiles without nvcc.
#pragma once

#include <cstdint>

namespace lantern::cuda {

constexpr int kTreeAttnWarps = 4;
constexpr int kTreeAttnThreads = 32 * kTreeAttnWarps;
constexpr int kTreeAttnRowsPerWarp = 4;  // = the float4 width of a P broadcast
constexpr int kTreeAttnRows = kTreeAttnWarps * kTreeAttnRowsPerWarp;  // query rows per CTA
constexpr int kTreeAttnMaxDh = 256;
// At most 65536 / (128 * 5) = 102 registers per thread. An explicit budget: left to itself, ptxas picks
// counts such as 64 or 72 and spills a few bytes; with this one every instance compiles without spills.
constexpr int kTreeAttnMinBlocks = 5;

// Keys per tile for head dims padded to Dp (a multiple of 32): 64 up to Dp = 64, else 32, so shared
// memory stays under the default 48 KiB up to Dp = 128.
constexpr int tree_attn_tile(int Dp) { return Dp <= 64 ? 64 : 32; }

// Shared memory of one CTA, in bytes: q [kRows, Dp], K [N, Dp + 4], V [N, Dp], P [kWarps, N, 4] floats, the
// per-key stamps of non-finite values [N] and the last tile that had one, int32.
constexpr int tree_attn_smem_bytes(int Dp) {
  const int n = tree_attn_tile(Dp);
  return 4 * (kTreeAttnRows * Dp + n * (Dp + 4) + n * Dp + kTreeAttnWarps * n * kTreeAttnRowsPerWarp + n + 1);
}

struct TreeAttnParams {
  const void* q;  // [B, H, T, Dh], strides q_s* (elements), last dimension contiguous
  const void* k;  // [B, Hkv, Lmax, Dh], strides k_s*, last dimension contiguous
  const void* v;  // like k, strides v_s*
  void* o;        // [B, H, T, Dh] contiguous, q's dtype
  const int64_t* cache_len;  // [B]
  const int32_t* tree_mask;  // [B, T, W] contiguous packed bits, W = ceil(T / 32)
  int64_t q_sb, q_sh, q_st;
  int64_t k_sb, k_sh, k_sl;
  int64_t v_sb, v_sh, v_sl;
  int64_t Lmax;
  int B, H, Hkv, T, Dh, W;  // the binding checks that G * T, B * T * W and the grid fit in int32
  int blocks_per_head;      // ceil(G * T / kTreeAttnRows)
  float qk_scale;           // log2(e) / sqrt(Dh)
  bool vec_loads;  // K/V rows may be read in 16-byte chunks (Dh == Dp, 16-byte aligned bases and strides)
};

// Blocks per (b, kv head).
inline int64_t tree_attn_blocks_per_head(int64_t H, int64_t Hkv, int64_t T) {  // ceil(G * T / kRows)
  return ((H / Hkv) * T + kTreeAttnRows - 1) / kTreeAttnRows;
}

// The padded head dim of the kernel instance: 32, 64, 128 or 256 (Dh <= Dp; columns past Dh are zero).
inline int tree_attn_padded_dh(int64_t Dh) { return Dh <= 32 ? 32 : Dh <= 64 ? 64 : Dh <= 128 ? 128 : 256; }

}  // namespace lantern::cuda
