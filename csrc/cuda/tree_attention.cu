// CUDA binding of lantern::tree_attention (SPEC §6): checks, allocation, one launch of
// lantern::cuda::tree_attention_kernel (csrc/include/lantern/cuda/tree_attention.cuh). No host sync: cache_len is
// read on the device; a batch row whose cache_len is out of range gets NaN output (lantern.ops.tree_attention
// checks the values on the host first; the CPU kernel raises instead).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <limits>

#include "lantern/cuda/tree_attention.cuh"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

namespace lc = lantern::cuda;

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.size(-1) > 1 && t.stride(-1) != 1 ? t.contiguous() : t; }

bool fits_int32(int64_t x) { return x <= std::numeric_limits<int32_t>::max(); }

// 16-byte chunks of K/V rows are safe to read when Dh fills the padded width (no column mask) and every row
// start is 16-byte aligned: aligned base pointers and strides that are multiples of the chunk.
bool vec_loads_ok(const at::Tensor& k, const at::Tensor& v, int64_t Dh, int64_t Dp) {
  if (Dh != Dp) return false;
  const int64_t chunk = 16 / static_cast<int64_t>(k.element_size());
  for (const at::Tensor* t : {&k, &v}) {
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
    for (int d = 0; d < 3; ++d)
      if (t->size(d) > 1 && t->stride(d) % chunk != 0) return false;
  }
  return true;
}

template <typename T, int Dp>
void launch(const lc::TreeAttnParams& p, int64_t blocks) {
  constexpr int kSmem = lc::tree_attn_smem_bytes(Dp);
  auto* kernel = &lc::tree_attention_kernel<T, Dp>;
  if constexpr (kSmem > 48 * 1024) {  // beyond the default dynamic shared memory limit: opt in
    int device = 0, optin = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
    TORCH_CHECK(kSmem <= optin, "tree_attention: head dim Dh=", p.Dh, " needs ", kSmem,
                " bytes of shared memory per block; this GPU allows ", optin);
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
  }
  kernel<<<static_cast<unsigned>(blocks), lc::kTreeAttnThreads, kSmem, c10::cuda::getCurrentCUDAStream()>>>(p);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void launch_dh(const lc::TreeAttnParams& p, int64_t Dp, int64_t blocks) {
  switch (Dp) {
    case 32:
      return launch<T, 32>(p, blocks);
    case 64:
      return launch<T, 64>(p, blocks);
    case 128:
      return launch<T, 128>(p, blocks);
    default:
      return launch<T, 256>(p, blocks);
  }
}

// The padded head dim of the kernel instance: 32, 64, 128 or 256 (Dh <= Dp; columns past Dh are zero).
int64_t padded_dh(int64_t Dh) { return Dh <= 32 ? 32 : Dh <= 64 ? 64 : Dh <= 128 ? 128 : 256; }

at::Tensor tree_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& cache_len, const at::Tensor& tree_mask) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto d = lantern::check_tree_attention(q, k_cache, v_cache, cache_len, tree_mask);
  const auto dtype = q.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "tree_attention: q must be float32, float64, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(d.Dh <= lc::kTreeAttnMaxDh, "tree_attention: head dim Dh=", d.Dh,
                    " exceeds the CUDA kernel's limit of ", lc::kTreeAttnMaxDh);
  const int64_t W = (d.T + 31) / 32, G = d.H / d.Hkv;
  const int64_t blocks_per_head = lc::tree_attn_blocks_per_head(d.H, d.Hkv, d.T);
  const int64_t blocks = d.B * d.Hkv * blocks_per_head;
  TORCH_CHECK_VALUE(fits_int32(G * d.T + lc::kTreeAttnRows) && fits_int32(d.B * d.T * W) && fits_int32(d.B * d.H) &&
                        fits_int32(blocks),
                    "tree_attention: too large for the CUDA kernel's 32-bit indices (B=", d.B, ", H=", d.H, ", T=", d.T,
                    ")");
  const at::Tensor qc = last_dim_contiguous(q), kc = last_dim_contiguous(k_cache), vc = last_dim_contiguous(v_cache);
  const at::Tensor len = cache_len.contiguous(), mask = tree_mask.contiguous();  // [B], [B, T, W]
  at::Tensor o = at::empty({d.B, d.H, d.T, d.Dh}, q.options());                   // [B, H, T, Dh]
  const int64_t Dp = padded_dh(d.Dh);
  lc::TreeAttnParams p{};
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.o = o.data_ptr();
  p.cache_len = len.data_ptr<int64_t>();
  p.tree_mask = mask.data_ptr<int32_t>();
  p.q_sb = qc.stride(0), p.q_sh = qc.stride(1), p.q_st = qc.stride(2);
  p.k_sb = kc.stride(0), p.k_sh = kc.stride(1), p.k_sl = kc.stride(2);
  p.v_sb = vc.stride(0), p.v_sh = vc.stride(1), p.v_sl = vc.stride(2);
  p.Lmax = d.Lmax;
  p.B = static_cast<int>(d.B), p.H = static_cast<int>(d.H), p.Hkv = static_cast<int>(d.Hkv);
  p.T = static_cast<int>(d.T), p.Dh = static_cast<int>(d.Dh), p.W = static_cast<int>(W);
  p.blocks_per_head = static_cast<int>(blocks_per_head);
  p.qk_scale = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(d.Dh)));
  p.vec_loads = vec_loads_ok(kc, vc, d.Dh, Dp);
  switch (dtype) {
    case at::kFloat:
      launch_dh<float>(p, Dp, blocks);
      break;
    case at::kDouble:
      launch_dh<double>(p, Dp, blocks);
      break;
    case at::kHalf:
      launch_dh<__half>(p, Dp, blocks);
      break;
    default:
      launch_dh<__nv_bfloat16>(p, Dp, blocks);
      break;
  }
  return o;
}

}  // namespace

LANTERN_KERNEL(CUDA, tree_attention, &tree_attention_cuda);
