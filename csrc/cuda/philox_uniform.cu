// CUDA kernel of lantern::philox_uniform (SPEC §5). The seed is read on the device, so the op can be
// captured in a CUDA graph and replayed with a new seed/offset written into the same tensors.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>

#include "lantern/philox.h"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

__global__ void philox_uniform_kernel(const uint64_t* __restrict__ seed, const int64_t* __restrict__ c0,
                                      const int64_t* __restrict__ c1, const int64_t* __restrict__ c2,
                                      const int64_t* __restrict__ c3, float* __restrict__ out, int64_t n) {
  const uint64_t s = *seed;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = lantern::philox_uniform(s, static_cast<uint32_t>(c0[i]), static_cast<uint32_t>(c1[i]),
                                     static_cast<uint32_t>(c2[i]), static_cast<uint32_t>(c3[i]));
}

at::Tensor philox_uniform_cuda(const at::Tensor& seed, const at::Tensor& c0, const at::Tensor& c1, const at::Tensor& c2,
                               const at::Tensor& c3) {
  const c10::cuda::CUDAGuard guard(c0.device());
  const auto c = lantern::check_philox(seed, c0, c1, c2, c3);  // 4 x int64 [*shape], contiguous
  at::Tensor out = at::empty(c[0].sizes(), c[0].options().dtype(at::kFloat));  // float32 [*shape]
  const int64_t n = out.numel();
  if (n == 0) return out;
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536));
  philox_uniform_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<const uint64_t*>(seed.data_ptr()), c[0].data_ptr<int64_t>(), c[1].data_ptr<int64_t>(),
      c[2].data_ptr<int64_t>(), c[3].data_ptr<int64_t>(), out.data_ptr<float>(), n);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace

LANTERN_KERNEL(CUDA, philox_uniform, &philox_uniform_cuda);
