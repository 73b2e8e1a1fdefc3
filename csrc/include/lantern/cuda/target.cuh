// SPEC §1 for one tree node, computed block-wide into dense rows: guidance, temperature, top-k, top-p and
// the normaliser. Torch-free (CUDA only); the port of lantern/cpu/target.h and lantern/cpu/select.h.
//
// Real is the compute type: float, or double for float64 logits (as the reference and the CPU kernel).
// Arithmetic, op by op as the CPU (explicitly rounded intrinsics: nvcc would otherwise fuse a * b + c):
//   l = lu + s * (lc - lu)   (-inf if lc or lu is -inf)        l = l / temperature   (sampling rows)
//   support: top-k on: l >= t_k, t_k = the top_k-th largest l by radix selection on order keys (exact);
//            otherwise l >= -max (every token whose logit is not -inf)
//   w = exp(l - max l) on the support, 0 elsewhere;  z = sum w (double, rounded once)
//   top-p on: pi = w / z; keep pi >= v*, v* found by the CPU's radix search (11-bit digits, bin masses in
//             double, bins scanned from the top in the CPU's order); z' = sum of the kept w
//   p = w / z' on the kept set, 0 elsewhere.
// exp for float rows is the double exp rounded to float (nearly always the correctly rounded value, as glibc's
// expf the CPU kernel calls; CUDA's expf is off by up to 2 ulp). Sums are block-wide trees in double, rounded
// once: they equal the CPU's index-order double sums except where the double rounding differs (far below a
// float ulp). For float rows the top-p bin masses are exact (a bin's values share one binade), so the top-p
// threshold is bit-identical to the CPU's whenever pi is.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "lantern/cuda/block.cuh"
#include "lantern/cuda/radix.h"

