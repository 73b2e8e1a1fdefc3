// Argument checks shared by the CPU and CUDA implementations of lantern's ops (shapes, dtypes,
// devices, contiguity). Data-dependent checks live with each kernel. The Python op (lantern.ops) checks
// everything first with friendlier messages; these keep torch.ops.lantern.* safe when called directly.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/broadcast_tensors.h>
#include <c10/util/Exception.h>
#include <c10/util/string_view.h>
#include <ATen/ops/empty.h>

#include "lantern/continuous_verify.h"

#include <array>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>

namespace lantern {

// The cache viewed as [L, B, H, Lmax, Dh], L = product of the leading dimensions (1 if none).
struct CompactKVDims {
  int64_t L, B, H, Lmax, Dh, P;
};

// Whether the memory spans of a and b (first to last element; torch strides are never negative) intersect.
// Conservative: two strided views that interleave without sharing an element count as overlapping.
inline bool memory_overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (a.numel() == 0 || b.numel() == 0 || a.device() != b.device()) return false;
  const auto span = [](const at::Tensor& t) {
    int64_t extent = 0;  // elements from the first to the last
    for (int64_t d = 0; d < t.dim(); ++d) extent += (t.size(d) - 1) * t.stride(d);
    const auto first = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::pair<uintptr_t, uintptr_t>{first, first + static_cast<uintptr_t>((extent + 1) * t.element_size())};
  };
  const auto [a0, a1] = span(a);
  const auto [b0, b1] = span(b);
  return a0 < b1 && b0 < a1;
}

inline void check_int64_on_device(const at::Tensor& t, const char* name, const at::Tensor& cache) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, "compact_kv: ", name, " must be int64, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == cache.device(), "compact_kv: ", name, " must be on ", cache.device(),
                    " (like cache), got ", t.device());
}

// cache [..., B, Hkv, Lmax, Dh] any float dtype, contiguous; cache_len int64 [B];
// path_nodes int64 [B, P]; n_keep int64 [B]; none of the three in cache's memory.
inline CompactKVDims check_compact_kv(const at::Tensor& cache, const at::Tensor& cache_len,
                                      const at::Tensor& path_nodes, const at::Tensor& n_keep) {
  TORCH_CHECK_VALUE(cache.dim() >= 4, "compact_kv: cache must have shape [..., B, Hkv, Lmax, Dh], got ", cache.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(cache.scalar_type()), "compact_kv: cache must have a floating dtype, got ",
                   cache.scalar_type());
  TORCH_CHECK_VALUE(cache.is_contiguous(), "compact_kv: cache must be contiguous (it is modified in place)");
  const int64_t d = cache.dim();
  CompactKVDims g{1, cache.size(d - 4), cache.size(d - 3), cache.size(d - 2), cache.size(d - 1), 0};
  for (int64_t i = 0; i < d - 4; ++i) g.L *= cache.size(i);
  check_int64_on_device(cache_len, "cache_len", cache);
  check_int64_on_device(path_nodes, "path_nodes", cache);
  check_int64_on_device(n_keep, "n_keep", cache);
  // The kernels read the lengths and indices while they write the cache: inputs in its memory would be
  // overwritten mid-copy (and then index outside it).
  for (const auto& [t, name] :
       {std::pair{&cache_len, "cache_len"}, std::pair{&path_nodes, "path_nodes"}, std::pair{&n_keep, "n_keep"}})
    TORCH_CHECK_VALUE(!memory_overlaps(cache, *t), "compact_kv: ", name,
                      " overlaps the memory of cache, which is modified in place; pass a copy");
  TORCH_CHECK_VALUE(cache_len.dim() == 1 && cache_len.size(0) == g.B, "compact_kv: cache_len must have shape [", g.B,
                    "] (B = cache.shape[-4]), got ", cache_len.sizes());
  TORCH_CHECK_VALUE(n_keep.dim() == 1 && n_keep.size(0) == g.B, "compact_kv: n_keep must have shape [", g.B, "], got ",
                    n_keep.sizes());
  TORCH_CHECK_VALUE(path_nodes.dim() == 2 && path_nodes.size(0) == g.B, "compact_kv: path_nodes must have shape [", g.B,
                    ", P], got ", path_nodes.sizes());
  g.P = path_nodes.size(1);
  return g;
}

