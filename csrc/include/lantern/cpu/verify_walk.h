// verify (SPEC §3-§5) for one batch row on the CPU: the row walks its tree and computes each visited node's
// target distribution on the fly (lantern/cpu/target.h); it never holds more than O(V) floats.
// Torch-free, C++17, host only: the op binding (csrc/cpu/verify.cpp) and the sanitizer test
// (csrc/tests/sanitize_main.cpp) call it on raw pointers.
//
// Every index read from the inputs (parents, tokens, neighbour ids) is validated before use; an invalid
// row stops with an error code (the binding raises) and never reads or writes out of bounds.
#pragma once

#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "lantern/cpu/target.h"
#include "lantern/verify.h"

namespace lantern::cpu {

enum class VerifyError : int32_t { kOk = 0, kRoot, kParent, kToken, kNeighbour, kShape };

struct VerifyStatus {
  VerifyError error;
  int64_t where;  // the offending node (kParent, kToken) or token whose neighbour row is bad (kNeighbour)
};

// One row's inputs. Pointers are already offset to the row; logits/uncond/draft are [T, V] blocks.
template <class Real>
struct VerifyRow {
  RowBlock logits;
  RowBlock uncond;  // data == nullptr: no guidance
  RowBlock draft;   // data == nullptr: deterministic drafts
  const int64_t* tokens;   // [T]; -1 at padding
  const int64_t* parents;  // [T]; -1 at the root and at padding
  const int32_t* neighbours;  // [V, K] (may be nullptr when relax.k == 0)
  int64_t T, V, K;
  TargetSettings<Real> settings;
  Relaxation<Real> relax;
  uint64_t seed;
  uint32_t offset, row;
};

// One row's outputs.
struct VerifyOut {
  int64_t* accept_len;  // [1]
  int64_t* path;        // [T - 1]
  int64_t* next_token;  // [1]
  int8_t* status;       // [T]
};

// Per-thread scratch, O(V): reusable across rows with the same V. Real = the compute type (float, or double
// for float64 logits, as the reference).
template <class Real>
class VerifyWalker {
 public:
  using Row = VerifyRow<Real>;

  explicit VerifyWalker(int64_t V) : V_(V), p_(static_cast<size_t>(V), Real(0)), q_(static_cast<size_t>(V)) {
    support_.resize(V);
    ws_.resize(V);
  }

  // Lets the row's vocabulary-wide passes run in parallel chunks (results are the same; see ParallelChunks).
  void set_parallel(ParallelChunks parallel) { ws_.parallel = std::move(parallel); }

  VerifyStatus run(const Row& in, const VerifyOut& out) {
    for (int64_t c = 0; c < in.T; ++c) out.status[c] = -1;
    for (int64_t j = 0; j + 1 < in.T; ++j) out.path[j] = -1;
    *out.accept_len = 0;
    *out.next_token = 0;
    if (in.V != V_ || in.V < 1) return {VerifyError::kShape, 0};  // the scratch holds V_ entries
    const VerifyStatus tree = check_tree(in);
    if (tree.error != VerifyError::kOk) return tree;
    bad_ = {VerifyError::kOk, 0};
    if (in.settings.temperature == Real(0))
      greedy_walk(in, out);
    else
      sampling_walk(in, out);
    return bad_;
  }

 private:
  int64_t V_;
  std::vector<Real> p_;  // [V] the current distribution (dense; zero outside support_)
  std::vector<Real> q_;  // [V] the drafter's q' (sampled drafts)
  Support support_;
  TargetScratch<Real> ws_;
  VerifyStatus bad_{VerifyError::kOk, 0};
  std::vector<int64_t> depth_;  // [T] greedy
  std::vector<uint8_t> ok_;     // [T] greedy

  // parents[0] = -1; node i > 0 is padding (parent -1) or has a real parent < i; real tokens in [0, V).
  static VerifyStatus check_tree(const Row& in) {
    if (in.T < 1 || in.parents[0] != -1) return {VerifyError::kRoot, 0};
    for (int64_t i = 1; i < in.T; ++i) {
      const int64_t par = in.parents[i];
      if (par == -1) continue;
      if (par < 0 || par >= i || (par > 0 && in.parents[par] < 0)) return {VerifyError::kParent, i};
      if (in.tokens[i] < 0 || in.tokens[i] >= in.V) return {VerifyError::kToken, i};
    }
    return {VerifyError::kOk, 0};
  }

