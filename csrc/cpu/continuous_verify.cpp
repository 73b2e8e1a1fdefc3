// CPU kernel of lantern::continuous_verify (docs/cspd.md): every token of the block in one call, in parallel
// over tokens; the per-token test and residual sampler are lantern/continuous_verify.h (shared with CUDA).
#include <ATen/Parallel.h>

#include <tuple>

#include "lantern/continuous_verify.h"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> continuous_verify_cpu(
    const at::Tensor& draft, const at::Tensor& mu_p, const at::Tensor& sigma_p, const at::Tensor& mu_q,
    const at::Tensor& sigma_q, const at::Tensor& logsig_p, const at::Tensor& logsig_q, const at::Tensor& rows,
    const at::Tensor& positions, c10::string_view rule, double bandwidth, c10::string_view sigma_ratio,
    int64_t max_tries, const at::Tensor& seed, const at::Tensor& offset) {
  auto c = lantern::prepare_continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions,
                                              rule, bandwidth, sigma_ratio, max_tries, seed, offset);
  const uint64_t s = *static_cast<const uint64_t*>(seed.data_ptr());
  const uint32_t off = static_cast<uint32_t>(*offset.data_ptr<int64_t>());
  const float *px = c.x.data_ptr<float>(), *pmp = c.mu_p.data_ptr<float>(), *psp = c.sigma_p.data_ptr<float>(),
              *pmq = c.mu_q.data_ptr<float>(), *psq = c.sigma_q.data_ptr<float>(), *plp = c.logsig_p.data_ptr<float>(),
              *plq = c.logsig_q.data_ptr<float>();
  const int64_t *prow = c.rows.data_ptr<int64_t>(), *ppos = c.positions.data_ptr<int64_t>();
  float* out = c.tokens.data_ptr<float>();
  bool* acc = c.accepted.data_ptr<bool>();
  int32_t* nt = c.tries.data_ptr<int32_t>();
  const int64_t C = c.dims.C, N = c.dims.N;
  const lantern::ContinuousRule how = c.rule;
  at::parallel_for(0, c.dims.B * c.dims.N, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t e = i * C;  // first channel of token i
      nt[i] = lantern::continuous_verify_token(px + e, pmp + e, psp + e, pmq + e, psq + e, plp[i], plq[i], C, how, s,
                                               static_cast<uint32_t>(prow[i / N]), static_cast<uint32_t>(ppos[i]), off,
                                               out + e, acc + i);
    }
  });
  return {c.tokens, c.accepted, c.tries};
}

}  // namespace

LANTERN_KERNEL(CPU, continuous_verify, &continuous_verify_cpu);
