// CPU kernel of lantern::continuous_verify (docs/cspd.md): every token of the block in one call, in parallel
// over tokens; the per-token test and residual sampler are lantern/continuous_verify.h (shared with CUDA).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <tuple>

#include "lantern/continuous_verify.h"
#include "op_checks.h"

namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> continuous_verify_cpu(
    const at::Tensor& draft, const at::Tensor& mu_p, const at::Tensor& sigma_p, const at::Tensor& mu_q,
    const at::Tensor& sigma_q, const at::Tensor& logsig_p, const at::Tensor& logsig_q, const at::Tensor& rows,
    const at::Tensor& positions, c10::string_view rule, double bandwidth, c10::string_view sigma_ratio,
    int64_t max_tries, const at::Tensor& seed, const at::Tensor& offset) {
  const auto g = lantern::check_continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows,
                                                  positions, rule, bandwidth, sigma_ratio, max_tries, seed, offset);
  const lantern::ContinuousRule how{rule == "paper", sigma_ratio == "code", static_cast<float>(bandwidth),
                                    static_cast<int32_t>(max_tries)};
  const at::Tensor x = draft.contiguous(), mp = mu_p.contiguous(), sp = sigma_p.contiguous(),
                   mq = mu_q.contiguous(), sq = sigma_q.contiguous(), lp = logsig_p.contiguous(),
                   lq = logsig_q.contiguous(), rk = rows.contiguous(), pk = positions.contiguous();
  at::Tensor tokens = at::empty({g.B, g.N, g.C}, draft.options());                 // float32 [B, N, C]
  at::Tensor accepted = at::empty({g.B, g.N}, draft.options().dtype(at::kBool));  // [B, N]
  at::Tensor tries = at::empty({g.B, g.N}, draft.options().dtype(at::kInt));      // [B, N]
  const uint64_t s = *static_cast<const uint64_t*>(seed.data_ptr());
  const uint32_t off = static_cast<uint32_t>(*offset.data_ptr<int64_t>());
  const float *px = x.data_ptr<float>(), *pmp = mp.data_ptr<float>(), *psp = sp.data_ptr<float>(),
              *pmq = mq.data_ptr<float>(), *psq = sq.data_ptr<float>(), *plp = lp.data_ptr<float>(),
              *plq = lq.data_ptr<float>();
  const int64_t *prow = rk.data_ptr<int64_t>(), *ppos = pk.data_ptr<int64_t>();
  float* out = tokens.data_ptr<float>();
  bool* acc = accepted.data_ptr<bool>();
  int32_t* nt = tries.data_ptr<int32_t>();
  const int64_t C = g.C, N = g.N;
  at::parallel_for(0, g.B * g.N, 64, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const int64_t e = i * C;  // first channel of token i
      nt[i] = lantern::continuous_verify_token(px + e, pmp + e, psp + e, pmq + e, psq + e, plp[i], plq[i], C, how, s,
                                               static_cast<uint32_t>(prow[i / N]), static_cast<uint32_t>(ppos[i]),
                                               off, out + e, acc + i);
    }
  });
  return {tokens, accepted, tries};
}

}  // namespace

TORCH_LIBRARY_IMPL(lantern, CPU, m) { m.impl("continuous_verify", &continuous_verify_cpu); }
