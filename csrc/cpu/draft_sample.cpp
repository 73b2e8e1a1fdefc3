// CPU kernel of lantern::draft_sample (SPEC §5, "Sampled drafts"): for each (batch row b, node n), the draft
// distribution q (SPEC §1 through lantern::cpu::target_distribution; a greedy row's q is one-hot at the first
// largest guided logit) and `draws` tokens without replacement by the exponential race on the counter
// (token, node_ids[b, n], rows[b], offset): the `draws` smallest keys E_i / q_i over q_i > 0, ascending,
// lower token on ties; tokens whose key is +inf (q_i = 0, or a key that overflowed) follow in token order.
// Parallel over (b, n); float64 logits are computed in float64, every other dtype in float32.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <utility>
#include <vector>

#include "lantern/cpu/clones.h"
#include "lantern/cpu/target.h"
#include "lantern/philox.h"
#include "cpu/cpu_dtype.h"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

using lantern::cpu::cpu_dtype;
using lantern::cpu::DType;

// The `m` smallest (key, token) pairs offered, ascending by key, then token.
template <class Real>
class Smallest {
 public:
  explicit Smallest(int64_t m) : m_(m) { best_.reserve(static_cast<size_t>(m) + 1); }

  // Keys above this cannot enter (+inf until m are held).
  Real bound() const {
    return static_cast<int64_t>(best_.size()) < m_ ? std::numeric_limits<Real>::infinity() : best_.back().first;
  }

  void offer(Real key, int64_t token) {
    const std::pair<Real, int64_t> x{key, token};
    if (static_cast<int64_t>(best_.size()) == m_ && !(x < best_.back())) return;
    best_.insert(std::upper_bound(best_.begin(), best_.end(), x), x);
    if (static_cast<int64_t>(best_.size()) > m_) best_.pop_back();
  }

  const std::vector<std::pair<Real, int64_t>>& held() const { return best_; }
  void clear() { best_.clear(); }

 private:
  int64_t m_;
  std::vector<std::pair<Real, int64_t>> best_;
};

// u[i] = the Philox uniform of counter (i, node, row, offset) for i < V (the loop vectorises).
LANTERN_CPU_CLONES void philox_uniforms(uint64_t seed, uint32_t node, uint32_t row, uint32_t offset, int64_t V,
                                        float* u) {
  for (int64_t i = 0; i < V; ++i) u[i] = lantern::philox_uniform(seed, static_cast<uint32_t>(i), node, row, offset);
}

struct DraftTensors {
  at::Tensor lc, lu, cfg, temp, tk, tp, node_ids, rows;  // contiguous inputs (lu, rows: optional)
  at::Tensor probs, tokens;                              // outputs [B, N, V], [B, N, draws]
};

template <class Real>
class DraftSampler {
 public:
  DraftSampler(int64_t V, int64_t draws) : V_(V), draws_(draws), best_(draws) {
    ws_.resize(V);
    support_.resize(V);
    u_.resize(static_cast<size_t>(V));
  }

  // q of node n of row b into p (zeroed on entry), its draws into out.
  void run(const DraftTensors& t, int64_t b, int64_t n, int64_t N, uint64_t seed, uint32_t offset, Real* p,
           int64_t* out) {
    const size_t elem = t.lc.element_size();
    const lantern::cpu::RowBlock lc{static_cast<const char*>(t.lc.data_ptr()) + b * N * V_ * elem, cpu_dtype(t.lc)};
    const lantern::cpu::RowBlock lu =
        t.lu.defined()
            ? lantern::cpu::RowBlock{static_cast<const char*>(t.lu.data_ptr()) + b * N * V_ * t.lu.element_size(),
                                     cpu_dtype(t.lu)}
            : lantern::cpu::RowBlock{nullptr, DType::kFloat32};
    const Real cfg = t.cfg.data_ptr<Real>()[b], temp = t.temp.data_ptr<Real>()[b];
    const uint32_t node = static_cast<uint32_t>(t.node_ids.data_ptr<int64_t>()[b * N + n]);
    const uint32_t row = static_cast<uint32_t>(t.rows.defined() ? t.rows.data_ptr<int64_t>()[b] : b);
    if (temp == Real(0)) {
      greedy_distribution(lc, lu, n, cfg, p);
    } else {
      const lantern::cpu::TargetSettings<Real> s{cfg, temp, t.tk.data_ptr<int64_t>()[b], t.tp.data_ptr<double>()[b]};
      lantern::cpu::target_distribution<Real>(lc, lu, n, V_, s, false, p, support_, ws_);
    }
    race(p, seed, node, row, offset, out);
    for (int32_t i : support_.idx) support_.member[i] = 0;  // p is the next node's own (zero) row
    support_.idx.clear();
  }

