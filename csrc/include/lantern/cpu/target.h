// SPEC §1 for one tree node on the CPU: guidance, temperature, top-k, top-p and the normaliser, computed
// on the fly from the node's logits into a dense row. Torch-free, C++17, host only.
//
// Real is the compute type: float, or double for float64 logits (as the reference). The arithmetic mirrors
// python/lantern/ops/reference/process_logits.py op by op:
//   l = lu + s * (lc - lu)   (-inf if lc or lu is -inf)      l = l / temperature   (sampling rows)
//   top-k: keep l >= the top_k-th largest l (radix selection, no sort)
//   top-p: pi = w / Z over the top-k set with w = exp(l - max l); keep pi >= v*, the smallest value whose
//          "mass strictly above" (summed in double, as the reference's float64 cumsum) is <= top_p
//   p = w / Z' over the kept set.
// Sums are accumulated in double and rounded once (torch's float32 sum is a cascade of float32 partial
// sums: the two agree to about an ulp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "lantern/cpu/clones.h"
#include "lantern/cpu/dtype.h"
#include "lantern/cpu/select.h"

namespace lantern::cpu {

// One batch row's [T, V] block of logits or drafter probabilities: element (node, i) at data[node * V + i].
struct RowBlock {
  const void* data;  // nullptr when absent
  DType dtype;
};

template <class Real>
struct TargetSettings {
  Real cfg_scale;     // used only with unconditional logits
  Real temperature;   // 0 = greedy
  int64_t top_k;      // off unless 0 < top_k < V
  double top_p;       // off unless top_p < 1 (compared in float64, as the reference)
};

// Indices where the current distribution may be nonzero (increasing, except tokens added later by add()),
// with a membership flag per token.
struct Support {
  std::vector<int32_t> idx;
  std::vector<uint8_t> member;  // [V]

  void resize(int64_t V) { member.assign(static_cast<size_t>(V), 0); }
  void add(int32_t i) {
    if (!member[i]) {
      member[i] = 1;
      idx.push_back(i);
    }
  }
  // Zero p on the support, then empty it.
  template <class Real>
  void clear(Real* p) {
    for (int32_t i : idx) {
      p[i] = Real(0);
      member[i] = 0;
    }
    idx.clear();
  }
};

// Runs body(lo, hi) on subranges that cover [0, n) exactly once, possibly on several threads (the op binding
// passes at::parallel_for when a batch has fewer rows than threads). Only elementwise passes and per-chunk
// collections merged in chunk order use it, so results do not depend on the partition or the thread count.
using ParallelChunks = std::function<void(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& body)>;
constexpr int64_t kVocabChunk = 4096;  // vocabulary entries per parallel chunk

inline bool splits(const ParallelChunks* parallel, int64_t V) {
  return parallel != nullptr && *parallel && V >= 2 * kVocabChunk;
}

template <class Real>
struct TargetScratch {
  std::vector<Real> l;    // [V] guided (and scaled) logits
  std::vector<Real> aux;  // [V] unconditional logits, then pi
  SelectScratch<Real> select;
  ParallelChunks parallel;        // empty: every pass runs on the calling thread
  std::vector<int64_t> counts;    // per-chunk counts of a parallel collect_at_least

