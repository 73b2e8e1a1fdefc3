// verify (SPEC §3-§5) on the GPU: one launch, one thread block per batch row. Torch-free (CUDA only); the op
// launcher is csrc/cuda/verify.cu (its binding csrc/cuda/bindings.cpp), the CPU original lantern/cpu/verify_walk.h.
//
// Design. The block walks its row's tree with uniform control flow: every thread runs the walk's scalar
// rules (lantern/verify.h, the code the CPU runs) redundantly on identical inputs, so decisions need no
// broadcast; thread 0 alone writes node_status and path. Vocabulary-wide work is block-wide over dense
// rows in global scratch (L2-resident): the node's target distribution (lantern/cuda/target.cuh), the
// residual after a rejection, the drafter's q', the top-2 of a greedy node and the exponential race.
// The neighbour merge loads the k neighbour probabilities into shared memory with the whole block, then
// every thread runs merge_step over them in order (the sequential double accumulation of the CPU).
// Each block-wide phase starts and ends with a barrier, so scratch rows written by one thread are read by
// others only across a __syncthreads(). Scratch rows are plain (not __restrict__ / read-only) pointers: they
// are rewritten during the kernel.
//
// Invalid values. lantern.ops.verify checks every value on the host first; the kernel is only made safe:
// a row whose tree is invalid (parents[0] != -1, a parent not a real earlier node, a token outside [0, V))
// or whose visited neighbour rows hold an id outside [0, V) (or k > K, or no table) writes
// accept_len = -1, next_token = -1, path = -1 and node_status = -1 for that row and stops; it never reads
// or writes out of bounds.
//
// Launch: grid = B, NT = kVerifyThreads = 512 threads per block, __launch_bounds__(512, 1). 512 is the
// widest block that keeps this kernel free of spills: at 1024 threads a block may use only 64 registers
// and ptxas spills (it did at 64 registers on sm_80); a vocabulary pass at V = 16384 is then 32 elements per
// thread and a radix scan 4 bins per thread. -Xptxas -v (nvcc 13.0, -O3), 0 bytes spilled in all 12
// instances (6 type combinations x 2 archs):
//             registers/thread          static shared memory/block    blocks/SM  occupancy (warps)
//   sm_80     110 (float), 126 (double)  27 280 B (float), 29 328 B   1          16/64 = 25 %
//   sm_90     114 (float), 109 (double)  27 280 B (float), 29 328 B   1          16/64 = 25 %
// (registers limit it: 512 x 110..126 > 32 768, so a second block does not fit in the 64 K register file;
// shared memory alone would allow 5-8 blocks). One block per row is at most one block per SM anyway
// whenever B <= #SMs, the common case.
// Split-V (several blocks per row when B is small, e.g. B = 1 on a 132-SM H100) is not implemented; what it
// would need is in docs/cuda.md.
#pragma once

#include <cstdint>

#include "lantern/cuda/block.cuh"
#include "lantern/cuda/target.cuh"
#include "lantern/philox.h"
#include "lantern/verify.h"

