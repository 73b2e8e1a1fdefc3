// Tree attention (SPEC §6) on the CPU: online softmax over key tiles of the cached prefix (dense, no mask),
// then the tree block, where the packed ancestor bits decide. float32 math; GQA; per-row cache_len.
// Torch-free, C++17, host only: csrc/cpu/tree_attention.cpp and the sanitizer test call it on raw pointers.
//
// One work item = one batch row b, one kv head g and a block of M <= 64 query rows of that kv head's group
// (row r = (head g * G + r / T, query r % T), G = H / Hkv), so each K/V tile is read once for all of them.
// Scores are kept transposed, St [key j, row r], so K and V rows are read where they lie (float32 caches
// are never copied) and the softmax reductions run down the columns, vectorised across rows:
//   St = K Qt (Qt = (Q / sqrt(Dh)) transposed, built once per item),  m' = max(m, max_j St[j]),
//   P = e^(St - m'),  l = l e^(m - m') + sum_j P[j],  O = O e^(m - m') + P^T V;   finally o = O / l.
// Cache positions >= cache_len[b] + T are never read. Non-finite inputs are never hidden: a query row whose
// scores or attended values hold NaN or inf gets NaN in all of its output (as the reference), while values
// it does not attend to (other branches of the tree) cannot reach it.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "lantern/cpu/clones.h"
#include "lantern/cpu/dtype.h"

namespace lantern::cpu {

constexpr int64_t kAttnTile = 64;  // keys per tile
constexpr int64_t kAttnRows = 64;  // query rows per work item (at most)
constexpr int64_t kAttnNarrowRows = 4;  // items of at most this many rows compute their scores as dot products

struct AttnProblem {
  const void* q;  // [B, H, T, Dh], strides q_s* (elements), last dimension contiguous
  const void* k;  // [B, Hkv, Lmax, Dh], strides k_s*
  const void* v;  // like k, strides v_s*
  void* o;        // [B, H, T, Dh] contiguous, q's dtype
  DType dtype;    // of q, k, v and o
  int64_t q_sb, q_sh, q_st;
  int64_t k_sb, k_sh, k_sl;
  int64_t v_sb, v_sh, v_sl;
  const int64_t* cache_len;  // [B]; 0 <= cache_len[b] and cache_len[b] + T <= Lmax
  const int32_t* tree_mask;  // [B, T, W] packed bits, W = ceil(T / 32)
  int64_t B, H, Hkv, T, Dh, Lmax, W;
};

struct AttnScratch {
  std::vector<float> qt;   // [Dh, Mp] scaled queries, transposed (Mp = M rounded up to 16); narrow items: [M, Dh]
  std::vector<float> st;   // [kAttnTile, Mp] scores, then probabilities
  std::vector<float> acc;  // [kAttnRows, Dh] output accumulators
  std::vector<float> m, l, alpha;  // [Mp] running max, running sum, rescale factor
  std::vector<float> kt, vt;       // [kAttnTile, Dh] K / V rows converted to float32 (non-float32 caches)
  std::vector<uint8_t> poisoned;   // [kAttnRows] the row met a non-finite score or attended value
  std::vector<uint8_t> bad_value;  // [kAttnTile] the tile's value row j holds a non-finite element
  std::vector<float> score_probe;  // [kAttnRows] NaN once a prefix score of the row was not finite
  std::vector<float> value_probe;  // [Dh] NaN when a value of the tile was not finite
  void resize(int64_t Dh) {
    poisoned.resize(kAttnRows);
    bad_value.resize(kAttnTile);
    score_probe.resize(kAttnRows);
    value_probe.resize(Dh);
    qt.resize(Dh * kAttnRows);
    st.resize(kAttnTile * kAttnRows);
    acc.resize(kAttnRows * Dh);
    m.resize(kAttnRows);
    l.resize(kAttnRows);
    alpha.resize(kAttnRows);
    kt.resize(kAttnTile * Dh);
    vt.resize(kAttnTile * Dh);
  }
};

// e^x for x in [-87.3, 0] in float32 (Cephes' polynomial, ~2 ulp). Branch-free and select-free (floor
// by truncation: floor itself does not vectorise under the default -ftrapping-math), so loops vectorise.
inline float attn_exp(float x) {
  const float t = x * 1.44269504088896341f + 0.5f;
  const float trunc = static_cast<float>(static_cast<int32_t>(t));
  const float n = trunc - static_cast<float>(trunc > t);  // floor(t), in [-126, 0]
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float y = 1.9875691500e-4f;
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * (r * r) + r + 1.f;
  const int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, 4);
  return y * scale;
}