 private:
  // One-hot at the first largest guided logit (NaN counting as the largest, as torch.argmax).
  void greedy_distribution(const lantern::cpu::RowBlock& lc, const lantern::cpu::RowBlock& lu, int64_t n, Real cfg,
                           Real* p) {
    Real* l = ws_.l.data();
    lantern::cpu::guided_logits<Real>(lc, lu, n, V_, cfg, l, ws_.aux.data());
    int64_t top = 0;
    for (int64_t i = 1; i < V_ && l[top] == l[top]; ++i)
      if (l[i] != l[i] || l[i] > l[top]) top = i;
    p[top] = Real(1);
    support_.add(static_cast<int32_t>(top));
  }

  // The draws: E = -log1p(-u) >= u, so u / q bounds a token's key from below; tokens whose bound exceeds the
  // draws-th best key (with a margin far above any rounding) cannot enter and skip the logarithm.
  void race(const Real* p, uint64_t seed, uint32_t node, uint32_t row, uint32_t offset, int64_t* out) {
    const Real inf = std::numeric_limits<Real>::infinity();
    best_.clear();
    const bool dense = 4 * static_cast<int64_t>(support_.idx.size()) >= V_;  // every uniform at once
    if (dense) philox_uniforms(seed, node, row, offset, V_, u_.data());
    for (int32_t i : support_.idx) {
      const Real w = p[i];
      if (!(w > Real(0))) continue;
      const float u = dense ? u_[i] : lantern::philox_uniform(seed, static_cast<uint32_t>(i), node, row, offset);
      const Real bound = best_.bound();
      const Real least_key = static_cast<Real>(u) / w;  // the key is E / w with E >= u
      if (bound < inf && least_key > bound * Real(1.0001)) continue;
      const Real key = static_cast<Real>(lantern::exponential_key(u)) / w;
      if (key < inf) best_.offer(key, i);
    }
    int64_t k = 0;
    for (const auto& held : best_.held()) out[k++] = held.second;
    for (int64_t i = 0; i < V_ && k < draws_; ++i) {  // +inf keys, in token order (rare)
      if (p[i] > Real(0)) {
        const float u = lantern::philox_uniform(seed, static_cast<uint32_t>(i), node, row, offset);
        if (static_cast<Real>(lantern::exponential_key(u)) / p[i] < inf) continue;
      }
      out[k++] = i;
    }
  }

  int64_t V_, draws_;
  Smallest<Real> best_;
  lantern::cpu::TargetScratch<Real> ws_;
  lantern::cpu::Support support_;
  std::vector<float> u_;  // [V] the node's uniforms, when most tokens are in the support
};

template <class Real>
void draft_rows(const DraftTensors& t, int64_t B, int64_t N, int64_t V, int64_t draws, uint64_t seed, uint32_t offset) {
  Real* probs = t.probs.data_ptr<Real>();
  int64_t* tokens = t.tokens.data_ptr<int64_t>();
  at::parallel_for(0, B * N, 1, [&](int64_t lo, int64_t hi) {
    DraftSampler<Real> sampler(V, draws);
    for (int64_t item = lo; item < hi; ++item)
      sampler.run(t, item / N, item % N, N, seed, offset, probs + item * V, tokens + item * draws);
  });
}

std::tuple<at::Tensor, at::Tensor> draft_sample_cpu(const at::Tensor& logits,
                                                    const std::optional<at::Tensor>& uncond_logits,
                                                    const at::Tensor& cfg_scale, const at::Tensor& temperature,
                                                    const at::Tensor& top_k, const at::Tensor& top_p, int64_t draws,
                                                    const at::Tensor& seed, const at::Tensor& node_ids,
                                                    const at::Tensor& offset, const std::optional<at::Tensor>& rows) {
  const auto d = lantern::check_draft_sample(logits, uncond_logits, cfg_scale, temperature, top_k, top_p, draws, seed,
                                             node_ids, offset, rows);
  const auto real = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  DraftTensors t{logits.contiguous(),
                 uncond_logits ? uncond_logits->contiguous() : at::Tensor(),
                 cfg_scale.contiguous(),
                 temperature.contiguous(),
                 top_k.contiguous(),
                 top_p.contiguous(),
                 node_ids.contiguous(),
                 rows ? rows->contiguous() : at::Tensor(),
                 at::zeros({d.B, d.N, d.V}, logits.options().dtype(real)),
                 at::empty({d.B, d.N, draws}, logits.options().dtype(at::kLong))};
  const uint64_t seed_bits = static_cast<uint64_t>(seed.item<int64_t>());
  const uint32_t offset_word = static_cast<uint32_t>(offset.item<int64_t>());
  if (real == at::kDouble)
    draft_rows<double>(t, d.B, d.N, d.V, draws, seed_bits, offset_word);
  else
    draft_rows<float>(t, d.B, d.N, d.V, draws, seed_bits, offset_word);
  return {t.probs, t.tokens};
}

}  // namespace

LANTERN_KERNEL(CPU, draft_sample, &draft_sample_cpu);
