// CUDA kernel of lantern::philox_uniform (SPEC §5) and its launcher (lantern/cuda/launch.h). The seed is read on
// the device, so the op can be captured in a CUDA graph and replayed with a new seed/offset written into the same
// tensors.
#include <algorithm>

#include "lantern/cuda/launch.h"
#include "lantern/philox.h"

namespace {

__global__ void philox_uniform_kernel(const uint64_t* __restrict__ seed, const int64_t* __restrict__ c0,
                                      const int64_t* __restrict__ c1, const int64_t* __restrict__ c2,
                                      const int64_t* __restrict__ c3, float* __restrict__ out, int64_t n) {
  const uint64_t s = *seed;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
    out[i] = lantern::philox_uniform(s, static_cast<uint32_t>(c0[i]), static_cast<uint32_t>(c1[i]),
                                     static_cast<uint32_t>(c2[i]), static_cast<uint32_t>(c3[i]));
}

}  // namespace

namespace lantern::cuda {

cudaError_t launch_philox_uniform(const uint64_t* seed, const int64_t* c0, const int64_t* c1, const int64_t* c2,
                                  const int64_t* c3, float* out, int64_t n, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const int blocks = static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65536));
  philox_uniform_kernel<<<blocks, kThreads, 0, stream>>>(seed, c0, c1, c2, c3, out, n);
  return cudaGetLastError();
}

}  // namespace lantern::cuda