// Attention tolerates FMA: the micro-kernels below are compiled with contraction on, for x86-64-v4
// (AVX-512) / x86-64-v3 (AVX2 + FMA) / baseline, picked at load time.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__)) && !defined(LANTERN_NO_TARGET_CLONES) && \
    !defined(__SANITIZE_ADDRESS__)
#define LANTERN_ATTN_CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define LANTERN_ATTN_CLONES
#endif
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC push_options
#pragma GCC optimize("fp-contract=fast")
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"  // 64-byte vectors in always-inline helpers never cross an ABI
#endif

// 16 floats as one GCC/clang vector (lowered to the target's widest registers). The helpers are forced
// inline so that they are compiled for the calling clone's target.
#define LANTERN_ATTN_INLINE inline __attribute__((always_inline))
typedef float AttnVec __attribute__((vector_size(64)));
// 8 floats: the wide kernels' vector where registers hold 8 floats (AVX2). GCC lowers a 16-float vector there
// through the stack (a store and a reload of every scalar broadcast: 5-10x slower). Each element of the
// wide kernels' results is computed by the same operations in the same order whatever the vector's width
// (the vectors run across query rows or along Dh, never across a sum), so the results are the same bits.
typedef float AttnVec8 __attribute__((vector_size(32)));
template <class Vec>
constexpr int64_t kAttnLanes = sizeof(Vec) / sizeof(float);

template <class Vec = AttnVec>
LANTERN_ATTN_INLINE Vec attn_load(const float* p) {
  Vec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
template <class Vec>
LANTERN_ATTN_INLINE void attn_store(float* p, const Vec& v) {
  std::memcpy(p, &v, sizeof(v));
}

// Whether the CPU has 64-byte vector registers (AVX-512): which vector and register blocking the wide
// kernels below use.
inline bool attn_wide_registers() {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
  static const bool wide = __builtin_cpu_supports("avx512f");
  return wide;
#else
  return true;
#endif
}

// st[j, :] = sum_d k_j[d] * qt[d, :] for keys j0 <= j < j0 + R (k_j = k + j * ks); NV = Mp / lanes vectors per
// row of st. The R x NV accumulators stay in registers; each qt vector is loaded once for R keys.
template <int R, int NV, class Vec>
LANTERN_ATTN_INLINE void attn_scores_block(const float* k, int64_t ks, int64_t j0, int64_t Dh, const float* qt,
                                           float* st) {
  constexpr int64_t W = kAttnLanes<Vec>, Mp = W * NV;
  Vec acc[R][NV] = {};
  for (int64_t d = 0; d < Dh; ++d) {
    Vec qv[NV];
    for (int v = 0; v < NV; ++v) qv[v] = attn_load<Vec>(qt + d * Mp + W * v);
    for (int r = 0; r < R; ++r) {
      const float x = k[(j0 + r) * ks + d];
      for (int v = 0; v < NV; ++v) acc[r][v] += x * qv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < NV; ++v) attn_store(st + (j0 + r) * Mp + W * v, acc[r][v]);
}

// R keys per block: at most 16 accumulators of 16 floats (32 registers), or 8 of 8 floats (16 registers).
template <int NV, int R, class Vec>
LANTERN_ATTN_CLONES inline void attn_scores_nv(const float* k, int64_t ks, int64_t n, int64_t Dh, const float* qt,
                                               float* st) {
  int64_t j = 0;
  for (; j + R <= n; j += R) attn_scores_block<R, NV, Vec>(k, ks, j, Dh, qt, st);
  for (; j < n; ++j) attn_scores_block<1, NV, Vec>(k, ks, j, Dh, qt, st);
}

// Few query rows (an AR step, a short chain: M <= kAttnNarrowRows): the scores as dot products along Dh,
// st[j, r] = k_j . q_r with q [M, Dh] row-major and st's row stride M, so no work goes to padding rows (the
// transposed layout above computes 16 rows at a time). Each dot product sums 16-lane partial products, then
// the lanes: one at a time here, or 16 keys' lanes together (``attn_scores_dot16_nv``) where registers hold 16
// floats. Either way a score depends only on its key and query row, not on the call's other rows or keys.
LANTERN_ATTN_INLINE float attn_lane_sum(const AttnVec& v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}

template <int NV>
LANTERN_ATTN_CLONES inline void attn_scores_dot_nv(const float* k, int64_t ks, int64_t n, const float* q, int64_t M,
                                                   float* st) {
  constexpr int64_t D = 16 * NV;
  for (int64_t j = 0; j < n; ++j) {
    AttnVec kv[NV];
    for (int w = 0; w < NV; ++w) kv[w] = attn_load(k + j * ks + 16 * w);
    for (int64_t r = 0; r < M; ++r) {
      AttnVec acc = kv[0] * attn_load(q + r * D);
      for (int w = 1; w < NV; ++w) acc += kv[w] * attn_load(q + r * D + 16 * w);
      st[j * M + r] = attn_lane_sum(acc);
    }
  }
}

LANTERN_ATTN_CLONES inline void attn_scores_dot_any(const float* k, int64_t ks, int64_t n, int64_t Dh, const float* q,
                                                    int64_t M, float* st) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < M; ++r) {
      float s = 0.f;
      for (int64_t d = 0; d < Dh; ++d) s += k[j * ks + d] * q[r * Dh + d];
      st[j * M + r] = s;
    }
}

