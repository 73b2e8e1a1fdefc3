// CUDA kernel of lantern::compact_kv (SPEC §6): one launch for every layer (and K and V) at once.
//
// Grid: x over the (leading, b) slices, y over chunks of the Hkv x Dh columns. Each thread owns one column
// (a head and one vector of its Dh elements): it gathers the kept positions into its own shared-memory
// slots, then writes them back from cache_len on. No thread touches another's column, so there is no
// synchronisation, any order of kept nodes is safe, and loads/stores are coalesced along Dh.
// Data-dependent validation happens on the host in lantern.ops (a sync kept out of this op so that it stays
// graph-capturable); a row whose indices would leave [0, Lmax) is skipped here, never read or written.
#include <ATen/ops/add.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "lantern/compact_kv.h"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

constexpr int64_t kSharedBytes = 48 * 1024;  // the default dynamic shared memory limit

// Vec: the copy unit (16/8/4/2/1 bytes), chosen on the host from the row size and alignment.
template <typename Vec>
__global__ void compact_kv_kernel(Vec* __restrict__ cache,                // [L*B, H, Lmax, vecs_per_row]
                                  const int64_t* __restrict__ cache_len,   // [B]
                                  const int64_t* __restrict__ path_nodes,  // [B, P]
                                  const int64_t* __restrict__ n_keep,      // [B]
                                  int64_t B, int64_t H, int64_t Lmax, int64_t P, int64_t vecs_per_row) {
  extern __shared__ __align__(16) unsigned char smem[];
  Vec* slots = reinterpret_cast<Vec*>(smem) + threadIdx.x;  // [P] this thread's slots, stride blockDim.x
  const int64_t lb = blockIdx.x, b = lb % B;
  const int64_t n = n_keep[b], start = cache_len[b];
  const int64_t* path = path_nodes + b * P;
  if (lantern::compact_kv_check_row(n, start, path, P, Lmax).error != lantern::CompactKVError::kOk) return;
  const int64_t cols = H * vecs_per_row;
  for (int64_t col = blockIdx.y * int64_t(blockDim.x) + threadIdx.x; col < cols;
       col += int64_t(gridDim.y) * blockDim.x) {
    const int64_t h = col / vecs_per_row, v = col % vecs_per_row;
    Vec* head = cache + (lb * H + h) * Lmax * vecs_per_row + v;  // element v of position 0 of this head
    for (int64_t i = 0; i < n; ++i) slots[i * blockDim.x] = head[(start + path[i]) * vecs_per_row];
    for (int64_t i = 0; i < n; ++i) head[(start + i) * vecs_per_row] = slots[i * blockDim.x];
  }
}

template <typename Vec>
void launch(at::Tensor& cache, const at::Tensor& len, const at::Tensor& path, const at::Tensor& keep,
            const lantern::CompactKVDims& g, int64_t row_bytes) {
  // Up to 256 threads, fewer (a multiple of 32, at least 32: see fits()) so that P slots each fit in shared memory.
  const int64_t threads = std::min<int64_t>(256, kSharedBytes / (g.P * int64_t(sizeof(Vec))) / 32 * 32);
  const int64_t vecs_per_row = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t cols = g.H * vecs_per_row;
  const dim3 grid(static_cast<unsigned>(g.L * g.B),
                  static_cast<unsigned>(std::min<int64_t>((cols + threads - 1) / threads, 65535)));
  const size_t shared = static_cast<size_t>(g.P * threads * int64_t(sizeof(Vec)));
  compact_kv_kernel<Vec><<<grid, static_cast<unsigned>(threads), shared, c10::cuda::getCurrentCUDAStream()>>>(
      static_cast<Vec*>(cache.data_ptr()), len.data_ptr<int64_t>(), path.data_ptr<int64_t>(), keep.data_ptr<int64_t>(),
      g.B, g.H, g.Lmax, g.P, vecs_per_row);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

at::Tensor compact_kv_cuda(at::Tensor& cache, const at::Tensor& cache_len, const at::Tensor& path_nodes,
                           const at::Tensor& n_keep) {
  const c10::cuda::CUDAGuard guard(cache.device());
  const auto g = lantern::check_compact_kv(cache, cache_len, path_nodes, n_keep);
  const at::Tensor len = cache_len.contiguous(), path = path_nodes.contiguous(), keep = n_keep.contiguous();
  TORCH_CHECK_VALUE(g.L * g.B < (int64_t{1} << 31), "compact_kv: too many (leading, batch) slices: ", g.L * g.B);
  const int64_t row_bytes = g.Dh * static_cast<int64_t>(cache.element_size());
  if (g.L * g.B > 0 && g.H * row_bytes > 0 && g.P > 0) {
    // The widest copy unit that divides the row, matches the base pointer's alignment (rows start at multiples
    // of row_bytes from it) and leaves room for 32 threads x P slots in shared memory.
    const auto align = reinterpret_cast<uintptr_t>(cache.data_ptr()) | static_cast<uintptr_t>(row_bytes);
    const auto fits = [&](int64_t vec) { return align % vec == 0 && 32 * g.P * vec <= kSharedBytes; };
    TORCH_CHECK_VALUE(fits(1), "compact_kv: path_nodes.shape[1] = ", g.P, " exceeds the CUDA kernel's limit of ",
                      kSharedBytes / 32, " kept nodes");
    if (fits(16))
      launch<uint4>(cache, len, path, keep, g, row_bytes);
    else if (fits(8))
      launch<uint2>(cache, len, path, keep, g, row_bytes);
    else if (fits(4))
      launch<uint32_t>(cache, len, path, keep, g, row_bytes);
    else if (fits(2))
      launch<uint16_t>(cache, len, path, keep, g, row_bytes);
    else
      launch<uint8_t>(cache, len, path, keep, g, row_bytes);
  }
  return at::add(cache_len, n_keep);
}

}  // namespace

LANTERN_KERNEL(CUDA, compact_kv, &compact_kv_cuda);