  // The first k neighbours of token x, or nullptr (and an error) when one is out of range.
  const int32_t* neighbours_of(const Row& in, int64_t x) {
    if (in.relax.k <= 0) return nullptr;
    if (in.neighbours == nullptr || in.relax.k > in.K) {
      bad_ = {VerifyError::kNeighbour, x};
      return nullptr;
    }
    const int32_t* row = in.neighbours + x * in.K;
    for (int32_t i = 0; i < in.relax.k; ++i) {
      if (row[i] < 0 || row[i] >= in.V) {
        bad_ = {VerifyError::kNeighbour, x};
        return nullptr;
      }
    }
    return row;
  }

  Merge<Real> merge(const Row& in, int64_t x, Real budget) {
    const int32_t* nbrs = neighbours_of(in, x);
    if (nbrs == nullptr) return {0, Real(0)};
    const Real* p = p_.data();
    return merge_neighbours<Real>([p](int32_t y) { return p[y]; }, nbrs, in.relax.k, budget);
  }

  void enter_node(const Row& in, int64_t node, bool greedy) {
    target_distribution<Real>(in.logits, in.uncond, node, in.V, in.settings, greedy, p_.data(), support_, ws_);
  }

  // q' = draft[node] normalised (SPEC §3.2).
  void load_draft(const Row& in, int64_t node) {
    load_row<Real>(in.draft.data, in.draft.dtype, node * in.V, in.V, q_.data());
    normalise_dense(q_.data(), in.V);
  }

  // w / max(total, tiny) where total > 0, else 0 (the reference's _normalise); returns total.
  static Real normalise_dense(Real* w, int64_t n) {
    const Real total = sum_dense(w, n), tiny = std::numeric_limits<Real>::min();
    const Real div = total > tiny ? total : tiny;
    for (int64_t i = 0; i < n; ++i) w[i] = total > Real(0) ? w[i] / div : Real(0);
    return total;
  }

  Real normalise_support() {
    Real* p = p_.data();
    const Real total = sum_over(p, support_.idx), tiny = std::numeric_limits<Real>::min();
    const Real div = total > tiny ? total : tiny;
    for (int32_t i : support_.idx) p[i] = total > Real(0) ? p[i] / div : Real(0);
    return total;
  }

  // ---- sampling (SPEC §3) ------------------------------------------------------------------------------

  void sampling_walk(const Row& in, const VerifyOut& out) {
    const bool sampled = in.draft.data != nullptr;
    int64_t node = 0;
    enter_node(in, node, false);
    if (sampled) load_draft(in, node);
    NodeBudget<Real> budget = fresh_node_budget<Real>();
    Real* p = p_.data();
    for (int64_t c = 1; c < in.T; ++c) {
      if (in.parents[c] != node) continue;
      const int64_t x = in.tokens[c];
      const Real b = candidate_budget<Real>(in.relax, p[x], budget, false);
      const Merge<Real> mg = merge(in, x, b);
      if (bad_.error != VerifyError::kOk) return;
      const Real p_tilde = merged_probability<Real>(p[x], mg);
      const float u = accept_uniform(in.seed, static_cast<uint32_t>(c), in.row, in.offset);
      const bool accept = sampled ? accepts_sampled<Real>(u, q_[x], p_tilde) : accepts_deterministic<Real>(u, p_tilde);
      out.status[c] = accept ? 1 : 0;
      if (accept) {
        out.path[(*out.accept_len)++] = c;
        node = c;
        enter_node(in, node, false);
        if (sampled) load_draft(in, node);
        budget = fresh_node_budget<Real>();
        continue;
      }
      if (mg.m > 0) {  // (then the neighbour row exists and merge() validated its first k ids)
        const int32_t* nbrs = in.neighbours + x * in.K;
        for (int32_t i = 0; i < mg.m; ++i) p[nbrs[i]] = Real(0);
      }
      Real residual_mass;
      if (!sampled) {
        p[x] = Real(0);  // the residual is P with exactly A(x) removed
        residual_mass = normalise_support();
      } else {
        // max(0, p~_x - q'), where p~_x is p with A(x) \ {x} collapsed onto x
        p[x] = p_tilde;
        support_.add(static_cast<int32_t>(x));
        for (int32_t i : support_.idx) {
          const Real r = p[i] - q_[i];
          p[i] = r < Real(0) ? Real(0) : r;
        }
        residual_mass = normalise_support();
        q_[x] = Real(0);  // the next sibling's q' excludes x
        normalise_dense(q_.data(), in.V);
      }
      budget = node_budget_after_reject<Real>(budget, mg.mass, residual_mass);
    }
    // The residual (or P_node at a leaf); a residual without mass (rounding only) falls back to P_node.
    if (!(sum_over(p, support_.idx) > Real(0))) enter_node(in, node, false);
    *out.next_token = race(in, node);
  }