// The wide-register form of ``attn_scores_dot_nv`` (GCC's __builtin_shuffle): 16 keys at a time, their 16 lane
// vectors summed together by a shuffle butterfly (four rounds of pairwise lane sums) instead of 16 horizontal
// sums. Fed the keys in bit-reversed order, the butterfly leaves key i's score in lane i. Keys past n are zero
// vectors.
#if defined(__GNUC__) && !defined(__clang__)
#define LANTERN_ATTN_BUTTERFLY 1
typedef int32_t AttnLanes __attribute__((vector_size(64)));

// (results through pointers: a 64-byte vector returned by value from a non-clone function changes the ABI)
LANTERN_ATTN_INLINE void attn_pair_sum(const AttnVec& a, const AttnVec& b, const AttnLanes& lo, const AttnLanes& hi,
                                       AttnVec* out) {
  *out = __builtin_shuffle(a, b, lo) + __builtin_shuffle(a, b, hi);
}

// x[0] <- the lane sums of x[0..15], key by key (see above); x[1..15] are overwritten.
LANTERN_ATTN_INLINE void attn_lane_sums16(AttnVec* x) {
  const AttnLanes lo1 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const AttnLanes hi1 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  const AttnLanes lo2 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const AttnLanes hi2 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const AttnLanes lo3 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const AttnLanes hi3 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const AttnLanes lo4 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const AttnLanes hi4 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  for (int i = 0; i < 8; ++i) attn_pair_sum(x[2 * i], x[2 * i + 1], lo1, hi1, &x[i]);
  for (int i = 0; i < 4; ++i) attn_pair_sum(x[2 * i], x[2 * i + 1], lo2, hi2, &x[i]);
  for (int i = 0; i < 2; ++i) attn_pair_sum(x[2 * i], x[2 * i + 1], lo3, hi3, &x[i]);
  attn_pair_sum(x[0], x[1], lo4, hi4, &x[0]);
}

