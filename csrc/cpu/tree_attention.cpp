// CPU kernel of lantern::tree_attention (SPEC §6): one call per layer, parallel over (batch row, kv head,
// query block); the work is lantern::cpu::attend_item (csrc/include/lantern/cpu/tree_attention.h).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "lantern/cpu/tree_attention.h"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

lantern::cpu::DType attn_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return lantern::cpu::DType::kFloat32;
    case at::kDouble:
      return lantern::cpu::DType::kFloat64;
    case at::kBFloat16:
      return lantern::cpu::DType::kBFloat16;
    case at::kHalf:
      return lantern::cpu::DType::kFloat16;
    default:
      TORCH_CHECK_TYPE(false, "tree_attention: q must be float32, float64, bfloat16 or float16, got ", t.scalar_type());
  }
  return lantern::cpu::DType::kFloat32;  // not reached
}

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.size(-1) > 1 && t.stride(-1) != 1 ? t.contiguous() : t; }

at::Tensor tree_attention_cpu(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                              const at::Tensor& cache_len, const at::Tensor& tree_mask) {
  const auto d = lantern::check_tree_attention(q, k_cache, v_cache, cache_len, tree_mask);
  const at::Tensor qc = last_dim_contiguous(q), kc = last_dim_contiguous(k_cache), vc = last_dim_contiguous(v_cache);
  const at::Tensor len = cache_len.contiguous(), mask = tree_mask.contiguous();
  at::Tensor o = at::empty({d.B, d.H, d.T, d.Dh}, q.options());  // [B, H, T, Dh]
  const int64_t* len_p = len.data_ptr<int64_t>();
  for (int64_t b = 0; b < d.B; ++b)
    TORCH_CHECK_VALUE(len_p[b] >= 0 && len_p[b] + d.T <= d.Lmax, "tree_attention: cache_len[", b, "] = ", len_p[b],
                      " must satisfy 0 <= cache_len and cache_len + T <= Lmax (T=", d.T, ", Lmax=", d.Lmax, ")");
  lantern::cpu::AttnProblem p{qc.data_ptr(), kc.data_ptr(), vc.data_ptr(), o.data_ptr(),
                              attn_dtype(q), qc.stride(0),  qc.stride(1),  qc.stride(2),
                              kc.stride(0),  kc.stride(1),  kc.stride(2),  vc.stride(0),
                              vc.stride(1),  vc.stride(2),  len_p,         mask.data_ptr<int32_t>(),
                              d.B,           d.H,           d.Hkv,         d.T,
                              d.Dh,          d.Lmax,        mask.size(2)};
  const int64_t items = d.B * d.Hkv * lantern::cpu::attn_blocks_per_head(p);
  at::parallel_for(0, items, 1, [&](int64_t lo, int64_t hi) {
    lantern::cpu::AttnScratch ws;
    ws.resize(d.Dh);
    for (int64_t item = lo; item < hi; ++item) lantern::cpu::attend_item(p, item, ws);
  });
  return o;
}

}  // namespace

LANTERN_KERNEL(CPU, tree_attention, &tree_attention_cpu);
