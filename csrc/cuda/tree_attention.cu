// CUDA launcher of lantern::tree_attention (SPEC §6; lantern/cuda/launch.h): one launch of
// lantern::cuda::tree_attention_kernel (csrc/include/lantern/cuda/tree_attention.cuh), the instance for q's
// element type and the padded head dim. No host sync: cache_len is read on the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "lantern/cuda/launch.h"
#include "lantern/cuda/tree_attention.cuh"

namespace {

namespace lc = lantern::cuda;

template <typename T, int Dp>
cudaError_t launch(const lc::TreeAttnParams& p, int64_t blocks, cudaStream_t stream) {
  constexpr int kSmem = lc::tree_attn_smem_bytes(Dp);
  auto* kernel = &lc::tree_attention_kernel<T, Dp>;
  if constexpr (kSmem > 48 * 1024) {  // beyond the default dynamic shared memory limit: opt in
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(blocks), lc::kTreeAttnThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_dh(const lc::TreeAttnParams& p, int Dp, int64_t blocks, cudaStream_t stream) {
  switch (Dp) {
    case 32:
      return launch<T, 32>(p, blocks, stream);
    case 64:
      return launch<T, 64>(p, blocks, stream);
    case 128:
      return launch<T, 128>(p, blocks, stream);
    default:
      return launch<T, 256>(p, blocks, stream);
  }
}

}  // namespace

namespace lantern::cuda {

cudaError_t launch_tree_attention(const TreeAttnParams& p, Elem elem, int Dp, int64_t blocks, cudaStream_t stream) {
  switch (elem) {
    case Elem::kFloat32:
      return launch_dh<float>(p, Dp, blocks, stream);
    case Elem::kFloat64:
      return launch_dh<double>(p, Dp, blocks, stream);
    case Elem::kFloat16:
      return launch_dh<__half>(p, Dp, blocks, stream);
    case Elem::kBFloat16:
      return launch_dh<__nv_bfloat16>(p, Dp, blocks, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace lantern::cuda