template <int NV>
LANTERN_ATTN_CLONES inline void attn_scores_dot16_nv(const float* k, int64_t ks, int64_t n, const float* q, int64_t M,
                                                     float* st) {
  constexpr int kBitReversed[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t keys = std::min<int64_t>(16, n - j0);
    for (int64_t r = 0; r < M; ++r) {
      AttnVec qv[NV];
      for (int w = 0; w < NV; ++w) qv[w] = attn_load(q + r * 16 * NV + 16 * w);
      AttnVec x[16];
      for (int i = 0; i < 16; ++i) {
        const int64_t j = kBitReversed[i];
        x[i] = AttnVec{};
        if (j < keys)
          for (int w = 0; w < NV; ++w) x[i] += attn_load(k + (j0 + j) * ks + 16 * w) * qv[w];
      }
      attn_lane_sums16(x);
      for (int64_t j = 0; j < keys; ++j) st[(j0 + j) * M + r] = x[0][j];
    }
  }
}
#else
#define LANTERN_ATTN_BUTTERFLY 0
template <int NV>
inline void attn_scores_dot16_nv(const float* k, int64_t ks, int64_t n, const float* q, int64_t M, float* st) {
  attn_scores_dot_nv<NV>(k, ks, n, q, M, st);
}
#endif

// Dh = 16 NV: the butterfly where registers hold 16 floats (8-float registers would take its shuffles through
// the stack), else one key at a time.
template <int NV>
inline void attn_scores_dot_fixed(const float* k, int64_t ks, int64_t n, const float* q, int64_t M, float* st) {
  if (LANTERN_ATTN_BUTTERFLY && attn_wide_registers()) return attn_scores_dot16_nv<NV>(k, ks, n, q, M, st);
  attn_scores_dot_nv<NV>(k, ks, n, q, M, st);
}

inline void attn_scores_dot(const float* k, int64_t ks, int64_t n, int64_t Dh, const float* q, int64_t M, float* st) {
  switch (Dh) {
    case 16:
      return attn_scores_dot_fixed<1>(k, ks, n, q, M, st);
    case 32:
      return attn_scores_dot_fixed<2>(k, ks, n, q, M, st);
    case 64:
      return attn_scores_dot_fixed<4>(k, ks, n, q, M, st);
    case 128:
      return attn_scores_dot_fixed<8>(k, ks, n, q, M, st);
    default:
      return attn_scores_dot_any(k, ks, n, Dh, q, M, st);
  }
}

// st[j, r] for j < n, r < Mp (Mp in {16, 32, 48, 64}).
inline void attn_scores(const float* k, int64_t ks, int64_t n, int64_t Dh, const float* qt, int64_t Mp, float* st) {
  if (attn_wide_registers()) {
    switch (Mp / 16) {
      case 1:
        return attn_scores_nv<1, 8, AttnVec>(k, ks, n, Dh, qt, st);
      case 2:
        return attn_scores_nv<2, 8, AttnVec>(k, ks, n, Dh, qt, st);
      case 3:
        return attn_scores_nv<3, 4, AttnVec>(k, ks, n, Dh, qt, st);
      default:
        return attn_scores_nv<4, 4, AttnVec>(k, ks, n, Dh, qt, st);
    }
  }
  switch (Mp / 16) {
    case 1:
      return attn_scores_nv<2, 4, AttnVec8>(k, ks, n, Dh, qt, st);
    case 2:
      return attn_scores_nv<4, 2, AttnVec8>(k, ks, n, Dh, qt, st);
    case 3:
      return attn_scores_nv<6, 1, AttnVec8>(k, ks, n, Dh, qt, st);
    default:
      return attn_scores_nv<8, 1, AttnVec8>(k, ks, n, Dh, qt, st);
  }
}