namespace lantern::cuda {

constexpr int kVerifyThreads = 512;

// Everything one launch reads and writes. [B, T, V] blocks are contiguous; In = the logits' element type
// (float, double, __half, __nv_bfloat16), DraftIn = the drafter rows' (In, or Real).
template <class Real, class In, class DraftIn>
struct VerifyParams {
  const In* logits;         // [B, T, V]
  const In* uncond;         // [B, T, V] or nullptr (no guidance)
  const DraftIn* draft;     // [B, T, V] or nullptr (deterministic drafts)
  const int64_t* tokens;    // [B, T]; -1 at padding
  const int64_t* parents;   // [B, T]; -1 at the root and at padding
  const int32_t* neighbours;  // [V, K] or nullptr
  const Real* cfg_scale;    // [B]
  const Real* temperature;  // [B]
  const int64_t* top_k;     // [B]
  const double* top_p;      // [B]
  const int64_t* seed;      // [1] the seed's 64 bits
  const int64_t* offset;    // [1] taken modulo 2^32
  const int64_t* rows;      // [B] the counter's row word (modulo 2^32), or nullptr: the row index
  Relaxation<Real> relax;
  int64_t B, T, V, K;
  Real* l;                  // [B, V] scratch: scaled guided logits
  Real* p;                  // [B, V] scratch: the current distribution
  Real* q;                  // [B, V] scratch: the drafter's q' (sampled drafts), else nullptr
  int32_t* tree;            // [B, T] scratch: greedy child flags, then (depth << 1 | path ok)
  int64_t* accept_len;      // [B]
  int64_t* path;            // [B, T - 1]
  int64_t* next_token;      // [B]
  int8_t* status;           // [B, T]
};

template <int NT, class Real>
struct VerifyShared {
  TargetShared<NT> target;
  Real neighbour_p[NT];  // one chunk of neighbour probabilities
  int64_t best_node;     // greedy: the last accepted node
};

// One row's view: pointers offset to the row, the row's settings and counters.
template <int NT, class Real, class In, class DraftIn>
struct RowWalk {
  VerifyShared<NT, Real>& sh;
  Relaxation<Real> relax;
  const int32_t* neighbours;  // [V, K] or nullptr
  int64_t K;
  const In* lc;  // [T, V]
  const In* lu;  // [T, V] or nullptr
  const DraftIn* draft;  // [T, V] or nullptr
  const int64_t* tokens;
  const int64_t* parents;
  Real* l;
  Real* p;
  Real* q;
  int32_t* tree;
  int64_t* path;
  int8_t* status;
  int64_t* accept_len;  // [1]
  int64_t* next_token;  // [1]
  uint32_t V;
  int64_t T;
  TargetSettings<Real> settings;
  uint64_t seed;
  uint32_t offset, row;

  // ---- validation and outputs ----------------------------------------------------------------------------

  // parents[0] = -1; node i > 0 is padding (parent -1) or has a real parent < i; real tokens in [0, V).
  __device__ bool tree_is_valid() const {
    bool bad = false;
    for (int64_t i = 1 + threadIdx.x; i < T; i += NT) {
      const int64_t par = parents[i];
      if (par == -1) continue;
      bad |= par < 0 || par >= i || (par > 0 && parents[par] < 0);
      bad |= tokens[i] < 0 || tokens[i] >= static_cast<int64_t>(V);
    }
    return !__syncthreads_or(bad || parents[0] != -1);
  }

  __device__ void reset_outputs() const {
    for (int64_t c = threadIdx.x; c < T; c += NT) status[c] = -1;
    for (int64_t j = threadIdx.x; j + 1 < T; j += NT) path[j] = -1;
    __syncthreads();
  }

  // An invalid row: every output -1 (documented with the binding, csrc/cuda/bindings.cpp).
  __device__ void fail() const {
    __syncthreads();  // thread 0's earlier writes are ordered before these
    reset_outputs();
    if (threadIdx.x == 0) {
      *accept_len = -1;
      *next_token = -1;
    }
  }

  // ---- §3.1 the merge --------------------------------------------------------------------------------------

  // m* and c_{m*} for candidate x under the current p (merge_step over the first k neighbours in order).
  // Returns false (invalid neighbour ids) after validating all k ids, as the CPU does.
  __device__ bool merge(int64_t x, Real budget, Merge<Real>& out) const {
    out = {0, Real(0)};
    const int32_t k = relax.k;
    if (k <= 0) return true;
    if (neighbours == nullptr || k > K) return false;
    const int32_t* nbrs = neighbours + x * K;
    bool bad = false;
    for (int32_t t = threadIdx.x; t < k; t += NT) bad |= nbrs[t] < 0 || nbrs[t] >= static_cast<int64_t>(V);
    if (__syncthreads_or(bad)) return false;
    double acc = 0.0;
    bool going = true;
    for (int32_t base = 0; base < k && going; base += NT) {
      const int32_t n = k - base < NT ? k - base : NT;
      if (static_cast<int32_t>(threadIdx.x) < n) sh.neighbour_p[threadIdx.x] = p[nbrs[base + threadIdx.x]];
      __syncthreads();
      for (int32_t j = 0; j < n && going; ++j) going = merge_step<Real>(acc, sh.neighbour_p[j], budget, out);
      __syncthreads();  // neighbour_p is read by every thread before the next chunk overwrites it
    }
    return true;
  }