  // The exponential race over the current p at `node` (SPEC §5). E = -log1p(-u) >= u, so u / p is a lower
  // bound of a token's key: tokens whose bound already exceeds the best key (with a margin far above any
  // rounding) cannot win and skip the logarithm.
  int64_t race(const Row& in, int64_t node) const {
    const Real* p = p_.data();
    RaceWinner<Real> best = race_start<Real>();
    for (int32_t i : support_.idx) {
      const Real w = p[i];
      if (!(w > Real(0))) continue;
      const float u = philox_uniform(in.seed, static_cast<uint32_t>(i), static_cast<uint32_t>(node), in.row, in.offset);
      if (static_cast<Real>(u) / w > best.key * Real(1.0001)) continue;
      race_offer<Real>(best, static_cast<Real>(exponential_key(u)) / w, i);
    }
    return best.token;
  }

  // ---- greedy (SPEC §4) --------------------------------------------------------------------------------

  void greedy_walk(const Row& in, const VerifyOut& out) {
    const int64_t T = in.T;
    const Real* p = p_.data();
    for (int64_t j = 0; j < T; ++j) {
      if (j > 0 && in.parents[j] < 0) continue;  // padding
      int64_t first_child = -1;
      for (int64_t c = j + 1; c < T && first_child < 0; ++c)
        if (in.parents[c] == j) first_child = c;
      if (first_child < 0) continue;
      enter_node(in, j, true);
      Top2<Real> top = top2_start<Real>();
      for (int64_t i = 0; i < in.V; ++i) top2_offer<Real>(top, p[i], i);
      for (int64_t c = first_child; c < T; ++c) {
        if (in.parents[c] != j) continue;
        const int64_t x = in.tokens[c];
        const Merge<Real> mg = merge(in, x, candidate_budget<Real>(in.relax, p[x], fresh_node_budget<Real>(), true));
        if (bad_.error != VerifyError::kOk) return;
        out.status[c] = greedy_passes<Real>(merged_probability<Real>(p[x], mg), x, top) ? 1 : 0;
      }
    }
    // the deepest node all of whose non-root ancestors pass; lowest index on ties
    depth_.assign(static_cast<size_t>(T), 0);
    ok_.assign(static_cast<size_t>(T), 0);
    int64_t best = 0, best_depth = 0;
    for (int64_t c = 1; c < T; ++c) {
      const int64_t par = in.parents[c];
      if (par < 0) continue;
      depth_[c] = depth_[par] + 1;
      ok_[c] = out.status[c] == 1 && (par == 0 || ok_[par]);
      if (ok_[c] && depth_[c] > best_depth) {
        best = c;
        best_depth = depth_[c];
      }
    }
    *out.accept_len = best_depth;
    for (int64_t cur = best; cur > 0; cur = in.parents[cur]) out.path[depth_[cur] - 1] = cur;
    // next token: argmax of the guided logits at the last accepted node (lowest index on ties)
    Real* l = ws_.l.data();
    guided_logits<Real>(in.logits, in.uncond, best, in.V, in.settings.cfg_scale, l, ws_.aux.data(), false, Real(1),
                        &ws_.parallel);
    int64_t arg = 0;
    for (int64_t i = 1; i < in.V; ++i)
      if (l[i] > l[arg]) arg = i;
    *out.next_token = arg;
  }
};

}  // namespace lantern::cpu