// acc[r, :] = acc[r, :] * alpha[r] + sum_{j<n} p[j, r] * v_j for rows r0 <= r < r0 + R (v_j = v + j * vs),
// Dh = 16 * NV known at compile time (the R x NV accumulators stay in registers).
template <int R, int NV, class Vec>
LANTERN_ATTN_INLINE void attn_values_block(const float* p, int64_t Mp, int64_t n, const float* v, int64_t vs,
                                           const float* alpha, int64_t r0, float* acc) {
  constexpr int64_t W = kAttnLanes<Vec>, D = W * NV;
  Vec a[R][NV];
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < NV; ++w) a[r][w] = attn_load<Vec>(acc + (r0 + r) * D + W * w) * alpha[r0 + r];
  for (int64_t j = 0; j < n; ++j) {
    Vec x[NV];
    for (int w = 0; w < NV; ++w) x[w] = attn_load<Vec>(v + j * vs + W * w);
    for (int r = 0; r < R; ++r) {
      const float pj = p[j * Mp + r0 + r];
      for (int w = 0; w < NV; ++w) a[r][w] += pj * x[w];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int w = 0; w < NV; ++w) attn_store(acc + (r0 + r) * D + W * w, a[r][w]);
}

// R rows per block: as ``attn_scores_nv``'s keys.
template <int NV, int R, class Vec>
LANTERN_ATTN_CLONES inline void attn_values_nv(const float* p, int64_t Mp, int64_t rows, int64_t n, const float* v,
                                               int64_t vs, const float* alpha, float* acc) {
  int64_t r = 0;
  for (; r + R <= rows; r += R) attn_values_block<R, NV, Vec>(p, Mp, n, v, vs, alpha, r, acc);
  for (; r < rows; ++r) attn_values_block<1, NV, Vec>(p, Mp, n, v, vs, alpha, r, acc);
}

// Any Dh.
LANTERN_ATTN_CLONES inline void attn_values_any(const float* p, int64_t Mp, int64_t rows, int64_t n, const float* v,
                                                int64_t vs, int64_t Dh, const float* alpha, float* acc) {
  for (int64_t r = 0; r < rows; ++r) {
    float* ar = acc + r * Dh;
    for (int64_t d = 0; d < Dh; ++d) ar[d] *= alpha[r];
    for (int64_t j = 0; j < n; ++j) {
      const float pj = p[j * Mp + r];
      const float* vj = v + j * vs;
      for (int64_t d = 0; d < Dh; ++d) ar[d] += pj * vj[d];
    }
  }
}

inline void attn_values(const float* p, int64_t Mp, int64_t rows, int64_t n, const float* v, int64_t vs, int64_t Dh,
                        const float* alpha, float* acc) {
  if (attn_wide_registers()) {
    switch (Dh) {
      case 16:
        return attn_values_nv<1, 4, AttnVec>(p, Mp, rows, n, v, vs, alpha, acc);
      case 32:
        return attn_values_nv<2, 4, AttnVec>(p, Mp, rows, n, v, vs, alpha, acc);
      case 64:
        return attn_values_nv<4, 4, AttnVec>(p, Mp, rows, n, v, vs, alpha, acc);
      case 128:
        return attn_values_nv<8, 2, AttnVec>(p, Mp, rows, n, v, vs, alpha, acc);
      default:
        break;
    }
  }
  switch (Dh) {
    case 16:
      return attn_values_nv<2, 4, AttnVec8>(p, Mp, rows, n, v, vs, alpha, acc);
    case 32:
      return attn_values_nv<4, 2, AttnVec8>(p, Mp, rows, n, v, vs, alpha, acc);
    case 64:
      return attn_values_nv<8, 1, AttnVec8>(p, Mp, rows, n, v, vs, alpha, acc);
    case 128:
      return attn_values_nv<16, 1, AttnVec8>(p, Mp, rows, n, v, vs, alpha, acc);
    default:
      return attn_values_any(p, Mp, rows, n, v, vs, Dh, alpha, acc);
  }
}