  // p[n_i] = 0 for the merged neighbours n_1..n_m of x.
  __device__ void zero_merged(int64_t x, int32_t m) const {
    const int32_t* nbrs = neighbours + x * K;
    for (int32_t t = threadIdx.x; t < m; t += NT) p[nbrs[t]] = Real(0);
    __syncthreads();
  }

  // ---- dense rows ------------------------------------------------------------------------------------------

  __device__ void enter_node(int64_t node, bool greedy) const {
    target_distribution<NT, Real, In>(lc + node * V, lu == nullptr ? nullptr : lu + node * V, V, settings, greedy, l, p,
                                      sh.target);
  }

  // w / max(total, tiny) where total > 0, else 0 (the reference's _normalise), total = sum of the row.
  __device__ static Real scale_of(Real total) {
    const Real tiny = tiny_normal<Real>();
    return total > tiny ? total : tiny;
  }

  // q' = draft[node] normalised (SPEC §3.2).
  __device__ void load_draft(int64_t node) const {
    __syncthreads();
    const DraftIn* row_q = draft + node * V;
    double acc = 0.0;
    for (uint32_t i = threadIdx.x; i < V; i += NT) {
      const Real w = to_real<Real>(row_q[i]);
      q[i] = w;
      acc += static_cast<double>(w);
    }
    const Real total = static_cast<Real>(block_sum<NT>(acc, sh.target.block)), div = scale_of(total);
    for (uint32_t i = threadIdx.x; i < V; i += NT) q[i] = total > Real(0) ? div_rn(q[i], div) : Real(0);
    __syncthreads();
  }

  // Deterministic drafts: p with exactly A(x) removed (neighbours already zeroed), renormalised; returns the
  // residual's mass before normalising.
  __device__ Real residual_deterministic(int64_t x) const {
    double acc = 0.0;
    for (uint32_t i = threadIdx.x; i < V; i += NT) {
      if (i == x) p[i] = Real(0);
      acc += static_cast<double>(p[i]);
    }
    const Real total = static_cast<Real>(block_sum<NT>(acc, sh.target.block)), div = scale_of(total);
    for (uint32_t i = threadIdx.x; i < V; i += NT) p[i] = total > Real(0) ? div_rn(p[i], div) : Real(0);
    __syncthreads();
    return total;
  }

  // Sampled drafts: p <- normalise(max(0, p~_x - q')) where p~_x is p (merged neighbours already zeroed) with
  // p~(x) at x; then q' <- q' with x removed, renormalised. Returns the residual's mass before normalising.
  __device__ Real residual_sampled(int64_t x, Real p_tilde) const {
    DoublePair acc{0.0, 0.0};
    for (uint32_t i = threadIdx.x; i < V; i += NT) {
      const Real r = sub_rn(i == x ? p_tilde : p[i], q[i]);
      const Real kept = r < Real(0) ? Real(0) : r;
      p[i] = kept;
      acc.a += static_cast<double>(kept);
      if (i == x) q[i] = Real(0);
      acc.b += static_cast<double>(q[i]);
    }
    const DoublePair totals = block_sum2<NT>(acc, sh.target.block);
    const Real total_p = static_cast<Real>(totals.a), div_p = scale_of(total_p);
    const Real total_q = static_cast<Real>(totals.b), div_q = scale_of(total_q);
    for (uint32_t i = threadIdx.x; i < V; i += NT) {
      p[i] = total_p > Real(0) ? div_rn(p[i], div_p) : Real(0);
      q[i] = total_q > Real(0) ? div_rn(q[i], div_q) : Real(0);
    }
    __syncthreads();
    return total_p;
  }

  // The exponential race over p at `node` (SPEC §5), and whether p has mass (sum p > 0, as the CPU's check).
  struct RaceResult {
    RaceWinner<Real> best;
    double mass;
  };