// seed: one int64 (or uint64) element holding the 64-bit seed's bits, on the counters' device (a device
// tensor, so a captured CUDA graph can replay with a new seed). Counters: integer tensors that broadcast;
// each value is taken modulo 2^32. Returns the counters broadcast and materialised as int64, contiguous.
inline std::array<at::Tensor, 4> check_philox(const at::Tensor& seed, const at::Tensor& c0, const at::Tensor& c1,
                                              const at::Tensor& c2, const at::Tensor& c3) {
  const std::array<const at::Tensor*, 4> cs{&c0, &c1, &c2, &c3};
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& c = *cs[i];
    TORCH_CHECK_TYPE(at::isIntegralType(c.scalar_type(), /*includeBool=*/false), "philox_uniform: c", i,
                     " must be an integer tensor, got ", c.scalar_type());
    TORCH_CHECK_VALUE(c.device() == c0.device(), "philox_uniform: c", i, " must be on ", c0.device(),
                      " (like c0), got ", c.device());
  }
  TORCH_CHECK_TYPE(seed.scalar_type() == at::kLong || seed.scalar_type() == at::kUInt64,
                   "philox_uniform: seed must be an int64 tensor (the seed's 64 bits), got ", seed.scalar_type());
  TORCH_CHECK_VALUE(seed.numel() == 1, "philox_uniform: seed must have one element, got shape ", seed.sizes());
  TORCH_CHECK_VALUE(seed.device() == c0.device(), "philox_uniform: seed must be on ", c0.device(),
                    " (like the counters), got ", seed.device());
  auto b = at::broadcast_tensors({c0, c1, c2, c3});
  std::array<at::Tensor, 4> out;
  for (int i = 0; i < 4; ++i) out[i] = b[i].to(at::kLong).contiguous();
  return out;
}

// ---- verify (SPEC §3-§5) ------------------------------------------------------------------------------

struct VerifyDims {
  int64_t B, T, V, K;
};

inline void check_float_block(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kFloat || t.scalar_type() == at::kDouble ||
                       t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf,
                   "verify: ", name, " must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == like.device(), "verify: ", name, " must be on ", like.device(), ", got ", t.device());
  TORCH_CHECK_VALUE(t.sizes() == like.sizes(), "verify: ", name, " must have shape ", like.sizes(),
                    " (like logits), got ", t.sizes());
}

inline void check_row_setting(const at::Tensor& t, const char* name, at::ScalarType dtype, int64_t B,
                              const at::Tensor& like) {
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "verify: ", name, " must be a ", dtype, " tensor, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == B, "verify: ", name, " must have shape [", B, "], got ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == like.device(), "verify: ", name, " must be on ", like.device(), ", got ", t.device());
}

inline void check_counter_tensor(const at::Tensor& t, const char* name, const at::Tensor& like) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, "verify: ", name, " must be an int64 tensor, got ", t.scalar_type());
  TORCH_CHECK_VALUE(t.numel() == 1, "verify: ", name, " must have one element, got shape ", t.sizes());
  TORCH_CHECK_VALUE(t.device() == like.device(), "verify: ", name, " must be on ", like.device(), ", got ", t.device());
}

