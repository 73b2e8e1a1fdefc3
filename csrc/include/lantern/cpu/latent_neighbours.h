// The latent neighbour table (SPEC §2) on the CPU: tiled squared distances with a running per-row top-K.
// Torch-free, C++17, host only: csrc/cpu/latent_neighbours.cpp and the sanitizer test call it.
//
// Exact order. Candidate y of row x is ranked by the uint64 key (float32 bits of dist(x, y)) << 32 | y:
// for dist >= 0 (+inf included) the bits increase with the value, so key order is (dist, y) order and keys
// are unique. dist is summed as the reference does: acc = 0; for j in 0..d: acc += (c_xj - c_yj)^2, float32.
//
// Work: a block of kNbrRows rows against column tiles of kNbrCols codes (the tile stays in L1 while the
// block's rows use it). Each row keeps a candidate buffer of keys below its threshold (the K-th smallest
// key seen so far); when the buffer reaches 2K it is cut back to its K smallest (nth_element), and at
// the end the K survivors are sorted. Memory per
// thread: O(kNbrRows * (K + kNbrCols)); the table itself is the only O(V * K) allocation.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "lantern/cpu/clones.h"

namespace lantern::cpu {

constexpr int64_t kNbrRows = 16;    // rows per block
constexpr int64_t kNbrCols = 1024;  // codes per column tile

// dist[y] = sum_j (x[j] - ct[j * stride + y])^2 for y < n, accumulated over j in order, float32.
// ct is the transposed codebook [d, V] (row stride `stride`), offset to the tile's first code.
LANTERN_CPU_CLONES inline void squared_distances(const float* x, int64_t d, const float* ct, int64_t stride, int64_t n,
                                                 float* dist) {
  for (int64_t y = 0; y < n; ++y) dist[y] = 0.f;
  for (int64_t j = 0; j < d; ++j) {
    const float xj = x[j];
    const float* cj = ct + j * stride;
    for (int64_t y = 0; y < n; ++y) {
      const float diff = xj - cj[y];
      dist[y] += diff * diff;
    }
  }
}

inline uint64_t neighbour_key(float dist, int64_t y) {
  uint32_t bits;
  std::memcpy(&bits, &dist, 4);
  return (static_cast<uint64_t>(bits) << 32) | static_cast<uint64_t>(y);
}

// A row's candidate keys: a fixed buffer of capacity 2K + kNbrCols, appended to without branches.
struct NeighbourCandidates {
  std::vector<uint64_t> keys;
  int64_t size = 0;
  uint64_t threshold = UINT64_MAX;  // keys >= threshold cannot enter the top K
};

struct NeighbourScratch {
  std::vector<float> dist;                  // [kNbrCols]
  std::vector<NeighbourCandidates> cand;    // [kNbrRows]
  std::vector<float> sample;                // sampled distances of one row
};

// Cut a row's candidates back to its K smallest keys and lower the threshold to the K-th smallest.
inline void keep_smallest(NeighbourCandidates& c, int64_t K) {
  if (c.size <= K) return;
  std::nth_element(c.keys.begin(), c.keys.begin() + (K - 1), c.keys.begin() + c.size);
  c.size = K;
  c.threshold = c.keys[K - 1];
}

// Append the keys of codes c0 + y (y < n) that are below the threshold, except x itself. Groups of 16
// distances are first tested together (a vectorised OR), so once the threshold is tight most of the tile is
// skipped; inside a passing group keys are appended without branches.
LANTERN_CPU_CLONES inline void offer_tile(NeighbourCandidates& c, const float* dist, int64_t c0, int64_t n, int64_t x) {
  constexpr int64_t kGroup = 16;
  uint64_t* out = c.keys.data() + c.size;
  int64_t m = 0;
  const uint64_t limit = c.threshold;
  const uint32_t limit_bits = static_cast<uint32_t>(limit >> 32);
  for (int64_t g = 0; g < n; g += kGroup) {
    const int64_t end = std::min(n, g + kGroup);
    uint32_t any = 0;
    for (int64_t y = g; y < end; ++y) {
      uint32_t bits;
      std::memcpy(&bits, dist + y, 4);
      any |= static_cast<uint32_t>(bits <= limit_bits);
    }
    if (!any) continue;
    for (int64_t y = g; y < end; ++y) {
      const uint64_t key = neighbour_key(dist[y], c0 + y);
      out[m] = key;  // written always, kept only if it passes (no branch to mispredict)
      m += static_cast<int64_t>((key < limit) & (c0 + y != x));
    }
  }
  c.size += m;
}

// A starting threshold for row x: the distance of rank ~1.25 K V / S among S sampled codes (every
// (V / S)-th), as a key limit admitting every code at that distance or closer. About 1.25 K codes pass it, so
// the running top-K rarely needs a cut; if fewer than K pass, the row is redone without it.
inline uint64_t sampled_threshold(const float* codes, int64_t V, int64_t d, int64_t K, int64_t x,
                                  std::vector<float>& sample) {
  constexpr int64_t kSample = 1024;
  const int64_t stride = V / kSample;
  if (stride < 4) return UINT64_MAX;  // small tables: no sampling
  sample.clear();
  const float* cx = codes + x * d;
  for (int64_t y = 0; y < V; y += stride) {
    float acc = 0.f;
    for (int64_t j = 0; j < d; ++j) {
      const float diff = cx[j] - codes[y * d + j];
      acc += diff * diff;
    }
    sample.push_back(acc);
  }
  const int64_t n = static_cast<int64_t>(sample.size());
  const int64_t rank = (5 * K * n) / (4 * V) + 8;  // 0-based, includes x itself (distance 0) if sampled
  if (rank >= n) return UINT64_MAX;
  std::nth_element(sample.begin(), sample.begin() + rank, sample.end(),
                   [](float a, float b) { return neighbour_key(a, 0) < neighbour_key(b, 0); });
  return neighbour_key(sample[rank], 0xffffffffLL);
}

// Rows [r0, r1) (r1 - r0 <= kNbrRows) of the table: codes [V, d] and ct = codes transposed [d, V], both
// float32; out [V, K] int32.
inline void neighbour_rows(const float* codes, const float* ct, int64_t V, int64_t d, int64_t K, int64_t r0, int64_t r1,
                           int32_t* out, NeighbourScratch& ws, bool sample = true) {
  const int64_t rows = r1 - r0;
  ws.dist.resize(kNbrCols);
  ws.cand.resize(kNbrRows);
  for (int64_t r = 0; r < rows; ++r) {
    ws.cand[r].keys.resize(static_cast<size_t>(2 * K + kNbrCols));
    ws.cand[r].size = 0;
    ws.cand[r].threshold = sample ? sampled_threshold(codes, V, d, K, r0 + r, ws.sample) : UINT64_MAX;
  }
  for (int64_t c0 = 0; c0 < V; c0 += kNbrCols) {
    const int64_t n = std::min(kNbrCols, V - c0);
    for (int64_t r = 0; r < rows; ++r) {
      squared_distances(codes + (r0 + r) * d, d, ct + c0, V, n, ws.dist.data());
      offer_tile(ws.cand[r], ws.dist.data(), c0, n, r0 + r);
      if (ws.cand[r].size >= 2 * K) keep_smallest(ws.cand[r], K);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    NeighbourCandidates& c = ws.cand[r];
    if (c.size < K && sample) {  // the sampled threshold was too tight (rare): redo this row without it
      neighbour_rows(codes, ct, V, d, K, r0 + r, r0 + r + 1, out, ws, false);
      continue;
    }
    keep_smallest(c, K);
    std::sort(c.keys.begin(), c.keys.begin() + c.size);
    int32_t* row = out + (r0 + r) * K;
    for (int64_t i = 0; i < K; ++i) row[i] = i < c.size ? static_cast<int32_t>(c.keys[i] & 0xffffffffu) : -1;
  }
}

// ct[j * V + y] = codes[y * d + j].
inline void transpose_codes(const float* codes, int64_t V, int64_t d, float* ct) {
  for (int64_t y = 0; y < V; ++y)
    for (int64_t j = 0; j < d; ++j) ct[j * V + y] = codes[y * d + j];
}

}  // namespace lantern::cpu