namespace lantern::cuda {

// ---- element loads and explicitly rounded arithmetic ----------------------------------------------------

template <class Real>
__device__ LANTERN_INLINE Real to_real(float x) {
  return static_cast<Real>(x);
}
template <class Real>
__device__ LANTERN_INLINE Real to_real(double x) {
  return static_cast<Real>(x);
}
template <class Real>
__device__ LANTERN_INLINE Real to_real(__half x) {
  return static_cast<Real>(__half2float(x));
}
template <class Real>
__device__ LANTERN_INLINE Real to_real(__nv_bfloat16 x) {
  return static_cast<Real>(__bfloat162float(x));
}

__device__ LANTERN_INLINE float sub_rn(float a, float b) { return __fsub_rn(a, b); }
__device__ LANTERN_INLINE double sub_rn(double a, double b) { return __dsub_rn(a, b); }
__device__ LANTERN_INLINE float add_rn(float a, float b) { return __fadd_rn(a, b); }
__device__ LANTERN_INLINE double add_rn(double a, double b) { return __dadd_rn(a, b); }
__device__ LANTERN_INLINE float mul_rn(float a, float b) { return __fmul_rn(a, b); }
__device__ LANTERN_INLINE double mul_rn(double a, double b) { return __dmul_rn(a, b); }
__device__ LANTERN_INLINE float div_rn(float a, float b) { return __fdiv_rn(a, b); }
__device__ LANTERN_INLINE double div_rn(double a, double b) { return __ddiv_rn(a, b); }
__device__ LANTERN_INLINE float exp_real(float x) { return static_cast<float>(::exp(static_cast<double>(x))); }
__device__ LANTERN_INLINE double exp_real(double x) { return ::exp(x); }

template <class Real>
__device__ LANTERN_INLINE Real largest_finite() {
  return sizeof(Real) == sizeof(float) ? static_cast<Real>(FLT_MAX) : static_cast<Real>(DBL_MAX);
}

// l = lu + s * (lc - lu), -inf where lc or lu is -inf (SPEC §1.1).
template <class Real>
__device__ LANTERN_INLINE Real guide(Real c, Real u, Real s) {
  const Real guided = add_rn(u, mul_rn(s, sub_rn(c, u)));
  return (c == static_cast<Real>(-INFINITY) || u == static_cast<Real>(-INFINITY)) ? static_cast<Real>(-INFINITY)
                                                                                  : guided;
}

// The guided logit of token i at a node (lc, lu: the node's rows; lu == nullptr without guidance).
template <class Real, class In>
__device__ LANTERN_INLINE Real guided_logit(const In* __restrict__ lc, const In* __restrict__ lu, uint32_t i,
                                            Real cfg_scale) {
  const Real c = to_real<Real>(lc[i]);
  return lu == nullptr ? c : guide<Real>(c, to_real<Real>(lu[i]), cfg_scale);
}

// ---- the target distribution ---------------------------------------------------------------------------

template <class Real>
struct TargetSettings {
  Real cfg_scale;    // used only with unconditional logits
  Real temperature;  // 0 = greedy
  int64_t top_k;     // off unless 0 < top_k < V
  double top_p;      // off unless top_p < 1 (compared in double, as the reference)
};

struct TopPChoice {
  int32_t chosen;
  double above;
};

template <int NT>
struct TargetShared {
  uint32_t count[kRadixBins];  // radix histogram
  double mass[kRadixBins];     // top-p bin masses
  SelectShared<NT> select;
  TopPChoice top_p;
  BlockShared<NT> block;
};

// The top_k-th largest of l[0..V) (lantern/cpu/select.h kth_largest); count[] already holds the level-0
// histogram of every l.
template <int NT, class Real>
__device__ Real kth_largest_block(const Real* l, uint32_t V, int64_t top_k, TargetShared<NT>& sh) {
  using Key = KeyOf<Real>;
  Key prefix = 0, mask = 0;
  uint32_t rank = static_cast<uint32_t>(top_k < 1 ? 1 : (top_k > V ? V : top_k));
  for (int level = 0; level < radix_levels<Key>(); ++level) {
    if (level > 0) {
      for (uint32_t b = threadIdx.x; b < kRadixBins; b += NT) sh.count[b] = 0;
      __syncthreads();
      for (uint32_t i = threadIdx.x; i < V; i += NT) {
        const Key key = order_key(l[i]);
        if ((key & mask) == prefix) atomicAdd(&sh.count[radix_digit(key, level)], 1u);
      }
    }
    __syncthreads();
    const RankedBin bin = select_bin_from_top<NT>(sh.count, rank, sh.block, sh.select);
    prefix |= digit_bits<Key>(bin.bin, level);
    mask |= digit_mask<Key>(level);
    rank = bin.rank;
    __syncthreads();  // every thread has read count[] before the next level clears it
  }
  return from_order_key<Real>(prefix);
}

// Top-p threshold (lantern/cpu/select.h top_p_threshold): the smallest v among the positive
// pi_i = w_i / z of the support (l_i >= lo) with (mass strictly above v's tie group) <= top_p; +inf when no
// pi is positive. w = p[0..V).
template <int NT, class Real>
__device__ Real top_p_threshold_block(const Real* l, const Real* p, uint32_t V, Real lo, Real z, double top_p,
                                      TargetShared<NT>& sh) {
  using Key = KeyOf<Real>;
  Key prefix = 0, mask = 0;
  double above = 0.0;
  for (int level = 0; level < radix_levels<Key>(); ++level) {
    for (uint32_t b = threadIdx.x; b < kRadixBins; b += NT) {
      sh.count[b] = 0;
      sh.mass[b] = 0.0;
    }
    __syncthreads();
    for (uint32_t i = threadIdx.x; i < V; i += NT) {
      const Real pi = l[i] >= lo ? div_rn(p[i], z) : Real(0);
      if (!(pi > Real(0))) continue;
      const Key key = order_key(pi);
      if ((key & mask) != prefix) continue;
      const uint32_t d = radix_digit(key, level);
      atomicAdd(&sh.count[d], 1u);
      atomicAdd(&sh.mass[d], static_cast<double>(pi));
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // warp 0 offers the non-empty bins from the top, every lane in the same order
      const int lane = threadIdx.x;
      TopPScan scan = top_p_scan_start(above);
      for (int top = kRadixBins; top > 0 && !scan.done; top -= 32) {
        const int d = top - 1 - lane;
        const uint32_t c = sh.count[d];
        const double m = sh.mass[d];
        unsigned nonempty = __ballot_sync(kFullMask, c != 0);
        while (nonempty != 0 && !scan.done) {
          const int j = __ffs(nonempty) - 1;
          nonempty &= nonempty - 1;
          const uint32_t cj = __shfl_sync(kFullMask, c, j);
          const double mj = __shfl_sync(kFullMask, m, j);
          top_p_scan_offer(scan, top - 1 - j, cj, mj, top_p);
        }
      }
      if (lane == 0) sh.top_p = TopPChoice{scan.chosen, scan.above};
    }
    __syncthreads();
    const int32_t chosen = sh.top_p.chosen;
    above = sh.top_p.above;
    __syncthreads();  // every thread has read sh.top_p and count[] before the next level rewrites them
    // No bin: no positive pi (then nothing is kept, as on the CPU). A valid top_p (> 0) always chooses a bin
    // at levels > 0; an invalid one (rejected on the host) also ends here: nothing kept.
    if (chosen < 0) return static_cast<Real>(INFINITY);
    prefix |= digit_bits<Key>(static_cast<uint32_t>(chosen), level);
    mask |= digit_mask<Key>(level);
  }
  return from_order_key<Real>(prefix);
}

// P_node (SPEC §1) into p[0..V) (dense, 0 off the kept set); l[0..V) receives the scaled guided logits.
// lc, lu: the node's rows (lu == nullptr without guidance); greedy = the row's temperature is 0 (unfiltered
// softmax). Ends with a barrier: p is visible to the whole block.
template <int NT, class Real, class In>
__device__ void target_distribution(const In* __restrict__ lc, const In* __restrict__ lu, uint32_t V,
                                    const TargetSettings<Real>& s, bool greedy, Real* l, Real* p,
                                    TargetShared<NT>& sh) {
  const bool top_k_on = !greedy && s.top_k > 0 && s.top_k < static_cast<int64_t>(V);
  const bool top_p_on = !greedy && s.top_p < 1.0;
  const bool divide = !greedy && s.temperature != Real(1);  // x / 1 == x: temperature 1 skips the division
  __syncthreads();  // the block is done with the previous rows (and count[])
  if (top_k_on) {
    for (uint32_t b = threadIdx.x; b < kRadixBins; b += NT) sh.count[b] = 0;
    __syncthreads();
  }
  // pass 1: l, its maximum, the top-k level-0 histogram
  Real local_max = static_cast<Real>(-INFINITY);
  for (uint32_t i = threadIdx.x; i < V; i += NT) {
    Real g = guided_logit<Real>(lc, lu, i, s.cfg_scale);
    if (divide) g = div_rn(g, s.temperature);
    l[i] = g;
    local_max = g > local_max ? g : local_max;
    if (top_k_on) atomicAdd(&sh.count[radix_digit(order_key(g), 0)], 1u);
  }
  // max over the support = max of l (the support holds the largest l; if every l is -inf it is empty, or,
  // with top-k, every token: then max = -inf and w = NaN, exactly as on the CPU)
  const Real m = block_reduce<NT>(local_max, [](Real a, Real b) { return b > a ? b : a; }, sh.block);
  const Real lo = top_k_on ? kth_largest_block<NT>(l, V, s.top_k, sh) : -largest_finite<Real>();

  // pass 2: w and z
  double acc = 0.0;
  for (uint32_t i = threadIdx.x; i < V; i += NT) {
    const Real w = l[i] >= lo ? exp_real(sub_rn(l[i], m)) : Real(0);
    p[i] = w;
    acc += static_cast<double>(w);
  }
  const Real z = static_cast<Real>(block_sum<NT>(acc, sh.block));

  Real z_kept = z, v = Real(0);
  if (top_p_on) {
    v = top_p_threshold_block<NT>(l, p, V, lo, z, s.top_p, sh);
    double kept = 0.0;
    for (uint32_t i = threadIdx.x; i < V; i += NT) {
      const Real w = p[i];
      if (l[i] >= lo && div_rn(w, z) >= v) {
        kept += static_cast<double>(w);
      } else {
        p[i] = Real(0);
      }
    }
    z_kept = static_cast<Real>(block_sum<NT>(kept, sh.block));
  }
  // final pass: p = w / z' on the kept set (each thread rewrites only its own entries)
  for (uint32_t i = threadIdx.x; i < V; i += NT) {
    const Real w = p[i];
    const bool kept = l[i] >= lo && (!top_p_on || div_rn(w, z) >= v);
    p[i] = kept ? div_rn(w, z_kept) : Real(0);
  }
  __syncthreads();
}

}  // namespace lantern::cuda