// logits [B, T, V] float; tokens, parents int64 [B, T]; neighbours int32 [V, K] (required when k > 0);
// uncond_logits, draft_probs like logits; cfg_scale, temperature [B] in the compute type (float64 for
// float64 logits, else float32); top_k int64 [B];
// top_p float64 [B]; 0 <= k <= K; seed, offset one-element int64; rows int64 [B] or None. Values (token ids,
// tree order, neighbour ids) are checked by the kernel as it reads them.
inline VerifyDims check_verify(const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
                               const std::optional<at::Tensor>& neighbours,
                               const std::optional<at::Tensor>& uncond_logits, const at::Tensor& cfg_scale,
                               const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
                               const std::optional<at::Tensor>& draft_probs, int64_t k, const at::Tensor& seed,
                               const at::Tensor& offset, const std::optional<at::Tensor>& rows) {
  TORCH_CHECK_VALUE(logits.dim() == 3 && logits.size(1) >= 1 && logits.size(2) >= 1,
                    "verify: logits must have shape [B, T, V] with T, V >= 1, got ", logits.sizes());
  check_float_block(logits, "logits", logits);
  const int64_t B = logits.size(0), T = logits.size(1), V = logits.size(2);
  TORCH_CHECK_VALUE(V <= (int64_t{1} << 31) - 1 && T <= (int64_t{1} << 31) - 1, "verify: V and T must fit in int32");
  for (const auto& [t, name] : {std::pair{&tokens, "tokens"}, std::pair{&parents, "parents"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kLong, "verify: ", name, " must be int64, got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == B && t->size(1) == T, "verify: ", name, " must have shape [", B,
                      ", ", T, "], got ", t->sizes());
    TORCH_CHECK_VALUE(t->device() == logits.device(), "verify: ", name, " must be on ", logits.device());
  }
  if (uncond_logits) check_float_block(*uncond_logits, "uncond_logits", logits);
  if (draft_probs) check_float_block(*draft_probs, "draft_probs", logits);
  const auto real = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;  // the compute type
  check_row_setting(cfg_scale, "cfg_scale", real, B, logits);
  check_row_setting(temperature, "temperature", real, B, logits);
  check_row_setting(top_k, "top_k", at::kLong, B, logits);
  check_row_setting(top_p, "top_p", at::kDouble, B, logits);
  check_counter_tensor(seed, "seed", logits);
  check_counter_tensor(offset, "offset", logits);
  if (rows) {
    TORCH_CHECK_TYPE(rows->scalar_type() == at::kLong, "verify: rows must be int64, got ", rows->scalar_type());
    TORCH_CHECK_VALUE(rows->dim() == 1 && rows->size(0) == B, "verify: rows must have shape [", B, "], got ",
                      rows->sizes());
    TORCH_CHECK_VALUE(rows->device() == logits.device(), "verify: rows must be on ", logits.device(), ", got ",
                      rows->device());
  }
  int64_t K = 0;
  if (neighbours) {
    TORCH_CHECK_TYPE(neighbours->scalar_type() == at::kInt, "verify: neighbours must be int32, got ",
                     neighbours->scalar_type());
    TORCH_CHECK_VALUE(neighbours->dim() == 2 && neighbours->size(0) == V, "verify: neighbours must have shape [", V,
                      ", K], got ", neighbours->sizes());
    TORCH_CHECK_VALUE(neighbours->device() == logits.device(), "verify: neighbours must be on ", logits.device());
    K = neighbours->size(1);
  }
  TORCH_CHECK_VALUE(k >= 0, "verify: k must be >= 0, got ", k);
  TORCH_CHECK_VALUE(k == 0 || neighbours.has_value(), "verify: neighbours must be given when k > 0 (k=", k, ")");
  TORCH_CHECK_VALUE(k <= K || k == 0, "verify: k=", k, " exceeds the neighbour table width K=", K);
  return {B, T, V, K};
}

// ---- tree_attention (SPEC §6) -----------------------------------------------------------------------

struct TreeAttentionDims {
  int64_t B, H, Hkv, T, Dh, Lmax;
};

// q [B, H, T, Dh] float; k_cache, v_cache [B, Hkv, Lmax, Dh] of q's dtype and device, H % Hkv == 0;
// cache_len int64 [B]; tree_mask int32 [B, T, ceil(T/32)]. (cache_len's values are checked by the kernel.)
inline TreeAttentionDims check_tree_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                              const at::Tensor& cache_len, const at::Tensor& tree_mask) {
  TORCH_CHECK_VALUE(q.dim() == 4 && q.numel() > 0, "tree_attention: q must have non-empty shape [B, H, T, Dh], got ",
                    q.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(q.scalar_type()), "tree_attention: q must be floating, got ", q.scalar_type());
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), Dh = q.size(3);
  for (const auto& [t, name] : {std::pair{&k_cache, "k_cache"}, std::pair{&v_cache, "v_cache"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == q.scalar_type(), "tree_attention: ", name, " must have q's dtype ",
                     q.scalar_type(), ", got ", t->scalar_type());
    TORCH_CHECK_VALUE(t->device() == q.device(), "tree_attention: ", name, " must be on ", q.device());
    TORCH_CHECK_VALUE(t->dim() == 4 && t->size(0) == B && t->size(3) == Dh && t->size(1) >= 1, "tree_attention: ", name,
                      " must have shape [", B, ", Hkv, Lmax, ", Dh, "], got ", t->sizes());
  }
  TORCH_CHECK_VALUE(v_cache.sizes() == k_cache.sizes(), "tree_attention: v_cache must have k_cache's shape ",
                    k_cache.sizes(), ", got ", v_cache.sizes());
  const int64_t Hkv = k_cache.size(1), Lmax = k_cache.size(2);
  TORCH_CHECK_VALUE(H % Hkv == 0, "tree_attention: H=", H, " must be a multiple of Hkv=", Hkv, " (GQA)");
  TORCH_CHECK_TYPE(cache_len.scalar_type() == at::kLong, "tree_attention: cache_len must be int64");
  TORCH_CHECK_VALUE(cache_len.dim() == 1 && cache_len.size(0) == B && cache_len.device() == q.device(),
                    "tree_attention: cache_len must have shape [", B, "] on ", q.device(), ", got ", cache_len.sizes());
  TORCH_CHECK_TYPE(tree_mask.scalar_type() == at::kInt, "tree_attention: tree_mask must be int32");
  TORCH_CHECK_VALUE(tree_mask.dim() == 3 && tree_mask.size(0) == B && tree_mask.size(1) == T &&
                        tree_mask.size(2) == (T + 31) / 32 && tree_mask.device() == q.device(),
                    "tree_attention: tree_mask must have shape [", B, ", ", T, ", ", (T + 31) / 32, "] on ", q.device(),
                    ", got ", tree_mask.sizes());
  return {B, H, Hkv, T, Dh, Lmax};
}

// ---- latent_neighbours (SPEC §2) ----------------------------------------------------------------------

inline void check_latent_neighbours(const at::Tensor& codebook, int64_t K) {
  TORCH_CHECK_VALUE(codebook.dim() == 2 && codebook.size(0) >= 2 && codebook.size(1) >= 1,
                    "latent_neighbours: codebook must have shape [V >= 2, d >= 1], got ", codebook.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(codebook.scalar_type()), "latent_neighbours: codebook must be floating, got ",
                   codebook.scalar_type());
  TORCH_CHECK_VALUE(codebook.size(0) <= (int64_t{1} << 31) - 1, "latent_neighbours: V must fit in int32");
  TORCH_CHECK_VALUE(K >= 1 && K <= codebook.size(0) - 1,
                    "latent_neighbours: K must be in [1, V - 1 = ", codebook.size(0) - 1, "], got ", K);
}

// ---- continuous_verify (docs/cspd.md) ----------------------------------------------------------------------

struct ContinuousVerifyDims {
  int64_t B, N, C;
};

// draft, mu_p, sigma_p, mu_q, sigma_q float32 [B, N, C]; logsig_p, logsig_q float32 [B, N]; rows int64 [B];
// positions int64 [B, N]; rule "exact" | "paper"; sigma_ratio "paper" | "code"; bandwidth > 0 (1 for exact);
// max_tries >= 1; seed, offset one-element int64; all on draft's device. Values (NaN, stds <= 0) are
// checked by lantern.ops.continuous_verify; they cannot make the kernels read or write out of bounds.
inline ContinuousVerifyDims check_continuous_verify(const at::Tensor& draft, const at::Tensor& mu_p,
                                                    const at::Tensor& sigma_p, const at::Tensor& mu_q,
                                                    const at::Tensor& sigma_q, const at::Tensor& logsig_p,
                                                    const at::Tensor& logsig_q, const at::Tensor& rows,
                                                    const at::Tensor& positions, c10::string_view rule,
                                                    double bandwidth, c10::string_view sigma_ratio, int64_t max_tries,
                                                    const at::Tensor& seed, const at::Tensor& offset) {
  TORCH_CHECK_VALUE(draft.dim() == 3 && draft.size(2) >= 1,
                    "continuous_verify: draft must have shape [B, N, C] with C >= 1, got ", draft.sizes());
  const int64_t B = draft.size(0), N = draft.size(1), C = draft.size(2);
  const std::pair<const at::Tensor*, const char*> blocks[] = {
      {&draft, "draft"}, {&mu_p, "mu_p"}, {&sigma_p, "sigma_p"}, {&mu_q, "mu_q"}, {&sigma_q, "sigma_q"}};
  for (const auto& [t, name] : blocks) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, "continuous_verify: ", name, " must be float32, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->device() == draft.device(), "continuous_verify: ", name, " must be on ", draft.device(),
                      ", got ", t->device());
    TORCH_CHECK_VALUE(t->sizes() == draft.sizes(), "continuous_verify: ", name, " must have shape ", draft.sizes(),
                      " (like draft), got ", t->sizes());
  }
  const std::pair<const at::Tensor*, const char*> sums[] = {{&logsig_p, "logsig_p"}, {&logsig_q, "logsig_q"}};
  for (const auto& [t, name] : sums) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kFloat, "continuous_verify: ", name, " must be float32, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->device() == draft.device() && t->dim() == 2 && t->size(0) == B && t->size(1) == N,
                      "continuous_verify: ", name, " must have shape [", B, ", ", N, "] on ", draft.device(), ", got ",
                      t->sizes(), " on ", t->device());
  }
  TORCH_CHECK_TYPE(rows.scalar_type() == at::kLong && positions.scalar_type() == at::kLong,
                   "continuous_verify: rows and positions must be int64");
  TORCH_CHECK_VALUE(rows.device() == draft.device() && rows.dim() == 1 && rows.size(0) == B,
                    "continuous_verify: rows must have shape [", B, "] on ", draft.device(), ", got ", rows.sizes());
  TORCH_CHECK_VALUE(
      positions.device() == draft.device() && positions.dim() == 2 && positions.size(0) == B && positions.size(1) == N,
      "continuous_verify: positions must have shape [", B, ", ", N, "] on ", draft.device(), ", got ",
      positions.sizes());
  TORCH_CHECK_VALUE(rule == "exact" || rule == "paper", "continuous_verify: rule must be 'exact' or 'paper', got '",
                    rule, "'");
  TORCH_CHECK_VALUE(sigma_ratio == "paper" || sigma_ratio == "code",
                    "continuous_verify: sigma_ratio must be 'paper' or 'code', got '", sigma_ratio, "'");
  TORCH_CHECK_VALUE(std::isfinite(bandwidth) && bandwidth > 0, "continuous_verify: bandwidth must be > 0, got ",
                    bandwidth);
  TORCH_CHECK_VALUE(max_tries >= 1 && max_tries < (int64_t{1} << 31) - 1,
                    "continuous_verify: max_tries must be in [1, 2^31 - 1), got ", max_tries);
  for (const auto& [t, name] : {std::pair{&seed, "seed"}, std::pair{&offset, "offset"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kLong, "continuous_verify: ", name, " must be an int64 tensor, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->numel() == 1 && t->device() == draft.device(), "continuous_verify: ", name,
                      " must have one element on ", draft.device());
  }
  return {B, N, C};
}

