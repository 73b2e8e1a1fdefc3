// Argument checks shared by the CPU and CUDA implementations of lantern's ops (shapes, dtypes,
// devices, contiguity). Data-dependent checks live with each kernel. The Python op (lantern.ops) checks
// everything first with friendlier messages; these keep torch.ops.lantern.* safe when called directly.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/broadcast_tensors.h>
#include <c10/util/Exception.h>

#include <array>

namespace lantern {

// The cache viewed as [L, B, H, Lmax, Dh], L = product of the leading dimensions (1 if none).
struct CompactKVDims {
  int64_t L, B, H, Lmax, Dh, P;
};

inline void check_int64_on_device(const at::Tensor& t, const char* name, const at::Tensor& cache) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kLong, "compact_kv: ", name, " must be int64, got ",
                   t.scalar_type());
  TORCH_CHECK_VALUE(t.device() == cache.device(), "compact_kv: ", name, " must be on ", cache.device(),
                    " (like cache), got ", t.device());
}

// cache [..., B, Hkv, Lmax, Dh] any float dtype, contiguous; cache_len int64 [B];
// path_nodes int64 [B, P]; n_keep int64 [B].
inline CompactKVDims check_compact_kv(const at::Tensor& cache, const at::Tensor& cache_len,
                                      const at::Tensor& path_nodes, const at::Tensor& n_keep) {
  TORCH_CHECK_VALUE(cache.dim() >= 4, "compact_kv: cache must have shape [..., B, Hkv, Lmax, Dh], got ",
                    cache.sizes());
  TORCH_CHECK_TYPE(at::isFloatingType(cache.scalar_type()),
                   "compact_kv: cache must have a floating dtype, got ", cache.scalar_type());
  TORCH_CHECK_VALUE(cache.is_contiguous(), "compact_kv: cache must be contiguous (it is modified in place)");
  const int64_t d = cache.dim();
  CompactKVDims g{1, cache.size(d - 4), cache.size(d - 3), cache.size(d - 2), cache.size(d - 1), 0};
  for (int64_t i = 0; i < d - 4; ++i) g.L *= cache.size(i);
  check_int64_on_device(cache_len, "cache_len", cache);
  check_int64_on_device(path_nodes, "path_nodes", cache);
  check_int64_on_device(n_keep, "n_keep", cache);
  TORCH_CHECK_VALUE(cache_len.dim() == 1 && cache_len.size(0) == g.B, "compact_kv: cache_len must have shape [",
                    g.B, "] (B = cache.shape[-4]), got ", cache_len.sizes());
  TORCH_CHECK_VALUE(n_keep.dim() == 1 && n_keep.size(0) == g.B, "compact_kv: n_keep must have shape [", g.B,
                    "], got ", n_keep.sizes());
  TORCH_CHECK_VALUE(path_nodes.dim() == 2 && path_nodes.size(0) == g.B, "compact_kv: path_nodes must have shape [",
                    g.B, ", P], got ", path_nodes.sizes());
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

}  // namespace lantern