  __device__ RaceResult race(int64_t node) const {
    RaceResult r{race_start<Real>(), 0.0};
    for (uint32_t i = threadIdx.x; i < V; i += NT) {
      const Real w = p[i];
      r.mass += static_cast<double>(w);
      if (w > Real(0))
        race_offer<Real>(r.best, race_key<Real>(seed, i, static_cast<uint32_t>(node), row, offset, w), i);
    }
    return block_reduce<NT>(
        r,
        [](RaceResult a, RaceResult b) {
          race_offer<Real>(a.best, b.best.key, b.best.token);
          a.mass += b.mass;
          return a;
        },
        sh.target.block);
  }

  // ---- sampling (SPEC §3) ----------------------------------------------------------------------------------

  // Returns false for an invalid row (outputs already written by fail()).
  __device__ bool sampling_walk() const {
    const bool sampled = draft != nullptr;
    int64_t node = 0, accepted = 0;
    enter_node(node, false);
    if (sampled) load_draft(node);
    NodeBudget<Real> budget = fresh_node_budget<Real>();
    for (int64_t c = 1; c < T; ++c) {
      if (parents[c] != node) continue;
      const int64_t x = tokens[c];
      const Real p_x = p[x];
      Merge<Real> mg;
      if (!merge(x, candidate_budget<Real>(relax, p_x, budget, false), mg)) {
        fail();
        return false;
      }
      const Real p_tilde = merged_probability<Real>(p_x, mg);
      const float u = accept_uniform(seed, static_cast<uint32_t>(c), row, offset);
      const bool accept = sampled ? accepts_sampled<Real>(u, q[x], p_tilde) : accepts_deterministic<Real>(u, p_tilde);
      if (threadIdx.x == 0) {
        status[c] = accept ? 1 : 0;
        if (accept) path[accepted] = c;
      }
      if (accept) {
        ++accepted;
        node = c;
        enter_node(node, false);
        if (sampled) load_draft(node);
        budget = fresh_node_budget<Real>();
        continue;
      }
      __syncthreads();  // every thread has read p[x] and q[x]
      zero_merged(x, mg.m);
      const Real residual_mass = sampled ? residual_sampled(x, p_tilde) : residual_deterministic(x);
      budget = node_budget_after_reject<Real>(budget, mg.mass, residual_mass);
    }
    // The residual (or P_node at a leaf); a residual without mass (rounding only) falls back to P_node.
    RaceResult r = race(node);
    if (!(static_cast<Real>(r.mass) > Real(0))) {
      enter_node(node, false);
      r = race(node);
    }
    if (threadIdx.x == 0) {
      *accept_len = accepted;
      *next_token = r.best.token;
    }
    return true;
  }

  // ---- greedy (SPEC §4) ------------------------------------------------------------------------------------

  __device__ Top2<Real> top2() const {
    Top2<Real> t = top2_start<Real>();
    for (uint32_t i = threadIdx.x; i < V; i += NT) top2_offer<Real>(t, p[i], i);
    return block_reduce<NT>(
        t,
        [](Top2<Real> a, const Top2<Real>& b) {
          // the best two of a's and b's (largest value, lowest index on ties)
          const Real vs[2] = {b.v1, b.v2};
          const int64_t is[2] = {b.i1, b.i2};
          for (int j = 0; j < 2; ++j) {
            if (is[j] < 0) continue;
            if (better_at_lower_index(vs[j], is[j], a.v1, a.i1)) {
              a.v2 = a.v1;
              a.i2 = a.i1;
              a.v1 = vs[j];
              a.i1 = is[j];
            } else if (better_at_lower_index(vs[j], is[j], a.v2, a.i2)) {
              a.v2 = vs[j];
              a.i2 = is[j];
            }
          }
          return a;
        },
        sh.target.block);
  }

  // argmax of the guided logits at `node` (lowest index on ties).
  __device__ int64_t guided_argmax(int64_t node) const {
    const In* c = lc + node * V;
    const In* u = lu == nullptr ? nullptr : lu + node * V;
    ArgBest<Real> best{static_cast<Real>(-INFINITY), -1};
    for (uint32_t i = threadIdx.x; i < V; i += NT) {
      const Real g = guided_logit<Real>(c, u, i, settings.cfg_scale);
      if (best.i < 0 || g > best.v) best = {g, static_cast<int64_t>(i)};
    }
    best = block_reduce<NT>(
        best, [](ArgBest<Real> a, ArgBest<Real> b) { return better_at_lower_index(b.v, b.i, a.v, a.i) ? b : a; },
        sh.target.block);
    return best.i < 0 ? 0 : best.i;
  }