  void resize(int64_t V) {
    l.resize(static_cast<size_t>(V));
    aux.resize(static_cast<size_t>(V));
  }
};

// Sums accumulated in double, rounded once to Real.
template <class Real>
inline Real sum_over(const Real* p, const std::vector<int32_t>& idx) {
  double acc = 0.0;
  for (int32_t i : idx) acc += static_cast<double>(p[i]);
  return static_cast<Real>(acc);
}

template <class Real>
inline Real sum_dense(const Real* p, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(p[i]);
  return static_cast<Real>(acc);
}

// l[i] = lu[i] + s * (lc[i] - lu[i]), -inf where lc or lu is -inf (SPEC §1.1).
template <class Real>
LANTERN_CPU_CLONES inline void guide(const Real* lc, const Real* lu, int64_t V, Real s, Real* l) {
  const Real neg_inf = -std::numeric_limits<Real>::infinity();
  for (int64_t i = 0; i < V; ++i) {
    const Real c = lc[i], u = lu[i];
    const Real diff = c - u;
    const Real scaled = s * diff;
    const Real guided = u + scaled;
    l[i] = ((c == neg_inf) | (u == neg_inf)) ? neg_inf : guided;
  }
}

// l[i] = x[i] / t.
template <class Real>
LANTERN_CPU_CLONES inline void divide_by(const Real* x, int64_t V, Real t, Real* l) {
  for (int64_t i = 0; i < V; ++i) l[i] = x[i] / t;
}

// l[lo..hi) = the guided logits of `node` (SPEC §1.1) at those tokens, divided by `temperature` when divide;
// aux[lo..hi) is scratch.
template <class Real>
inline void guided_logits_range(const RowBlock& lc, const RowBlock& lu, int64_t node, int64_t V, int64_t lo, int64_t hi,
                                Real cfg_scale, Real* l, Real* aux, bool divide, Real temperature) {
  const int64_t n = hi - lo;
  Real* out = l + lo;
  const Real* c = out;
  const Real* u = aux + lo;
  if constexpr (sizeof(Real) == sizeof(float)) {  // float32 inputs are read in place
    if (lc.dtype == DType::kFloat32) c = static_cast<const float*>(lc.data) + node * V + lo;
    if (lu.data != nullptr && lu.dtype == DType::kFloat32) u = static_cast<const float*>(lu.data) + node * V + lo;
  }
  if (c == out) load_row<Real>(lc.data, lc.dtype, node * V + lo, n, out);
  if (lu.data != nullptr) {
    if (u == aux + lo) load_row<Real>(lu.data, lu.dtype, node * V + lo, n, aux + lo);
    guide<Real>(c, u, n, cfg_scale, out);
    c = out;
  }
  if (divide && temperature != Real(1))  // x / 1 == x exactly: temperature 1 skips the pass
    divide_by<Real>(c, n, temperature, out);
  else if (c != out)
    std::memcpy(out, c, static_cast<size_t>(n) * sizeof(Real));
}

// l[0..V) = the guided logits of `node` (SPEC §1.1), divided by `temperature` when divide; aux is scratch.
// Elementwise, so splitting it over `parallel` chunks gives the same values.
template <class Real>
inline void guided_logits(const RowBlock& lc, const RowBlock& lu, int64_t node, int64_t V, Real cfg_scale, Real* l,
                          Real* aux, bool divide = false, Real temperature = Real(1),
                          const ParallelChunks* parallel = nullptr) {
  if (!splits(parallel, V))
    return guided_logits_range<Real>(lc, lu, node, V, 0, V, cfg_scale, l, aux, divide, temperature);
  (*parallel)(V, kVocabChunk, [&](int64_t lo, int64_t hi) {
    guided_logits_range<Real>(lc, lu, node, V, lo, hi, cfg_scale, l, aux, divide, temperature);
  });
}

// Indices lo <= i < hi with l[i] >= g, in increasing order, appended without branches; out has room for hi - lo.
template <class Real>
inline int64_t collect_range(const Real* l, int64_t lo, int64_t hi, Real g, int32_t* out) {
  int64_t n = 0;
  for (int64_t i = lo; i < hi; ++i) {
    out[n] = static_cast<int32_t>(i);
    n += static_cast<int64_t>(l[i] >= g);
  }
  return n;
}

// Indices i < V with l[i] >= g, in increasing order; out has room for V. With `parallel`, chunk c collects
// into out[c * kVocabChunk ...) and the chunks are then moved together in chunk order (the same list).
template <class Real>
inline int64_t collect_at_least(const Real* l, int64_t V, Real g, int32_t* out,
                                const ParallelChunks* parallel = nullptr, std::vector<int64_t>* counts = nullptr) {
  if (!splits(parallel, V) || counts == nullptr) return collect_range<Real>(l, 0, V, g, out);
  const int64_t chunks = (V + kVocabChunk - 1) / kVocabChunk;
  counts->assign(static_cast<size_t>(chunks), 0);
  (*parallel)(chunks, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t lo = c * kVocabChunk, hi = std::min(V, lo + kVocabChunk);
      (*counts)[c] = collect_range<Real>(l, lo, hi, g, out + lo);
    }
  });
  int64_t n = (*counts)[0];
  for (int64_t c = 1; c < chunks; ++c) {
    std::memmove(out + n, out + c * kVocabChunk, static_cast<size_t>((*counts)[c]) * sizeof(int32_t));
    n += (*counts)[c];
  }
  return n;
}

