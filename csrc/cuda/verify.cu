// CUDA kernel of lantern::verify (SPEC §3-§5): one launch for the whole batch, one thread block per row
// (lantern/cuda/verify.cuh). No host synchronisation: seed and offset are read by the kernel from their
// one-element device tensors, and the scratch rows come from the caching allocator on the current stream, so
// the op is CUDA-graph capturable.
//
// Schema (csrc/ops.cpp) as on the CPU, with one difference for invalid values: lantern.ops.verify checks
// token ids, tree order and neighbour ids on the host before dispatch; called directly, the CUDA op does not
// raise on them (that would need a host sync) but marks the row: a row whose tree is invalid, or whose
// visited neighbour rows hold an id outside [0, V), gets accept_len = -1, next_token = -1, path = -1 and
// node_status = -1. Nothing is read or written out of bounds. Shapes, dtypes and devices raise (TORCH_CHECK).
//
// Compute type (Real): float64 for float64 logits, float32 otherwise (cfg_scale / temperature come in Real).
// Element types: the kernel reads logits, uncond_logits and draft_probs in their own dtype when uncond has the
// logits' dtype and draft_probs has the logits' dtype or Real's; other mixes are converted to Real's dtype
// first (the same values the kernel's own conversion gives).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <optional>
#include <tuple>

#include "lantern/cuda/verify.cuh"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

using lantern::cuda::kVerifyThreads;
using lantern::cuda::VerifyParams;

struct VerifyTensors {
  at::Tensor lc, lu, dr, tok, par, nb, cfg, temp, tk, tp, seed, offset, rows;  // inputs (lu, dr, nb, rows: optional)
  at::Tensor l, p, q, tree;                                              // scratch
  at::Tensor accept_len, path, next_token, status;                       // outputs
};

template <class T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? reinterpret_cast<const T*>(t.data_ptr()) : nullptr;
}

template <class Real, class In, class DraftIn>
void launch(const VerifyTensors& t, const lantern::VerifyDims& d, int64_t k, double delta, std::optional<double> lam,
            bool node_budget) {
  VerifyParams<Real, In, DraftIn> P{};
  P.logits = ptr_or_null<In>(t.lc);
  P.uncond = ptr_or_null<In>(t.lu);
  P.draft = ptr_or_null<DraftIn>(t.dr);
  P.tokens = t.tok.data_ptr<int64_t>();
  P.parents = t.par.data_ptr<int64_t>();
  P.neighbours = t.nb.defined() ? t.nb.data_ptr<int32_t>() : nullptr;
  P.cfg_scale = t.cfg.data_ptr<Real>();
  P.temperature = t.temp.data_ptr<Real>();
  P.top_k = t.tk.data_ptr<int64_t>();
  P.top_p = t.tp.data_ptr<double>();
  P.seed = t.seed.data_ptr<int64_t>();
  P.offset = t.offset.data_ptr<int64_t>();
  P.rows = t.rows.defined() ? t.rows.data_ptr<int64_t>() : nullptr;
  P.relax = {static_cast<int32_t>(k), static_cast<Real>(delta), lam ? static_cast<Real>(*lam - 1.0) : Real(0),
             lam.has_value(), node_budget};
  P.B = d.B;
  P.T = d.T;
  P.V = d.V;
  P.K = d.K;
  P.l = t.l.data_ptr<Real>();
  P.p = t.p.data_ptr<Real>();
  P.q = t.q.defined() ? t.q.data_ptr<Real>() : nullptr;
  P.tree = t.tree.data_ptr<int32_t>();
  P.accept_len = t.accept_len.data_ptr<int64_t>();
  P.path = t.path.data_ptr<int64_t>();
  P.next_token = t.next_token.data_ptr<int64_t>();
  P.status = t.status.data_ptr<int8_t>();
  lantern::cuda::verify_kernel<kVerifyThreads, Real, In, DraftIn>
      <<<static_cast<unsigned>(d.B), kVerifyThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(P);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// float32 compute with 16-bit logits: drafter rows in the logits' dtype or in float32.
template <class In>
void launch_narrow(const VerifyTensors& t, const lantern::VerifyDims& d, int64_t k, double delta,
                   std::optional<double> lam, bool node_budget) {
  if (t.dr.defined() && t.dr.scalar_type() == at::kFloat)
    launch<float, In, float>(t, d, k, delta, lam, node_budget);
  else
    launch<float, In, In>(t, d, k, delta, lam, node_budget);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_cuda(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
    const std::optional<at::Tensor>& neighbours, const std::optional<at::Tensor>& uncond_logits,
    const at::Tensor& cfg_scale, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const std::optional<at::Tensor>& draft_probs, int64_t k, double delta, std::optional<double> lam, bool node_budget,
    const at::Tensor& seed, const at::Tensor& offset, const std::optional<at::Tensor>& rows) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto d = lantern::check_verify(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature,
                                       top_k, top_p, draft_probs, k, seed, offset, rows);
  TORCH_CHECK_VALUE(logits.is_cuda(), "verify: logits must be a CUDA tensor, got ", logits.device());
  TORCH_CHECK_VALUE(d.B <= int64_t{0x7fffffff}, "verify: B = ", d.B, " exceeds the CUDA grid limit");
  const int64_t B = d.B, T = d.T, V = d.V;
  const auto real = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // uncond in another dtype than logits: both read as Real's dtype
  const bool widen = uncond_logits && uncond_logits->scalar_type() != logits.scalar_type();
  at::Tensor lc = widen ? logits.to(real).contiguous() : logits.contiguous();
  at::Tensor lu = uncond_logits ? uncond_logits->to(lc.scalar_type()).contiguous() : at::Tensor();
  at::Tensor dr;
  if (draft_probs)
    dr =
        draft_probs->scalar_type() == lc.scalar_type() ? draft_probs->contiguous() : draft_probs->to(real).contiguous();
  const auto opts = logits.options();
  const auto i64 = opts.dtype(at::kLong);
  VerifyTensors t{lc,
                  lu,
                  dr,
                  tokens.contiguous(),
                  parents.contiguous(),
                  (neighbours && k > 0) ? neighbours->contiguous() : at::Tensor(),
                  cfg_scale.contiguous(),
                  temperature.contiguous(),
                  top_k.contiguous(),
                  top_p.contiguous(),
                  seed,
                  offset,
                  rows ? rows->contiguous() : at::Tensor(),
                  at::empty({B, V}, opts.dtype(real)),                     // l
                  at::empty({B, V}, opts.dtype(real)),                     // p
                  draft_probs ? at::empty({B, V}, opts.dtype(real)) : at::Tensor(),  // q
                  at::empty({B, T}, opts.dtype(at::kInt)),                 // tree
                  at::empty({B}, i64),
                  at::empty({B, T > 1 ? T - 1 : 0}, i64),
                  at::empty({B}, i64),
                  at::empty({B, T}, opts.dtype(at::kChar))};
  if (B == 0) return {t.accept_len, t.path, t.next_token, t.status};
  switch (lc.scalar_type()) {
    case at::kDouble:
      launch<double, double, double>(t, d, k, delta, lam, node_budget);
      break;
    case at::kHalf:
      launch_narrow<__half>(t, d, k, delta, lam, node_budget);
      break;
    case at::kBFloat16:
      launch_narrow<__nv_bfloat16>(t, d, k, delta, lam, node_budget);
      break;
    default:
      launch<float, float, float>(t, d, k, delta, lam, node_budget);
      break;
  }
  return {t.accept_len, t.path, t.next_token, t.status};
}

}  // namespace

LANTERN_KERNEL(CUDA, verify, &verify_cuda);
