// CUDA launcher of lantern::verify (SPEC §3-§5; lantern/cuda/launch.h): one launch for the whole batch, one
// thread block per row (lantern/cuda/verify.cuh), the instance for the compute type and the element types
// the binding chose. No host synchronisation: seed and offset are read by the kernel from their one-element
// device tensors, so the op is CUDA-graph capturable.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "lantern/cuda/launch.h"
#include "lantern/cuda/verify.cuh"

namespace {

using lantern::cuda::Elem;
using lantern::cuda::kVerifyThreads;
using lantern::cuda::VerifyLaunch;
using lantern::cuda::VerifyParams;

template <class Real, class In, class DraftIn>
cudaError_t launch(const VerifyLaunch& a, cudaStream_t stream) {
  VerifyParams<Real, In, DraftIn> P{};
  P.logits = static_cast<const In*>(a.logits);
  P.uncond = static_cast<const In*>(a.uncond);
  P.draft = static_cast<const DraftIn*>(a.draft);
  P.tokens = a.tokens;
  P.parents = a.parents;
  P.neighbours = a.neighbours;
  P.cfg_scale = static_cast<const Real*>(a.cfg_scale);
  P.temperature = static_cast<const Real*>(a.temperature);
  P.top_k = a.top_k;
  P.top_p = a.top_p;
  P.seed = a.seed;
  P.offset = a.offset;
  P.rows = a.rows;
  P.relax = {a.k, static_cast<Real>(a.delta), a.lambda_mode ? static_cast<Real>(a.lam - 1.0) : Real(0), a.lambda_mode,
             a.node_budget};
  P.B = a.B;
  P.T = a.T;
  P.V = a.V;
  P.K = a.K;
  P.l = static_cast<Real*>(a.l);
  P.p = static_cast<Real*>(a.p);
  P.q = static_cast<Real*>(a.q);
  P.tree = a.tree;
  P.accept_len = a.accept_len;
  P.path = a.path;
  P.next_token = a.next_token;
  P.status = a.status;
  lantern::cuda::verify_kernel<kVerifyThreads, Real, In, DraftIn>
      <<<static_cast<unsigned>(a.B), kVerifyThreads, 0, stream>>>(P);
  return cudaGetLastError();
}

// float32 compute with 16-bit logits: drafter rows in the logits' dtype or in float32.
template <class In>
cudaError_t launch_narrow(const VerifyLaunch& a, cudaStream_t stream) {
  return a.draft_in == Elem::kFloat32 ? launch<float, In, float>(a, stream) : launch<float, In, In>(a, stream);
}

}  // namespace

namespace lantern::cuda {

cudaError_t launch_verify(const VerifyLaunch& a, cudaStream_t stream) {
  switch (a.in) {
    case Elem::kFloat64:
      return launch<double, double, double>(a, stream);
    case Elem::kFloat16:
      return launch_narrow<__half>(a, stream);
    case Elem::kBFloat16:
      return launch_narrow<__nv_bfloat16>(a, stream);
    case Elem::kFloat32:
      return launch<float, float, float>(a, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace lantern::cuda
