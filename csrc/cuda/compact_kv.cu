// CUDA kernel of lantern::compact_kv (SPEC §6): one launch for every layer (and K and V) at once.
//
// Grid: x over the (leading, b) slices, y over chunks of the Hkv x Dh columns. Each thread owns one column
// (a head and one vector of its Dh elements): it gathers the kept positions into its own shared-memory
// slots, then writes them back from cache_len on. No thread touches another's column, so there is no
// synchronisation, any order of kept nodes is safe, and loads/stores are coalesced along Dh.
// Data-dependent validation happens on the host in lantern.ops (a sync kept out of this op so that it stays
// graph-capturable); a row whose indices would leave [0, Lmax) is skipped here, never read or written.
#include <algorithm>
#include <cstdint>

#include "lantern/compact_kv.h"
#include "lantern/cuda/launch.h"

namespace {

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
cudaError_t launch(void* cache, const int64_t* len, const int64_t* path, const int64_t* keep, int64_t L, int64_t B,
                   int64_t H, int64_t Lmax, int64_t P, int64_t row_bytes, cudaStream_t stream) {
  // Up to 256 threads, fewer (a multiple of 32, at least 32: the binding checked 32 * P * vec_bytes) so that P
  // slots each fit in shared memory.
  const int64_t threads =
      std::min<int64_t>(256, lantern::cuda::kCompactKVSharedBytes / (P * int64_t(sizeof(Vec))) / 32 * 32);
  const int64_t vecs_per_row = row_bytes / static_cast<int64_t>(sizeof(Vec));
  const int64_t cols = H * vecs_per_row;
  const dim3 grid(static_cast<unsigned>(L * B),
                  static_cast<unsigned>(std::min<int64_t>((cols + threads - 1) / threads, 65535)));
  const size_t shared = static_cast<size_t>(P * threads * int64_t(sizeof(Vec)));
  compact_kv_kernel<Vec><<<grid, static_cast<unsigned>(threads), shared, stream>>>(static_cast<Vec*>(cache), len, path,
                                                                                   keep, B, H, Lmax, P, vecs_per_row);
  return cudaGetLastError();
}

}  // namespace

namespace lantern::cuda {

cudaError_t launch_compact_kv(void* cache, const int64_t* cache_len, const int64_t* path_nodes, const int64_t* n_keep,
                              int64_t L, int64_t B, int64_t H, int64_t Lmax, int64_t P, int64_t row_bytes,
                              int64_t vec_bytes, cudaStream_t stream) {
  switch (vec_bytes) {
    case 16:
      return launch<uint4>(cache, cache_len, path_nodes, n_keep, L, B, H, Lmax, P, row_bytes, stream);
    case 8:
      return launch<uint2>(cache, cache_len, path_nodes, n_keep, L, B, H, Lmax, P, row_bytes, stream);
    case 4:
      return launch<uint32_t>(cache, cache_len, path_nodes, n_keep, L, B, H, Lmax, P, row_bytes, stream);
    case 2:
      return launch<uint16_t>(cache, cache_len, path_nodes, n_keep, L, B, H, Lmax, P, row_bytes, stream);
    case 1:
      return launch<uint8_t>(cache, cache_len, path_nodes, n_keep, L, B, H, Lmax, P, row_bytes, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace lantern::cuda
