// CUDA kernel of lantern::continuous_verify (docs/cspd.md) and its launcher (lantern/cuda/launch.h): one launch
// for the block, one thread per token; the per-token test and residual sampler are lantern/continuous_verify.h
// (shared with the CPU kernel). The seed and offset are read on the device, so the op can be captured in a CUDA
// graph and replayed with new ones.
#include <algorithm>

#include "lantern/continuous_verify.h"
#include "lantern/cuda/launch.h"

namespace {

__global__ void continuous_verify_kernel(const float* __restrict__ x, const float* __restrict__ mu_p,
                                         const float* __restrict__ sigma_p, const float* __restrict__ mu_q,
                                         const float* __restrict__ sigma_q, const float* __restrict__ logsig_p,
                                         const float* __restrict__ logsig_q, const int64_t* __restrict__ rows,
                                         const int64_t* __restrict__ positions, const uint64_t* __restrict__ seed,
                                         const int64_t* __restrict__ offset, lantern::ContinuousRule rule,
                                         float* __restrict__ tokens, bool* __restrict__ accepted,
                                         int32_t* __restrict__ tries, int64_t M, int64_t N, int64_t C) {
  const uint64_t s = *seed;
  const uint32_t off = static_cast<uint32_t>(*offset);
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < M; i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t e = i * C;  // first channel of token i
    tries[i] = lantern::continuous_verify_token(x + e, mu_p + e, sigma_p + e, mu_q + e, sigma_q + e, logsig_p[i],
                                                logsig_q[i], C, rule, s, static_cast<uint32_t>(rows[i / N]),
                                                static_cast<uint32_t>(positions[i]), off, tokens + e, accepted + i);
  }
}

}  // namespace

namespace lantern::cuda {

cudaError_t launch_continuous_verify(const ContinuousVerifyLaunch& a, cudaStream_t stream) {
  constexpr int kThreads = 128;
  const int blocks = static_cast<int>(std::min<int64_t>((a.M + kThreads - 1) / kThreads, 65536));
  continuous_verify_kernel<<<blocks, kThreads, 0, stream>>>(a.x, a.mu_p, a.sigma_p, a.mu_q, a.sigma_q, a.logsig_p,
                                                            a.logsig_q, a.rows, a.positions, a.seed, a.offset, a.rule,
                                                            a.tokens, a.accepted, a.tries, a.M, a.N, a.C);
  return cudaGetLastError();
}

}  // namespace lantern::cuda
