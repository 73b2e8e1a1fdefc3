// CPU kernel of lantern::verify (SPEC §3-§5): one call for the whole batch, parallel over rows; each row
// walks its tree with lantern::cpu::VerifyWalker (csrc/include/lantern/cpu/verify_walk.h). float64 logits are
// computed in float64 (as the reference), every other dtype in float32.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include <functional>
#include <tuple>
#include <vector>

#include "lantern/cpu/verify_walk.h"
#include "cpu/cpu_dtype.h"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

using lantern::cpu::cpu_dtype;
using lantern::cpu::DType;
using lantern::cpu::VerifyError;

lantern::cpu::RowBlock block(const at::Tensor& t, int64_t b, int64_t row_elems) {
  return {static_cast<const char*>(t.data_ptr()) + b * row_elems * t.element_size(), cpu_dtype(t)};
}

void raise_row_error(const lantern::cpu::VerifyStatus& s, int64_t b, int64_t k, int64_t V) {
  TORCH_CHECK_VALUE(s.error != VerifyError::kRoot, "verify: parents[", b, ", 0] must be -1 (node 0 is the root)");
  TORCH_CHECK_VALUE(s.error != VerifyError::kParent, "verify: parents[", b, ", ", s.where,
                    "] must be -1 (padding) or a real node before it (parents must be topologically ordered)");
  TORCH_CHECK_VALUE(s.error != VerifyError::kToken, "verify: tokens[", b, ", ", s.where, "] is outside [0, ", V, ")");
  TORCH_CHECK_VALUE(s.error != VerifyError::kShape, "verify: internal error (scratch sized for another V)");
  TORCH_CHECK_VALUE(s.error != VerifyError::kNeighbour, "verify: neighbours[", s.where, ", :", k,
                    "] has an id outside [0, ", V, ")");
}

struct VerifyTensors {
  at::Tensor lc, lu, dr, tok, par, nb, cfg, temp, tk, tp, rows;  // contiguous inputs (lu, dr, nb, rows: optional)
  at::Tensor accept_len, path, next_token, status;         // outputs
};

// Real = the compute type: double for float64 logits (as the reference), float otherwise.
template <class Real>
void verify_rows(const VerifyTensors& t, const lantern::VerifyDims& d, int64_t k, double delta,
                 std::optional<double> lam, bool node_budget, uint64_t seed, uint32_t offset) {
  const int64_t B = d.B, T = d.T, V = d.V, path_width = T > 1 ? T - 1 : 0;
  const lantern::Relaxation<Real> relax{static_cast<int32_t>(k), static_cast<Real>(delta),
                                        lam ? static_cast<Real>(*lam - 1.0) : Real(0), lam.has_value(), node_budget};
  const int64_t* tok = t.tok.data_ptr<int64_t>();  // [B, T]
  const int64_t* par = t.par.data_ptr<int64_t>();  // [B, T]
  const int32_t* nb = t.nb.defined() ? t.nb.data_ptr<int32_t>() : nullptr;  // [V, K]
  const Real* cfg = t.cfg.data_ptr<Real>();        // [B]
  const Real* temp = t.temp.data_ptr<Real>();      // [B]
  const int64_t* tk = t.tk.data_ptr<int64_t>();    // [B]
  const double* tp = t.tp.data_ptr<double>();      // [B]
  const int64_t* row_keys = t.rows.defined() ? t.rows.data_ptr<int64_t>() : nullptr;  // [B] or none: b
  int64_t* acc = t.accept_len.data_ptr<int64_t>();  // [B]
  int64_t* next = t.next_token.data_ptr<int64_t>();  // [B]
  int64_t* path = t.path.data_ptr<int64_t>();        // [B, T - 1]
  int8_t* status = t.status.data_ptr<int8_t>();      // [B, T]

  std::vector<lantern::cpu::VerifyStatus> errors(static_cast<size_t>(B), {VerifyError::kOk, 0});
  auto run_row = [&](lantern::cpu::VerifyWalker<Real>& walker, int64_t b) {
    const lantern::cpu::VerifyRow<Real> row{
        block(t.lc, b, T * V),
        t.lu.defined() ? block(t.lu, b, T * V) : lantern::cpu::RowBlock{nullptr, DType::kFloat32},
        t.dr.defined() ? block(t.dr, b, T * V) : lantern::cpu::RowBlock{nullptr, DType::kFloat32},
        tok + b * T,
        par + b * T,
        nb,
        T,
        V,
        d.K,
        lantern::cpu::TargetSettings<Real>{cfg[b], temp[b], tk[b], tp[b]},
        relax,
        seed,
        offset,
        static_cast<uint32_t>(row_keys ? row_keys[b] : b)};
    errors[b] = walker.run(row, {acc + b, path + b * path_width, next + b, status + b * T});
  };
  if (B < at::get_num_threads() && !at::in_parallel_region()) {
    // fewer rows than threads: rows in turn, each splitting its vocabulary passes over the threads
    lantern::cpu::VerifyWalker<Real> walker(V);
    walker.set_parallel([](int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body) {
      at::parallel_for(0, n, grain, body);
    });
    for (int64_t b = 0; b < B; ++b) run_row(walker, b);
  } else {
    at::parallel_for(0, B, 1, [&](int64_t lo, int64_t hi) {
      lantern::cpu::VerifyWalker<Real> walker(V);
      for (int64_t b = lo; b < hi; ++b) run_row(walker, b);
    });
  }
  for (int64_t b = 0; b < B; ++b) raise_row_error(errors[b], b, k, V);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_cpu(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
    const std::optional<at::Tensor>& neighbours, const std::optional<at::Tensor>& uncond_logits,
    const at::Tensor& cfg_scale, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const std::optional<at::Tensor>& draft_probs, int64_t k, double delta, std::optional<double> lam, bool node_budget,
    const at::Tensor& seed, const at::Tensor& offset, const std::optional<at::Tensor>& rows) {
  const auto d = lantern::check_verify(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature,
                                       top_k, top_p, draft_probs, k, seed, offset, rows);
  const int64_t B = d.B, T = d.T;
  const auto i64 = logits.options().dtype(at::kLong);
  VerifyTensors t{logits.contiguous(),
                  uncond_logits ? uncond_logits->contiguous() : at::Tensor(),
                  draft_probs ? draft_probs->contiguous() : at::Tensor(),
                  tokens.contiguous(),
                  parents.contiguous(),
                  (neighbours && k > 0) ? neighbours->contiguous() : at::Tensor(),
                  cfg_scale.contiguous(),
                  temperature.contiguous(),
                  top_k.contiguous(),
                  top_p.contiguous(),
                  rows ? rows->contiguous() : at::Tensor(),
                  at::empty({B}, i64),
                  at::empty({B, T > 1 ? T - 1 : 0}, i64),
                  at::empty({B}, i64),
                  at::empty({B, T}, logits.options().dtype(at::kChar))};
  const uint64_t seed_bits = static_cast<uint64_t>(seed.item<int64_t>());
  const uint32_t offset_word = static_cast<uint32_t>(offset.item<int64_t>());
  if (logits.scalar_type() == at::kDouble)
    verify_rows<double>(t, d, k, delta, lam, node_budget, seed_bits, offset_word);
  else
    verify_rows<float>(t, d, k, delta, lam, node_budget, seed_bits, offset_word);
  return {t.accept_len, t.path, t.next_token, t.status};
}

}  // namespace

LANTERN_KERNEL(CPU, verify, &verify_cpu);
