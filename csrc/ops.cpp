// lantern._C: the schemas of lantern's custom ops (torch.ops.lantern.*) and a tiny Python module.
// Kernels live in one file per op per backend: csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <string>

#include "lantern_build_info.h"  // LANTERN_BUILD_INFO, written by setup.py into build/generated

TORCH_LIBRARY(lantern, m) {
  // SPEC §6. cache [..., B, Hkv, Lmax, Dh] (any float dtype, contiguous) is modified in place: for
  // i < n_keep[b], position cache_len[b] + i <- cache_len[b] + path_nodes[b, i], every source read before
  // anything is written (so any order is safe). cache_len, n_keep int64 [B]; path_nodes int64 [B, P], -1 padded.
  // Returns cache_len + n_keep.
  m.def("compact_kv(Tensor(a!) cache, Tensor cache_len, Tensor path_nodes, Tensor n_keep) -> Tensor");
  // SPEC §5. float32 uniforms from Philox4x32-10 word 0, shape = broadcast of the counters. The seed is a
  // one-element int64 tensor on the counters' device holding the 64-bit seed's bits (values >= 2^63 as
  // negative int64): a device tensor, so a captured CUDA graph can replay with a new seed. Counters are
  // integer tensors taken modulo 2^32; the offset (c3) may likewise be a device tensor.
  m.def("philox_uniform(Tensor seed, Tensor c0, Tensor c1, Tensor c2, Tensor c3) -> Tensor");
  // SPEC §3-§5. One call for the whole batch. logits [B, T, V] (float32/bfloat16/float16/float64, computed in
  // float32); tokens, parents int64 [B, T]; neighbours int32 [V, K] (needed when k > 0); uncond_logits and
  // draft_probs like logits; per-row settings cfg_scale, temperature float32 [B], top_k int64 [B], top_p
  // float64 [B]; lam given = lambda mode; node_budget = budget "node"; seed, offset one-element int64 (seed's
  // 64 bits; offset taken modulo 2^32); rows int64 [B] or None: the Philox counter's row word of each row
  // (taken modulo 2^32; None: the row index b). Returns (accept_len [B] int64, path [B, T-1] int64 (-1 padded),
  // next_token [B] int64, node_status [B, T] int8: 1 accepted / passed, 0 rejected, -1 not tested).
  m.def(
      "verify(Tensor logits, Tensor tokens, Tensor parents, Tensor? neighbours, Tensor? uncond_logits, "
      "Tensor cfg_scale, Tensor temperature, Tensor top_k, Tensor top_p, Tensor? draft_probs, int k, float delta, "
      "float? lam, bool node_budget, Tensor seed, Tensor offset, Tensor? rows=None) "
      "-> (Tensor, Tensor, Tensor, Tensor)");
  // SPEC §2. codebook [V, d] float -> int32 [V, K]: the K nearest other codes of each code by (float32 squared
  // distance, index), nearest first; rows L2-normalised first when normalize.
  m.def("latent_neighbours(Tensor codebook, int K, bool normalize) -> Tensor");
  // SPEC §6. q [B, H, T, Dh]; k_cache, v_cache [B, Hkv, Lmax, Dh] (q's dtype, stride-1 last dimension);
  // cache_len int64 [B]; tree_mask int32 [B, T, ceil(T/32)] -> o [B, H, T, Dh] in q's dtype (float32 math).
  // docs/cspd.md. One call for a block of B x N continuous tokens: draft, mu_p, sigma_p, mu_q, sigma_q float32
  // [B, N, C]; logsig_p, logsig_q float32 [B, N] (log-std sums over the non-final steps); rows int64 [B],
  // positions int64 [B, N] (Philox keys c1, c2); rule "exact" | "paper"; bandwidth (paper); sigma_ratio
  // "paper" | "code"; max_tries >= 1; seed, offset one-element int64 (c3 = offset + try). Returns (tokens
  // float32 [B, N, C], accepted bool [B, N], tries int32 [B, N]: 0 accepted, k proposal k kept, max_tries + 1
  // capped with the last proposal kept).
  m.def(
      "continuous_verify(Tensor draft, Tensor mu_p, Tensor sigma_p, Tensor mu_q, Tensor sigma_q, Tensor logsig_p, "
      "Tensor logsig_q, Tensor rows, Tensor positions, str rule, float bandwidth, str sigma_ratio, int max_tries, "
      "Tensor seed, Tensor offset) -> (Tensor, Tensor, Tensor)");
  m.def("tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_len, Tensor tree_mask) -> Tensor");
}

static bool cuda_compiled() {
#ifdef LANTERN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lantern's C++/CUDA kernels, registered as torch.ops.lantern.*";
  m.def("cuda_compiled", &cuda_compiled, "Whether this build contains the CUDA kernels (csrc/cuda).");
  m.def("build_info", []() { return std::string(LANTERN_BUILD_INFO); },
        "One line written by setup.py at build time: with or without CUDA kernels, for which architectures.");
}