// The kernels' view of a checked call: contiguous inputs, the rule, and the outputs (tokens float32 [B, N, C],
// accepted bool [B, N], tries int32 [B, N]), allocated on draft's device.
struct ContinuousVerifyCall {
  ContinuousVerifyDims dims;
  ContinuousRule rule;
  at::Tensor x, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions;
  at::Tensor tokens, accepted, tries;
};

inline ContinuousVerifyCall prepare_continuous_verify(const at::Tensor& draft, const at::Tensor& mu_p,
                                                      const at::Tensor& sigma_p, const at::Tensor& mu_q,
                                                      const at::Tensor& sigma_q, const at::Tensor& logsig_p,
                                                      const at::Tensor& logsig_q, const at::Tensor& rows,
                                                      const at::Tensor& positions, c10::string_view rule,
                                                      double bandwidth, c10::string_view sigma_ratio, int64_t max_tries,
                                                      const at::Tensor& seed, const at::Tensor& offset) {
  const auto g = check_continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions, rule,
                                         bandwidth, sigma_ratio, max_tries, seed, offset);
  const ContinuousRule how{rule == "paper", sigma_ratio == "code", static_cast<float>(bandwidth),
                           static_cast<int32_t>(max_tries)};
  return {g,
          how,
          draft.contiguous(),
          mu_p.contiguous(),
          sigma_p.contiguous(),
          mu_q.contiguous(),
          sigma_q.contiguous(),
          logsig_p.contiguous(),
          logsig_q.contiguous(),
          rows.contiguous(),
          positions.contiguous(),
          at::empty({g.B, g.N, g.C}, draft.options()),
          at::empty({g.B, g.N}, draft.options().dtype(at::kBool)),
          at::empty({g.B, g.N}, draft.options().dtype(at::kInt))};
}

