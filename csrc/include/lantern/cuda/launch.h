// The launchers of lantern's CUDA kernels (csrc/cuda/<op>.cu), called by their torch bindings
// (csrc/cuda/bindings.cpp). Torch-free, host C++ (CUDA runtime types only): nvcc never parses torch's
// headers, which its device passes would otherwise read once per architecture, and the bindings compile with
// the host compiler alone.
//
// The bindings check and prepare the tensors (op_checks.h) and pass device pointers, sizes and element types;
// a launcher picks the kernel instance and its launch configuration, enqueues it on `stream` (the current
// stream, on the current device), and returns the first error of the CUDA runtime calls it made, or
// cudaGetLastError() after the launch. No launcher synchronises with the host.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "lantern/continuous_verify.h"
#include "lantern/cuda/tree_attention.h"

namespace lantern::cuda {

// The element type of a floating tensor a kernel reads in place.
enum class Elem { kFloat32, kFloat64, kFloat16, kBFloat16 };

// out[i] = the Philox uniform of (seed, c0[i], c1[i], c2[i], c3[i]); seed is the one-element device tensor's 64
// bits, c0..c3 and out hold n elements.
cudaError_t launch_philox_uniform(const uint64_t* seed, const int64_t* c0, const int64_t* c1, const int64_t* c2,
                                  const int64_t* c3, float* out, int64_t n, cudaStream_t stream);

// The CSpD verification of M = B * N tokens of C channels, float32 (x, mu_*, sigma_*: [M, C]; logsig_*,
// positions, accepted, tries: [M]; rows: [B]; tokens: [M, C]).
struct ContinuousVerifyLaunch {
  const float *x, *mu_p, *sigma_p, *mu_q, *sigma_q, *logsig_p, *logsig_q;
  const int64_t *rows, *positions;
  const uint64_t* seed;   // [1]
  const int64_t* offset;  // [1]
  ContinuousRule rule;
  float* tokens;
  bool* accepted;
  int32_t* tries;
  int64_t M, N, C;
};
cudaError_t launch_continuous_verify(const ContinuousVerifyLaunch& a, cudaStream_t stream);

// Dynamic shared memory compact_kv may use per block: P kept nodes x 32 threads x the copy unit must fit.
constexpr int64_t kCompactKVSharedBytes = 48 * 1024;
// Keeps the path's rows of every (leading, batch) slice of cache [L * B, H, Lmax, row_bytes], in place, copying
// vec_bytes (16, 8, 4, 2 or 1: divides row_bytes and the base pointer's alignment; 32 * P * vec_bytes <=
// kCompactKVSharedBytes) at a time. cache_len, n_keep: [B]; path_nodes: [B, P].
cudaError_t launch_compact_kv(void* cache, const int64_t* cache_len, const int64_t* path_nodes, const int64_t* n_keep,
                              int64_t L, int64_t B, int64_t H, int64_t Lmax, int64_t P, int64_t row_bytes,
                              int64_t vec_bytes, cudaStream_t stream);

// The K nearest neighbours of each of the V codes: codes_t [d, V] (the codebook transposed, contiguous) -> out
// [V, K] int32.
cudaError_t launch_latent_neighbours(const void* codes_t, Elem elem, int64_t V, int64_t d, int64_t K, int32_t* out,
                                     cudaStream_t stream);

// Tree attention over `blocks` = B * Hkv * p.blocks_per_head blocks, the kernel instance for q's element type and
// the padded head dim Dp (tree_attn_padded_dh). A Dp whose shared memory is over the default 48 KiB is opted in;
// the binding has checked that the device allows it.
cudaError_t launch_tree_attention(const TreeAttnParams& p, Elem elem, int Dp, int64_t blocks, cudaStream_t stream);

// Everything one verify launch reads and writes ([B, T, V] blocks contiguous). `in` is the element type of the
// logits and uncond, `draft_in` the drafter rows' (in's, or float32 with 16-bit logits; in's when there are
// none). The compute type Real is float64 for float64 logits, else float32: cfg_scale, temperature and the
// l / p / q scratch rows hold Real.
struct VerifyLaunch {
  Elem in, draft_in;
  const void* logits;         // [B, T, V]
  const void* uncond;         // [B, T, V] or nullptr
  const void* draft;          // [B, T, V] or nullptr
  const int64_t* tokens;      // [B, T]
  const int64_t* parents;     // [B, T]
  const int32_t* neighbours;  // [V, K] or nullptr
  const void* cfg_scale;      // [B], Real
  const void* temperature;    // [B], Real
  const int64_t* top_k;       // [B]
  const double* top_p;        // [B]
  const int64_t* seed;        // [1]
  const int64_t* offset;      // [1]
  const int64_t* rows;        // [B] or nullptr
  int32_t k;                  // neighbours used
  double delta;
  double lam;       // λ when lambda_mode
  bool lambda_mode;
  bool node_budget;
  int64_t B, T, V, K;
  void *l, *p, *q;       // [B, V] Real scratch (q: nullptr without draft)
  int32_t* tree;         // [B, T]
  int64_t* accept_len;   // [B]
  int64_t* path;         // [B, T - 1]
  int64_t* next_token;   // [B]
  int8_t* status;        // [B, T]
};
cudaError_t launch_verify(const VerifyLaunch& a, cudaStream_t stream);

}  // namespace lantern::cuda