  __device__ bool greedy_walk() const {
    for (int64_t c = threadIdx.x; c < T; c += NT) tree[c] = 0;
    __syncthreads();
    for (int64_t c = 1 + threadIdx.x; c < T; c += NT)
      if (parents[c] >= 0) tree[parents[c]] = 1;  // (every writer stores the same value)
    __syncthreads();
    for (int64_t j = 0; j < T; ++j) {
      if (tree[j] == 0) continue;  // no children (padding has none in a valid tree)
      enter_node(j, true);
      const Top2<Real> top = top2();
      for (int64_t c = j + 1; c < T; ++c) {
        if (parents[c] != j) continue;
        const int64_t x = tokens[c];
        const Real p_x = p[x];
        Merge<Real> mg;
        if (!merge(x, candidate_budget<Real>(relax, p_x, fresh_node_budget<Real>(), true), mg)) {
          fail();
          return false;
        }
        if (threadIdx.x == 0) status[c] = greedy_passes<Real>(merged_probability<Real>(p_x, mg), x, top) ? 1 : 0;
      }
    }
    __syncthreads();
    if (threadIdx.x == 0) {  // the deepest node all of whose non-root ancestors pass; lowest index on ties
      int64_t best = 0, best_depth = 0;
      tree[0] = 0;
      for (int64_t c = 1; c < T; ++c) {
        const int64_t par = parents[c];
        if (par < 0) continue;
        const int32_t depth = (tree[par] >> 1) + 1;
        const bool ok = status[c] == 1 && (par == 0 || (tree[par] & 1));
        tree[c] = (depth << 1) | (ok ? 1 : 0);
        if (ok && depth > best_depth) {
          best = c;
          best_depth = depth;
        }
      }
      *accept_len = best_depth;
      for (int64_t cur = best; cur > 0; cur = parents[cur]) path[(tree[cur] >> 1) - 1] = cur;
      sh.best_node = best;
    }
    __syncthreads();
    const int64_t next = guided_argmax(sh.best_node);
    if (threadIdx.x == 0) *next_token = next;
    return true;
  }
};

template <int NT, class Real, class In, class DraftIn>
__global__ void __launch_bounds__(NT, 1) verify_kernel(const VerifyParams<Real, In, DraftIn> P) {
  __shared__ VerifyShared<NT, Real> sh;
  const int64_t b = blockIdx.x;
  const int64_t T = P.T, V = P.V;
  const RowWalk<NT, Real, In, DraftIn> walk{
      sh,
      P.relax,
      P.neighbours,
      P.K,
      P.logits + b * T * V,
      P.uncond == nullptr ? nullptr : P.uncond + b * T * V,
      P.draft == nullptr ? nullptr : P.draft + b * T * V,
      P.tokens + b * T,
      P.parents + b * T,
      P.l + b * V,
      P.p + b * V,
      P.q == nullptr ? nullptr : P.q + b * V,
      P.tree + b * T,
      P.path + b * (T > 1 ? T - 1 : 0),
      P.status + b * T,
      P.accept_len + b,
      P.next_token + b,
      static_cast<uint32_t>(V),
      T,
      TargetSettings<Real>{P.cfg_scale[b], P.temperature[b], P.top_k[b], P.top_p[b]},
      static_cast<uint64_t>(P.seed[0]),
      static_cast<uint32_t>(static_cast<uint64_t>(P.offset[0])),
      static_cast<uint32_t>(P.rows == nullptr ? b : P.rows[b])};
  walk.reset_outputs();
  if (!walk.tree_is_valid()) {
    walk.fail();
    return;
  }
  if (walk.settings.temperature == Real(0))
    walk.greedy_walk();
  else
    walk.sampling_walk();
}

}  // namespace lantern::cuda
