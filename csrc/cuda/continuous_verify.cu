// CUDA kernel of lantern::continuous_verify (docs/cspd.md): one launch for the block, one thread per token; the
// per-token test and residual sampler are lantern/continuous_verify.h (shared with the CPU kernel). The seed
// and offset are read on the device, so the op can be captured in a CUDA graph and replayed with new ones.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <tuple>

#include "lantern/continuous_verify.h"
#include "kernel_registry.h"
#include "op_checks.h"

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

std::tuple<at::Tensor, at::Tensor, at::Tensor> continuous_verify_cuda(
    const at::Tensor& draft, const at::Tensor& mu_p, const at::Tensor& sigma_p, const at::Tensor& mu_q,
    const at::Tensor& sigma_q, const at::Tensor& logsig_p, const at::Tensor& logsig_q, const at::Tensor& rows,
    const at::Tensor& positions, c10::string_view rule, double bandwidth, c10::string_view sigma_ratio,
    int64_t max_tries, const at::Tensor& seed, const at::Tensor& offset) {
  const c10::cuda::CUDAGuard guard(draft.device());
  auto c = lantern::prepare_continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions,
                                              rule, bandwidth, sigma_ratio, max_tries, seed, offset);
  const int64_t M = c.dims.B * c.dims.N;
  if (M == 0) return {c.tokens, c.accepted, c.tries};
  constexpr int kThreads = 128;
  const int blocks = static_cast<int>(std::min<int64_t>((M + kThreads - 1) / kThreads, 65536));
  continuous_verify_kernel<<<blocks, kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(
      c.x.data_ptr<float>(), c.mu_p.data_ptr<float>(), c.sigma_p.data_ptr<float>(), c.mu_q.data_ptr<float>(),
      c.sigma_q.data_ptr<float>(), c.logsig_p.data_ptr<float>(), c.logsig_q.data_ptr<float>(),
      c.rows.data_ptr<int64_t>(), c.positions.data_ptr<int64_t>(), static_cast<const uint64_t*>(seed.data_ptr()),
      offset.data_ptr<int64_t>(), c.rule, c.tokens.data_ptr<float>(), c.accepted.data_ptr<bool>(),
      c.tries.data_ptr<int32_t>(), M, c.dims.N, c.dims.C);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {c.tokens, c.accepted, c.tries};
}

}  // namespace

LANTERN_KERNEL(CUDA, continuous_verify, &continuous_verify_cuda);
