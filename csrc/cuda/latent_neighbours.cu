// CUDA kernel of lantern::latent_neighbours (SPEC §2): one launch, no host sync; the work is
// lantern::cuda::latent_neighbours_kernel (csrc/include/lantern/cuda/latent_neighbours.cuh).
//
// The binding reads float32 / float64 / float16 / bfloat16 codebooks in place (the kernel converts each
// element to float32 exactly as .to(float32) does); other floating dtypes, and every codebook when
// `normalize`, are first converted with .to(float32) and normalised with the ATen ops F.normalize uses,
// on the device, so the rows are the reference's bits. The kernel reads the codebook transposed, [d, V].
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/norm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "lantern/cuda/latent_neighbours.cuh"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

// Caches the row's V distances in shared memory when they fit beside the sort buffer; otherwise every
// radix pass recomputes them.
template <typename T>
void launch(const at::Tensor& ct, int64_t V, int64_t d, int64_t K, at::Tensor& out) {
  const uint32_t seg_cap = lantern::cuda::nbr_segment_capacity(K);
  const size_t static_bytes = sizeof(lantern::cuda::nbr::Shared);
  int shared_limit = 0;  // bytes of shared memory a CTA may opt in to
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, c10::cuda::current_device()));
  const bool cached =
      lantern::cuda::nbr_shared_bytes(V, seg_cap, true) + static_bytes <= static_cast<size_t>(shared_limit);
  const size_t bytes = lantern::cuda::nbr_shared_bytes(V, seg_cap, cached);
  const auto kernel =
      cached ? lantern::cuda::latent_neighbours_kernel<T, true> : lantern::cuda::latent_neighbours_kernel<T, false>;
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
  kernel<<<static_cast<unsigned>(V), lantern::cuda::kNbrThreads, bytes, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const T*>(ct.const_data_ptr()), V, d, K, seg_cap, out.mutable_data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor latent_neighbours_cuda(const at::Tensor& codebook, int64_t K, bool normalize) {
  const c10::cuda::CUDAGuard guard(codebook.device());
  lantern::check_latent_neighbours(codebook, K);
  at::Tensor codes = codebook.detach();  // [V, d]
  const at::ScalarType dtype = codes.scalar_type();
  const bool read_in_place =
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
  if (normalize || !read_in_place) codes = codes.to(at::kFloat);
  if (normalize) codes = at::div(codes, codes.norm(2, {1}, /*keepdim=*/true).clamp_min(1e-12));  // F.normalize
  const at::Tensor ct = codes.t().contiguous();  // [d, V]
  const int64_t V = codes.size(0), d = codes.size(1);
  at::Tensor out = at::empty({V, K}, codebook.options().dtype(at::kInt));  // [V, K]
  switch (ct.scalar_type()) {
    case at::kFloat:
      launch<float>(ct, V, d, K, out);
      break;
    case at::kDouble:
      launch<double>(ct, V, d, K, out);
      break;
    case at::kHalf:
      launch<__half>(ct, V, d, K, out);
      break;
    case at::kBFloat16:
      launch<__nv_bfloat16>(ct, V, d, K, out);
      break;
    default:
      TORCH_CHECK(false, "latent_neighbours: internal error, unexpected dtype ", ct.scalar_type());
  }
  return out;
}

}  // namespace

LANTERN_KERNEL(CUDA, latent_neighbours, &latent_neighbours_cuda);