// ---- draft_sample (SPEC §5, "Sampled drafts") ------------------------------------------------------------

struct DraftSampleDims {
  int64_t B, N, V;
};

// logits [B, N, V] float (float32, float64, bfloat16, float16); uncond_logits like logits; cfg_scale,
// temperature [B] in the compute type (float64 for float64 logits, else float32); top_k int64 [B]; top_p
// float64 [B]; 1 <= draws <= V; seed, offset one-element int64; node_ids int64 [B, N]; rows int64 [B] or None.
inline DraftSampleDims check_draft_sample(const at::Tensor& logits, const std::optional<at::Tensor>& uncond_logits,
                                          const at::Tensor& cfg_scale, const at::Tensor& temperature,
                                          const at::Tensor& top_k, const at::Tensor& top_p, int64_t draws,
                                          const at::Tensor& seed, const at::Tensor& node_ids, const at::Tensor& offset,
                                          const std::optional<at::Tensor>& rows) {
  TORCH_CHECK_VALUE(logits.dim() == 3 && logits.size(2) >= 1,
                    "draft_sample: logits must have shape [B, N, V] with V >= 1, got ", logits.sizes());
  const auto floating = [](const at::Tensor& t) {
    const auto s = t.scalar_type();
    return s == at::kFloat || s == at::kDouble || s == at::kBFloat16 || s == at::kHalf;
  };
  TORCH_CHECK_TYPE(floating(logits), "draft_sample: logits must be float32, float64, bfloat16 or float16, got ",
                   logits.scalar_type());
  const int64_t B = logits.size(0), N = logits.size(1), V = logits.size(2);
  TORCH_CHECK_VALUE(V <= (int64_t{1} << 31) - 1, "draft_sample: V must fit in int32, got ", V);
  if (uncond_logits) {
    TORCH_CHECK_TYPE(floating(*uncond_logits),
                     "draft_sample: uncond_logits must be float32, float64, bfloat16 or "
                     "float16, got ",
                     uncond_logits->scalar_type());
    TORCH_CHECK_VALUE(uncond_logits->sizes() == logits.sizes() && uncond_logits->device() == logits.device(),
                      "draft_sample: uncond_logits must have logits' shape ", logits.sizes(), " and device, got ",
                      uncond_logits->sizes(), " on ", uncond_logits->device());
  }
  const auto real = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;  // the compute type
  const std::pair<const at::Tensor*, at::ScalarType> settings[] = {
      {&cfg_scale, real}, {&temperature, real}, {&top_k, at::kLong}, {&top_p, at::kDouble}};
  const char* names[] = {"cfg_scale", "temperature", "top_k", "top_p"};
  for (int i = 0; i < 4; ++i) {
    const at::Tensor& t = *settings[i].first;
    TORCH_CHECK_TYPE(t.scalar_type() == settings[i].second, "draft_sample: ", names[i], " must be a ",
                     settings[i].second, " tensor, got ", t.scalar_type());
    TORCH_CHECK_VALUE(t.dim() == 1 && t.size(0) == B && t.device() == logits.device(), "draft_sample: ", names[i],
                      " must have shape [", B, "] on ", logits.device(), ", got ", t.sizes(), " on ", t.device());
  }
  TORCH_CHECK_VALUE(draws >= 1 && draws <= V, "draft_sample: draws must be in [1, V=", V, "], got ", draws);
  for (const auto& [t, name] : {std::pair{&seed, "seed"}, std::pair{&offset, "offset"}}) {
    TORCH_CHECK_TYPE(t->scalar_type() == at::kLong, "draft_sample: ", name, " must be an int64 tensor, got ",
                     t->scalar_type());
    TORCH_CHECK_VALUE(t->numel() == 1, "draft_sample: ", name, " must have one element, got shape ", t->sizes());
  }
  TORCH_CHECK_TYPE(node_ids.scalar_type() == at::kLong, "draft_sample: node_ids must be int64, got ",
                   node_ids.scalar_type());
  TORCH_CHECK_VALUE(
      node_ids.dim() == 2 && node_ids.size(0) == B && node_ids.size(1) == N && node_ids.device() == logits.device(),
      "draft_sample: node_ids must have shape [", B, ", ", N, "] on ", logits.device(), ", got ", node_ids.sizes(),
      " on ", node_ids.device());
  if (rows) {
    TORCH_CHECK_TYPE(rows->scalar_type() == at::kLong, "draft_sample: rows must be int64, got ", rows->scalar_type());
    TORCH_CHECK_VALUE(rows->dim() == 1 && rows->size(0) == B && rows->device() == logits.device(),
                      "draft_sample: rows must have shape [", B, "] on ", logits.device(), ", got ", rows->sizes());
  }
  return {B, N, V};
}

}  // namespace lantern