// A value g below which (almost surely) fewer than V - top_k logits lie: the value of rank ~1.25 top_k S / V
// among S strided samples. -inf when the sample cannot tell (then every logit is a candidate).
template <class Real>
inline Real top_k_guess(const Real* l, int64_t V, int64_t top_k, SelectScratch<Real>& s) {
  constexpr int64_t kSample = 512;
  const int64_t stride = V / kSample;
  const Real none = -std::numeric_limits<Real>::infinity();
  if (stride < 4) return none;
  s.keys.clear();
  for (int64_t i = 0; i < V; i += stride) s.keys.push_back(order_key(l[i]));
  const int64_t n = static_cast<int64_t>(s.keys.size());
  const int64_t rank = (5 * top_k * n) / (4 * V) + 4;  // 0-based, from the top
  if (rank >= n) return none;
  std::nth_element(s.keys.begin(), s.keys.begin() + rank, s.keys.end(), [](auto a, auto b) { return a > b; });
  return from_order_key<Real>(s.keys[rank]);
}

// P_node (SPEC §1) into p: dense [V], zero outside `support`. On entry p must be zero outside the support
// it is given (the previous node's); greedy = the row's temperature is 0 (unfiltered softmax).
template <class Real>
inline void target_distribution(const RowBlock& lc, const RowBlock& lu, int64_t node, int64_t V,
                                const TargetSettings<Real>& s, bool greedy, Real* p, Support& support,
                                TargetScratch<Real>& ws) {
  Real* l = ws.l.data();
  const ParallelChunks* par = &ws.parallel;
  guided_logits<Real>(lc, lu, node, V, s.cfg_scale, l, ws.aux.data(), !greedy, s.temperature, par);
  support.clear(p);
  std::vector<int32_t>& idx = support.idx;
  idx.resize(static_cast<size_t>(V));

  // support: the top-k set (l >= the top_k-th largest l), or every token whose logit is not -inf
  int64_t n = 0;
  if (!greedy && s.top_k > 0 && s.top_k < V) {
    // candidates: l >= a sampled guess; exact whenever at least top_k pass it, else all of l
    const Real guess = top_k_guess<Real>(l, V, s.top_k, ws.select);
    n = collect_at_least<Real>(l, V, guess, idx.data(), par, &ws.counts);
    if (n >= s.top_k) {  // the top-k set lies among the candidates: keep those >= the threshold, in order
      Real* vals = ws.aux.data();  // (the unconditional logits are no longer needed)
      for (int64_t t = 0; t < n; ++t) vals[t] = l[idx[t]];
      const Real threshold = kth_largest<Real>(vals, n, s.top_k, ws.select);
      int64_t kept = 0;
      for (int64_t t = 0; t < n; ++t) {
        idx[kept] = idx[t];
        kept += static_cast<int64_t>(vals[t] >= threshold);
      }
      n = kept;
    } else {
      n = collect_at_least<Real>(l, V, kth_largest<Real>(l, V, s.top_k, ws.select), idx.data(), par, &ws.counts);
    }
  } else {
    n = collect_at_least<Real>(l, V, -std::numeric_limits<Real>::max(), idx.data(), par,
                               &ws.counts);  // excludes -inf, NaN
  }
  idx.resize(static_cast<size_t>(n));
  for (int32_t i : idx) support.member[i] = 1;
  if (idx.empty()) return;  // every logit -inf: p stays 0 (the reference gives NaN)

  Real m = l[idx.front()];
  for (int32_t i : idx) m = l[i] > m ? l[i] : m;
  for (int32_t i : idx) p[i] = std::exp(l[i] - m);  // w
  Real z = sum_over(p, idx);

  if (!greedy && s.top_p < 1.0) {
    Real* pi = ws.aux.data();
    for (int32_t i : idx) pi[i] = p[i] / z;
    const Real v = top_p_threshold<Real>(pi, idx.data(), static_cast<int64_t>(idx.size()), s.top_p, ws.select);
    size_t kept = 0;
    for (int32_t i : idx) {
      if (pi[i] >= v) {
        idx[kept++] = i;
      } else {
        p[i] = Real(0);
        support.member[i] = 0;
      }
    }
    idx.resize(kept);
    z = sum_over(p, idx);
  }
  for (int32_t i : idx) p[i] = p[i] / z;
}

}  // namespace lantern::cpu
