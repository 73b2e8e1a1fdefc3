// CUDA launcher of lantern::latent_neighbours (SPEC §2; lantern/cuda/launch.h): one launch, no host sync; the
// work is lantern::cuda::latent_neighbours_kernel (csrc/include/lantern/cuda/latent_neighbours.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "lantern/cuda/latent_neighbours.cuh"
#include "lantern/cuda/launch.h"

namespace {

// Caches the row's V distances in shared memory when they fit beside the sort buffer; otherwise every
// radix pass recomputes them.
template <typename T>
cudaError_t launch(const void* ct, int64_t V, int64_t d, int64_t K, int32_t* out, cudaStream_t stream) {
  const uint32_t seg_cap = lantern::cuda::nbr_segment_capacity(K);
  const size_t static_bytes = sizeof(lantern::cuda::nbr::Shared);
  int device = 0, shared_limit = 0;  // bytes of shared memory a CTA may opt in to
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&shared_limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device);
  if (err != cudaSuccess) return err;
  const bool cached =
      lantern::cuda::nbr_shared_bytes(V, seg_cap, true) + static_bytes <= static_cast<size_t>(shared_limit);
  const size_t bytes = lantern::cuda::nbr_shared_bytes(V, seg_cap, cached);
  const auto kernel =
      cached ? lantern::cuda::latent_neighbours_kernel<T, true> : lantern::cuda::latent_neighbours_kernel<T, false>;
  err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
  if (err != cudaSuccess) return err;
  kernel<<<static_cast<unsigned>(V), lantern::cuda::kNbrThreads, bytes, stream>>>(static_cast<const T*>(ct), V, d, K,
                                                                                  seg_cap, out);
  return cudaGetLastError();
}

}  // namespace

namespace lantern::cuda {

cudaError_t launch_latent_neighbours(const void* codes_t, Elem elem, int64_t V, int64_t d, int64_t K, int32_t* out,
                                     cudaStream_t stream) {
  switch (elem) {
    case Elem::kFloat32:
      return launch<float>(codes_t, V, d, K, out, stream);
    case Elem::kFloat64:
      return launch<double>(codes_t, V, d, K, out, stream);
    case Elem::kFloat16:
      return launch<__half>(codes_t, V, d, K, out, stream);
    case Elem::kBFloat16:
      return launch<__nv_bfloat16>(codes_t, V, d, K, out, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace lantern::cuda