// Online-softmax update with the tile's scores st [n, Mp] (masked entries -inf), vectorised across rows:
// st <- P = e^(st - m'), m <- m', l <- l alpha + sum_j P, alpha = e^(m - m') (rows that attended nothing
// yet keep m = -inf, P = 0, alpha = 1). Scores below m' - 87.3 (and -inf) give P = 0.
LANTERN_ATTN_CLONES inline void attn_softmax(float* st, int64_t n, int64_t Mp, float* m, float* l, float* alpha) {
  float mx[kAttnRows], shift[kAttnRows], sum[kAttnRows];
  for (int64_t r = 0; r < Mp; ++r) mx[r] = m[r];
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < Mp; ++r) mx[r] = st[j * Mp + r] > mx[r] ? st[j * Mp + r] : mx[r];
  for (int64_t r = 0; r < Mp; ++r) {
    const bool none = mx[r] == -INFINITY;  // nothing attended yet: every P is 0, the state stays
    shift[r] = none ? 0.f : mx[r];
    const float d = m[r] - shift[r];  // <= 0; -inf when m = -inf (then alpha = 0: acc and l are 0 anyway)
    const float dc = d >= -87.3f ? d : -87.3f;
    alpha[r] = none ? 1.f : attn_exp(dc) * static_cast<float>(d >= -87.3f);
    sum[r] = 0.f;
  }
  float keep[kAttnTile * kAttnRows];  // separate loops: a select with a constant arm in the exp loop
  for (int64_t j = 0; j < n; ++j) {  // would be jump-threaded into branches and not vectorise
    float* sj = st + j * Mp;
    float* kj = keep + j * Mp;
    for (int64_t r = 0; r < Mp; ++r) {
      const float x = sj[r] - shift[r];
      kj[r] = static_cast<float>(x >= -87.3f);
      sj[r] = x >= -87.3f ? x : -87.3f;
    }
  }
  const int64_t entries = n * Mp;  // one flat loop: it vectorises whatever Mp is (an AR step's is 1)
  for (int64_t i = 0; i < entries; ++i) st[i] = attn_exp(st[i]) * keep[i];
  for (int64_t j = 0; j < n; ++j)
    for (int64_t r = 0; r < Mp; ++r) sum[r] += st[j * Mp + r];
  for (int64_t r = 0; r < Mp; ++r) {
    l[r] = l[r] * alpha[r] + sum[r];
    m[r] = mx[r];
  }
}

// probe[i] += x[j * stride + i] * 0 for j < n, i < w: probe[i] turns NaN iff some x[j, i] is NaN or +-inf
// (inf * 0 = NaN) and stays 0 otherwise. Elementwise across i, so it vectorises (a flag per element would
// not); the rare non-finite element is then found by a scalar pass.
LANTERN_ATTN_CLONES inline void attn_probe(const float* x, int64_t stride, int64_t n, int64_t w, float* probe) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < w; ++i) probe[i] += x[j * stride + i] * 0.f;
}

// bfloat16 rows -> float32: out[j, d] = src[j * stride + d] for j < n, d < Dh (a bfloat16 is a float32's upper
// half). Returns whether a row holds a NaN or an infinity (exponent bits all set), so that the value tiles
// need no separate probe.
LANTERN_ATTN_CLONES inline bool attn_bf16_rows(const uint16_t* src, int64_t stride, int64_t n, int64_t Dh, float* out) {
  uint32_t special = 0;
  for (int64_t j = 0; j < n; ++j) {
    const uint16_t* row = src + j * stride;
    float* o = out + j * Dh;
    for (int64_t d = 0; d < Dh; ++d) {
      const uint32_t h = row[d], bits = h << 16;
      std::memcpy(o + d, &bits, 4);
      special |= static_cast<uint32_t>((h & 0x7f80u) == 0x7f80u);
    }
  }
  return special != 0;
}

#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#pragma GCC pop_options
#endif

inline bool nonfinite(float x) { return !(std::fabs(x) <= std::numeric_limits<float>::max()); }

// bad[j] = value row j (of n, stride vs) holds a non-finite element.
inline void flag_bad_values(const float* v, int64_t vs, int64_t n, int64_t Dh, uint8_t* bad) {
  for (int64_t j = 0; j < n; ++j) {
    bool row = false;
    for (int64_t d = 0; d < Dh; ++d) row |= nonfinite(v[j * vs + d]);
    bad[j] = row;
  }
}

// The tile's value rows with non-finite elements replaced by 0 (a query that does not attend to them must
// not get 0 x NaN), into out [n, Dh]; returns out.
inline const float* finite_values(const float* v, int64_t vs, int64_t n, int64_t Dh, float* out) {
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = 0; d < Dh; ++d) out[j * Dh + d] = nonfinite(v[j * vs + d]) ? 0.f : v[j * vs + d];
  return out;
}

