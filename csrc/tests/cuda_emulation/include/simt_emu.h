// A tiny SIMT emulator for logic checks of lantern's CUDA kernel headers on a machine without a GPU
// (tests/ops/test_verify_cuda_emulated.py). One OS thread per CUDA thread, blocks run one after another;
// std::barrier stands in for __syncthreads and a per-warp barrier for the shuffles and ballots, which every
// lane of the warp must call (as the kernels do). __shared__ becomes a function-local static (one block at a
// time). It checks control flow, indexing and arithmetic, not the GPU memory model: its barriers order
// everything, and a missing __syncthreads() between two phases may go unnoticed here.
// Include it before any lantern/cuda header, with this directory first on the include path (it provides
// host stand-ins for <cuda_fp16.h> / <cuda_bf16.h>). C++20.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#define __device__
#define __global__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
struct EmuDim3 {
  unsigned x = 0, y = 0, z = 0;
};
inline thread_local EmuDim3 threadIdx, blockIdx;
namespace emu {
inline std::unique_ptr<std::barrier<>> block_bar;
inline std::vector<std::unique_ptr<std::barrier<>>> warp_bar;
inline uint64_t wbuf[32][32];
inline std::atomic<int> or_acc{0};
inline void warp_sync() { warp_bar[threadIdx.x >> 5]->arrive_and_wait(); }
template <class F>
void run_block(unsigned b, int nt, F body) {
  block_bar = std::make_unique<std::barrier<>>(nt);
  warp_bar.clear();
  for (int w = 0; w < nt / 32; ++w) warp_bar.push_back(std::make_unique<std::barrier<>>(32));
  std::vector<std::thread> th;
  for (int t = 0; t < nt; ++t)
    th.emplace_back([=] {
      threadIdx.x = t;
      blockIdx.x = b;
      body();
    });
  for (auto& x : th) x.join();
}
}  // namespace emu
inline void __syncthreads() { emu::block_bar->arrive_and_wait(); }
inline int __syncthreads_or(int p) {
  __syncthreads();
  if (p) emu::or_acc.store(1);
  __syncthreads();
  const int r = emu::or_acc.load();
  __syncthreads();
  if (threadIdx.x == 0) emu::or_acc.store(0);
  __syncthreads();
  return r;
}
template <class T>
T emu_exchange(T v, int src, bool valid) {
  static_assert(sizeof(T) <= 8);
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(T));
  emu::wbuf[w][lane] = bits;
  emu::warp_sync();
  T out = v;
  if (valid) std::memcpy(&out, &emu::wbuf[w][src], sizeof(T));
  emu::warp_sync();
  return out;
}
template <class T>
T __shfl_down_sync(unsigned, T v, unsigned d) {
  int l = threadIdx.x & 31;
  return emu_exchange(v, l + d, l + (int)d < 32);
}
template <class T>
T __shfl_up_sync(unsigned, T v, unsigned d) {
  int l = threadIdx.x & 31;
  return emu_exchange(v, l - (int)d, l >= (int)d);
}
template <class T>
T __shfl_sync(unsigned, T v, int src) {
  return emu_exchange(v, src, true);
}
inline unsigned __ballot_sync(unsigned, int p) {
  const int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
  emu::wbuf[w][lane] = p ? 1 : 0;
  emu::warp_sync();
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= (emu::wbuf[w][i] ? 1u : 0u) << i;
  emu::warp_sync();
  return r;
}
inline int __ffs(unsigned x) { return __builtin_ffs((int)x); }
inline unsigned atomicAdd(unsigned* a, unsigned v) { return std::atomic_ref<unsigned>(*a).fetch_add(v); }
inline double atomicAdd(double* a, double v) { return std::atomic_ref<double>(*a).fetch_add(v); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
