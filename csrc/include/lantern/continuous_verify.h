// continuous_verify (docs/cspd.md) for one token: the acceptance test and the bounded residual sampler,
// shared by the CPU kernel (one token per loop iteration) and the CUDA kernel (one token per thread).
// Torch-free, C++17. The definition is python/lantern/ops/reference/continuous_verify.py:
//   lg(x; mu, sigma, bw) = sum_c [ -log sigma_c - 1/2 ((x_c - mu_c) / (bw sigma_c))^2 ]
//   exact: log r = lg(x; p, 1) - lg(x; q, 1); paper: log r = log Sigma + lg(x; p, bw) - lg(x; q, bw)
//   accept the draft iff log u_0 < log r; else proposals y_k = mu_p + sigma_p xi_k, kept iff
//   d_k = lg(y_k; q) - lg(y_k; p) < 0 and u_k < -expm1(d_k); after max_tries the last proposal is kept.
// Philox keys (lantern.ops.reference.noise): c0 = purpose << 24 | half << 23 | channel, c1 = row key,
// c2 = position key, c3 = offset + try.
#pragma once

#include <cmath>
#include <cstdint>

#include "lantern/common.h"
#include "lantern/philox.h"
#include "lantern/verify.h"  // product_rn: no FMA contraction on the device

namespace lantern {

constexpr uint32_t kPurposeResidual = 5;  // the residual sampler's proposals (Box-Muller, per channel)
constexpr uint32_t kPurposeAccept = 6;    // acceptance uniforms: try 0 tests the draft, try k proposal k
constexpr uint32_t kHalfBit = 1u << 23;
constexpr float kTwoPi = 6.283185307179586f;

struct ContinuousRule {
  bool paper;         // rule "paper" (else "exact")
  bool code_ratio;    // sigma_ratio "code": log Sigma = logsig_p - logsig_q (else logsig_q - logsig_p)
  float bandwidth;    // bw (1 for "exact")
  int32_t max_tries;  // >= 1
};

// float32 math: CUDA's functions on the device, the C++ library's float overloads on the host.
#if defined(__CUDA_ARCH__)
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_log(float x) { return logf(x); }
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_expm1(float x) { return expm1f(x); }
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_log1p(float x) { return log1pf(x); }
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_cos(float x) { return cosf(x); }
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_sqrt(float x) { return sqrtf(x); }
#else
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_log(float x) { return std::log(x); }
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_expm1(float x) { return std::expm1(x); }
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_log1p(float x) { return std::log1p(x); }
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_cos(float x) { return std::cos(x); }
LANTERN_HOST_DEVICE LANTERN_INLINE float cv_sqrt(float x) { return std::sqrt(x); }
#endif

// A standard normal from two uniforms: sqrt(-2 log1p(-u0)) cos(2 pi u1), float32.
LANTERN_HOST_DEVICE LANTERN_INLINE float box_muller(float u0, float u1) {
  return cv_sqrt(-2.0f * cv_log1p(-u0)) * cv_cos(kTwoPi * u1);
}

// lg(x; mu, sigma, bw) over C channels (x, mu, sigma contiguous).
LANTERN_HOST_DEVICE LANTERN_INLINE float log_gaussian(const float* x, const float* mu, const float* sigma, float bw,
                                                      int64_t C) {
  float sum = 0.0f;
  for (int64_t c = 0; c < C; ++c) {
    const float z = (x[c] - mu[c]) / (bw * sigma[c]);
    sum += cv_log(sigma[c]) + product_rn(product_rn(0.5f, z), z);
  }
  return -sum;
}

// One token. x, mu_p, sigma_p, mu_q, sigma_q point at its C channels; out receives the output token.
// Returns tries (0: draft accepted; k: proposal k kept; max_tries + 1: capped); *accepted = draft kept.
LANTERN_HOST_DEVICE LANTERN_INLINE int32_t continuous_verify_token(const float* x, const float* mu_p,
                                                                   const float* sigma_p, const float* mu_q,
                                                                   const float* sigma_q, float logsig_p, float logsig_q,
                                                                   int64_t C, ContinuousRule rule, uint64_t seed,
                                                                   uint32_t row, uint32_t position, uint32_t offset,
                                                                   float* out, bool* accepted) {
  const float bw = rule.paper ? rule.bandwidth : 1.0f;
  float log_r = log_gaussian(x, mu_p, sigma_p, bw, C) - log_gaussian(x, mu_q, sigma_q, bw, C);
  if (rule.paper) log_r = (rule.code_ratio ? logsig_p - logsig_q : logsig_q - logsig_p) + log_r;
  const float u = philox_uniform(seed, kPurposeAccept << 24, row, position, offset);
  *accepted = cv_log(u) < log_r;  // NaN (q(x) = p(x) = 0 in float32) rejects
  if (*accepted) {
    for (int64_t c = 0; c < C; ++c) out[c] = x[c];
    return 0;
  }
  for (int32_t k = 1; k <= rule.max_tries; ++k) {
    const uint32_t step = offset + static_cast<uint32_t>(k);  // mod 2^32
    for (int64_t c = 0; c < C; ++c) {
      const uint32_t channel = static_cast<uint32_t>(c);
      const float u0 = philox_uniform(seed, (kPurposeResidual << 24) | channel, row, position, step);
      const float u1 = philox_uniform(seed, (kPurposeResidual << 24) | kHalfBit | channel, row, position, step);
      out[c] = mu_p[c] + product_rn(sigma_p[c], box_muller(u0, u1));
    }
    const float d = log_gaussian(out, mu_q, sigma_q, 1.0f, C) - log_gaussian(out, mu_p, sigma_p, 1.0f, C);
    const float u_k = philox_uniform(seed, kPurposeAccept << 24, row, position, step);
    if (d < 0.0f && u_k < -cv_expm1(d)) return k;
  }
  return rule.max_tries + 1;  // capped: out holds the last proposal, a sample of the target's last step
}

}  // namespace lantern