// Whether value rows v_j (j < n, stride vs) hold a NaN or an infinity (``attn_probe`` into probe [Dh]).
inline bool attn_values_nonfinite(const float* v, int64_t vs, int64_t n, int64_t Dh, float* probe) {
  std::fill(probe, probe + Dh, 0.f);
  attn_probe(v, vs, n, Dh, probe);
  return std::any_of(probe, probe + Dh, [](float x) { return x != x; });
}

// Query rows [r0, r1) (r1 - r0 <= kAttnRows) of batch row b and kv head g.
inline void attend_rows(const AttnProblem& p, int64_t b, int64_t g, int64_t r0, int64_t r1, AttnScratch& ws) {
  const int64_t Dh = p.Dh, T = p.T, G = p.H / p.Hkv, M = r1 - r0;
  const bool narrow = M <= kAttnNarrowRows;
  const int64_t Mp = narrow ? M : (M + 15) / 16 * 16;  // st's row stride
  const float scale = 1.f / std::sqrt(static_cast<float>(Dh));
  float* qt = ws.qt.data();
  float* row = ws.acc.data();  // (scratch for one query row before acc is cleared)
  std::fill(qt, qt + Dh * Mp, 0.f);
  for (int64_t r = 0; r < M; ++r) {
    const int64_t h = g * G + (r0 + r) / T, t = (r0 + r) % T;
    load_row<float>(p.q, p.dtype, b * p.q_sb + h * p.q_sh + t * p.q_st, Dh, row);
    for (int64_t d = 0; d < Dh; ++d) qt[narrow ? r * Dh + d : d * Mp + r] = row[d] * scale;
  }
  std::fill(ws.acc.begin(), ws.acc.begin() + Mp * Dh, 0.f);
  std::fill(ws.m.begin(), ws.m.begin() + Mp, -INFINITY);
  std::fill(ws.l.begin(), ws.l.begin() + Mp, 0.f);
  uint8_t* poisoned = ws.poisoned.data();  // tree tiles and non-finite values flag here, prefix scores below
  std::fill(poisoned, poisoned + M, uint8_t{0});
  float* score_probe = ws.score_probe.data();
  std::fill(score_probe, score_probe + Mp, 0.f);
  const int64_t L = p.cache_len[b];
  const bool f32 = p.dtype == DType::kFloat32;
  const float* kbase = f32 ? static_cast<const float*>(p.k) + b * p.k_sb + g * p.k_sh : nullptr;
  const float* vbase = f32 ? static_cast<const float*>(p.v) + b * p.v_sb + g * p.v_sh : nullptr;
  // prefix tiles, then tree tiles (tree node j sits at position L + j)
  const int64_t prefix_tiles = (L + kAttnTile - 1) / kAttnTile, tree_tiles = (T + kAttnTile - 1) / kAttnTile;
  for (int64_t tile = 0; tile < prefix_tiles + tree_tiles; ++tile) {
    const bool tree = tile >= prefix_tiles;
    const int64_t first = tree ? (tile - prefix_tiles) * kAttnTile : tile * kAttnTile;  // prefix pos / tree node
    const int64_t n = tree ? std::min(kAttnTile, T - first) : std::min(kAttnTile, L - first);
    const int64_t pos0 = tree ? L + first : first;
    const float *k = nullptr, *v = nullptr;
    int64_t ks = Dh, vs = Dh;
    bool any_bad_value = false;  // the tile's values hold a NaN or an infinity
    if (f32) {  // read the cache in place
      k = kbase + pos0 * p.k_sl;
      v = vbase + pos0 * p.v_sl;
      ks = p.k_sl;
      vs = p.v_sl;
      any_bad_value = attn_values_nonfinite(v, vs, n, Dh, ws.value_probe.data());
    } else if (p.dtype == DType::kBFloat16) {  // converted at vector width, flagged as converted
      const uint16_t* kh = static_cast<const uint16_t*>(p.k) + b * p.k_sb + g * p.k_sh + pos0 * p.k_sl;
      const uint16_t* vh = static_cast<const uint16_t*>(p.v) + b * p.v_sb + g * p.v_sh + pos0 * p.v_sl;
      attn_bf16_rows(kh, p.k_sl, n, Dh, ws.kt.data());
      any_bad_value = attn_bf16_rows(vh, p.v_sl, n, Dh, ws.vt.data());
      k = ws.kt.data();
      v = ws.vt.data();
    } else {
      for (int64_t j = 0; j < n; ++j) {
        load_row<float>(p.k, p.dtype, b * p.k_sb + g * p.k_sh + (pos0 + j) * p.k_sl, Dh, ws.kt.data() + j * Dh);
        load_row<float>(p.v, p.dtype, b * p.v_sb + g * p.v_sh + (pos0 + j) * p.v_sl, Dh, ws.vt.data() + j * Dh);
      }
      k = ws.kt.data();
      v = ws.vt.data();
      any_bad_value = attn_values_nonfinite(v, vs, n, Dh, ws.value_probe.data());
    }
    float* st = ws.st.data();
    if (narrow)
      attn_scores_dot(k, ks, n, Dh, qt, M, st);
    else
      attn_scores(k, ks, n, Dh, qt, Mp, st);
    uint8_t* bad_value = ws.bad_value.data();
    if (any_bad_value) {  // rare: which keys, and values that cannot leak into rows not attending to them
      flag_bad_values(v, vs, n, Dh, bad_value);
      v = finite_values(v, vs, n, Dh, ws.vt.data());
      vs = Dh;
    }
    if (tree) {
      for (int64_t r = 0; r < M; ++r) {
        const int32_t* bits = p.tree_mask + (b * T + (r0 + r) % T) * p.W;  // query node t's ancestor words
        for (int64_t j = 0; j < n; ++j) {
          const int64_t node = first + j;
          if (!((static_cast<uint32_t>(bits[node >> 5]) >> (node & 31)) & 1u))
            st[j * Mp + r] = -INFINITY;
          else
            poisoned[r] |= nonfinite(st[j * Mp + r]) | (any_bad_value && bad_value[j]);
        }
      }
    } else {  // every query attends to every prefix position
      attn_probe(st, Mp, n, Mp, score_probe);
      if (any_bad_value) std::fill(poisoned, poisoned + M, uint8_t{1});
    }
    attn_softmax(st, n, Mp, ws.m.data(), ws.l.data(), ws.alpha.data());
    attn_values(st, Mp, M, n, v, vs, Dh, ws.alpha.data(), ws.acc.data());
  }
  for (int64_t r = 0; r < M; ++r) {
    const int64_t h = g * G + (r0 + r) / T, t = (r0 + r) % T;
    float* ar = ws.acc.data() + r * Dh;
    const float inv = 1.f / ws.l[r];
    const bool bad = poisoned[r] || score_probe[r] != score_probe[r];
    for (int64_t d = 0; d < Dh; ++d) ar[d] = bad ? std::numeric_limits<float>::quiet_NaN() : ar[d] * inv;
    store_from_f32(ar, Dh, p.o, p.dtype, ((b * p.H + h) * T + t) * Dh);
  }
}

// Work items: (b, g, row block); item w covers rows [blk * kAttnRows, ...) of (b, g).
inline int64_t attn_blocks_per_head(const AttnProblem& p) {
  const int64_t rows = (p.H / p.Hkv) * p.T;
  return (rows + kAttnRows - 1) / kAttnRows;
}

inline void attend_item(const AttnProblem& p, int64_t item, AttnScratch& ws) {
  const int64_t blocks = attn_blocks_per_head(p), rows = (p.H / p.Hkv) * p.T;
  const int64_t blk = item % blocks, g = (item / blocks) % p.Hkv, b = item / (blocks * p.Hkv);
  const int64_t r0 = blk * kAttnRows, r1 = std::min(rows, r0 + kAttnRows);
  attend_rows(p, b, g, r0, r1, ws);
}

}  // namespace lantern::cpu
