// CPU kernel of lantern::compact_kv (SPEC §6): move the kept tree nodes' K/V to consecutive positions.
#include <ATen/Parallel.h>
#include <ATen/ops/add.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "lantern/compact_kv.h"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

at::Tensor compact_kv_cpu(at::Tensor& cache, const at::Tensor& cache_len, const at::Tensor& path_nodes,
                          const at::Tensor& n_keep) {
  const auto g = lantern::check_compact_kv(cache, cache_len, path_nodes, n_keep);
  // The lengths and indices are read once, into memory of this call's own, before anything is written.
  const auto owned = [](const at::Tensor& t) {
    const at::Tensor c = t.contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    return std::vector<int64_t>(p, p + c.numel());
  };
  const std::vector<int64_t> len_v = owned(cache_len), path_v = owned(path_nodes), keep_v = owned(n_keep);
  const int64_t* len = len_v.data();    // [B]
  const int64_t* path = path_v.data();  // [B, P]
  const int64_t* keep = keep_v.data();  // [B]

  // Validate every row before anything moves, so a bad input leaves the cache untouched.
  using lantern::CompactKVError;
  for (int64_t b = 0; b < g.B; ++b) {
    const int64_t n = keep[b], start = len[b], *row = path + b * g.P;
    const auto [error, i] = lantern::compact_kv_check_row(n, start, row, g.P, g.Lmax);
    TORCH_CHECK_VALUE(error != CompactKVError::kNKeep, "compact_kv: n_keep[", b, "] = ", n, " is outside [0, P = ", g.P,
                      "]");
    TORCH_CHECK_VALUE(error != CompactKVError::kCacheLen, "compact_kv: destination positions cache_len[", b,
                      "] + [0, n_keep[", b, "]) = ", start, " + [0, ", n, ") leave [0, Lmax = ", g.Lmax, ")");
    TORCH_CHECK_VALUE(error != CompactKVError::kPadding, "compact_kv: path_nodes[", b, ", ", i,
                      "] is -1 (padding) but ", i, " < n_keep[", b, "] = ", n);
    TORCH_CHECK_VALUE(error != CompactKVError::kSource, "compact_kv: source position cache_len[", b, "] + path_nodes[",
                      b, ", ", i, "] = ", start + row[i], " is outside [0, Lmax = ", g.Lmax, ")");
  }

  // Rows whose kept nodes are already in place (path_nodes[b, i] == i for i < n_keep[b]: a chain's accepted
  // prefix, an AR step's root) move nothing; skipping them leaves the cache's memory untouched, which matters
  // because each (leading, b, head) row is a cache line of its own, cold after the forward that wrote it.
  std::vector<char> moves(static_cast<size_t>(g.B), 0);
  for (int64_t b = 0; b < g.B; ++b)
    for (int64_t i = 0; i < keep[b] && !moves[b]; ++i) moves[b] = path[b * g.P + i] != i;
  if (std::find(moves.begin(), moves.end(), 1) == moves.end()) return at::add(cache_len, n_keep);

  // One (leading, b, head) row of Lmax x Dh elements per task: gather the kept positions into a buffer, then
  // write them back from cache_len on, so any order of kept nodes is safe. Bytes are copied, so one code path
  // serves every dtype.
  const int64_t row_bytes = g.Dh * static_cast<int64_t>(cache.element_size());
  char* base = static_cast<char*>(cache.data_ptr());
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, row_bytes * g.P));
  at::parallel_for(0, g.L * g.B * g.H, grain, [&](int64_t lo, int64_t hi) {
    std::vector<char> buf(static_cast<size_t>(g.P * row_bytes));  // [P, Dh] bytes
    for (int64_t r = lo; r < hi; ++r) {
      const int64_t b = (r / g.H) % g.B, start = len[b], n = keep[b];
      if (!moves[b]) continue;
      char* head = base + r * g.Lmax * row_bytes;  // [Lmax, Dh] of this (leading, b, head)
      for (int64_t i = 0; i < n; ++i)
        std::memcpy(buf.data() + i * row_bytes, head + (start + path[b * g.P + i]) * row_bytes, row_bytes);
      std::memcpy(head + start * row_bytes, buf.data(), n * row_bytes);
    }
  });
  return at::add(cache_len, n_keep);
}

}  // namespace

LANTERN_KERNEL(CPU, compact_kv, &compact_kv_cpu);
