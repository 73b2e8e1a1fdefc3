// The scalar rules of verify (SPEC §3-§5), shared by the CPU walk and the CUDA kernels. Torch-free, C++17.
//
// Real is the compute type: float (what every fused backend uses), or double, which the CPU backend uses
// for float64 logits exactly as the reference does. Arithmetic follows the reference
// (python/lantern/ops/reference/verify.py) op by op, so that backends agree to the last bit wherever the
// inputs to a rule agree:
//   budget     b = Real(δ) | Real(λ − 1) · p(x) | max(0, (δ − M) / max(R, tiny)) (0 if R <= 0)
//   merge      c_m = Real(sum_{i<=m} p(n_i)) summed in double (torch's CPU cumsum), m* = #{m : c_m <= b}
//   accept     u < p~(x)  (deterministic drafts),  u · q'(x) < p~(x)  (sampled drafts)
//   node rule  on reject M <- M + R · c_{m*},  R <- R · (residual mass before normalising)
//   race       key_i = E_i / w_i with E_i = −log1p(−u_i), argmin over w_i > 0, lower token on ties
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include "lantern/common.h"
#include "lantern/philox.h"

namespace lantern {

// The smallest positive normal value (torch.finfo(dtype).tiny), usable in device code.
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE constexpr Real tiny_normal() {
  return sizeof(Real) == sizeof(float) ? static_cast<Real>(FLT_MIN) : static_cast<Real>(DBL_MIN);
}

// The relaxation of one verify call (SPEC §3.1, §3.3).
template <class Real>
struct Relaxation {
  int32_t k;           // neighbours used; 0 = exact speculative sampling
  Real delta;          // delta mode: Real(δ)
  Real lam_minus_one;  // lambda mode: Real(λ − 1), the difference taken in double as Python does
  bool lambda_mode;    // λ given
  bool node_budget;    // budget = "node" (delta mode only)
};

// The node budget's state in P_node's scale: mass moved so far M, mass still undecided R.
template <class Real>
struct NodeBudget {
  Real moved;
  Real undecided;
};

template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE NodeBudget<Real> fresh_node_budget() {
  return {Real(0), Real(1)};
}

// b for a candidate x with current probability p_x. Greedy rows pass greedy = true: the node budget does
// not apply there (docs/semantics.md).
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE Real candidate_budget(const Relaxation<Real>& r, Real p_x, NodeBudget<Real> s,
                                                         bool greedy) {
  if (r.lambda_mode) return r.lam_minus_one * p_x;
  if (r.node_budget && !greedy) {
    const Real tiny = tiny_normal<Real>();
    const Real b = s.undecided > Real(0) ? (r.delta - s.moved) / (s.undecided > tiny ? s.undecided : tiny) : Real(0);
    return b < Real(0) ? Real(0) : b;
  }
  return r.delta;
}

// m* and c_{m*} (SPEC §3.1).
template <class Real>
struct Merge {
  int32_t m;  // merged neighbours: A(x) = {x, n_1, ..., n_m}
  Real mass;  // c_m (0 when m = 0)
};

// One step of the merge: after adding p(n_{m+1}) to the double accumulator `acc`, whether n_{m+1} joins
// A(x). c is non-decreasing in m, so the first failure ends the merge (= the reference's count of c_m <= b).
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE bool merge_step(double& acc, Real p_n, Real budget, Merge<Real>& merge) {
  acc += static_cast<double>(p_n);
  const Real c = static_cast<Real>(acc);
  if (!(c <= budget)) return false;
  merge.m += 1;
  merge.mass = c;
  return true;
}

// Merge over the first k neighbours nbrs[0..k), reading probabilities through prob(id).
template <class Real, class ProbOf>
LANTERN_HOST_DEVICE LANTERN_INLINE Merge<Real> merge_neighbours(ProbOf prob, const int32_t* nbrs, int32_t k,
                                                                Real budget) {
  Merge<Real> merge{0, Real(0)};
  double acc = 0.0;
  for (int32_t i = 0; i < k; ++i)
    if (!merge_step<Real>(acc, prob(nbrs[i]), budget, merge)) break;
  return merge;
}

// p~(x) = p(x) + c_{m*}.
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE Real merged_probability(Real p_x, Merge<Real> merge) {
  return p_x + merge.mass;
}

// Acceptance of a candidate (SPEC §3.2) with the float32 uniform u; q_x is q'(x) for sampled drafts.
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE bool accepts_deterministic(float u, Real p_tilde) {
  return static_cast<Real>(u) < p_tilde;
}
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE bool accepts_sampled(float u, Real q_x, Real p_tilde) {
  return static_cast<Real>(u) * q_x < p_tilde;
}

// a * b rounded on its own: nvcc contracts `c + a * b` into one FMA by default (the host build compiles with
// -ffp-contract=off), which would round the node budget differently from the CPU and the reference.
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE Real product_rn(Real a, Real b) {
#if defined(__CUDA_ARCH__)
  if constexpr (sizeof(Real) == sizeof(float))
    return __fmul_rn(a, b);
  else
    return __dmul_rn(a, b);
#else
  return a * b;
#endif
}

// The node budget after a rejection: mass = c_{m*}, residual_mass = the residual's total before normalising.
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE NodeBudget<Real> node_budget_after_reject(NodeBudget<Real> s, Real mass,
                                                                             Real residual_mass) {
  const Real moved = s.moved + product_rn(s.undecided, mass);
  return {moved, product_rn(s.undecided, residual_mass)};
}

// Acceptance uniform of node c in row `row` (SPEC §5).
LANTERN_HOST_DEVICE LANTERN_INLINE float accept_uniform(uint64_t seed, uint32_t node, uint32_t row, uint32_t offset) {
  return philox_uniform(seed, kAcceptCounter, node, row, offset);
}

// Exponential race (SPEC §5). The winner starts as (+inf, token 0): the reference's argmin over a row of
// +inf keys is token 0.
template <class Real>
struct RaceWinner {
  Real key;
  int64_t token;
};

template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE RaceWinner<Real> race_start() {
  return {static_cast<Real>(INFINITY), 0};
}

// Real(E_token) / w for a weight w > 0, E in float32, keyed by (token, node, row, offset).
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE Real race_key(uint64_t seed, uint32_t token, uint32_t node, uint32_t row,
                                                 uint32_t offset, Real w) {
  return static_cast<Real>(exponential_key(philox_uniform(seed, token, node, row, offset))) / w;
}

template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE void race_offer(RaceWinner<Real>& best, Real key, int64_t token) {
  if (key < best.key || (key == best.key && token < best.token)) best = {key, token};
}

// Greedy (SPEC §4): the two largest probabilities of a node, each at its lowest index (i2 = -1 if V = 1).
template <class Real>
struct Top2 {
  Real v1, v2;
  int64_t i1, i2;
};

template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE Top2<Real> top2_start() {
  return {static_cast<Real>(-INFINITY), static_cast<Real>(-INFINITY), -1, -1};
}

// Offer p[i] in increasing i.
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE void top2_offer(Top2<Real>& t, Real v, int64_t i) {
  if (t.i1 < 0 || v > t.v1) {
    t.v2 = t.v1;
    t.i2 = t.i1;
    t.v1 = v;
    t.i1 = i;
  } else if (t.i2 < 0 || v > t.v2) {
    t.v2 = v;
    t.i2 = i;
  }
}

// x passes iff argmax(p with p[x] := p~) == x, ties to the lower index.
template <class Real>
LANTERN_HOST_DEVICE LANTERN_INLINE bool greedy_passes(Real p_tilde, int64_t x, const Top2<Real>& t) {
  const Real other = t.i1 == x ? t.v2 : t.v1;
  const int64_t other_i = t.i1 == x ? t.i2 : t.i1;
  if (other_i < 0) return true;
  return p_tilde > other || (p_tilde == other && x < other_i);
}

}  // namespace lantern
