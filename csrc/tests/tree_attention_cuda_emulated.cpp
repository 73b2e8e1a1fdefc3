// The CUDA tree_attention kernel (csrc/include/lantern/cuda/tree_attention.cuh) run on the host under the SIMT
// emulator (cuda_emulation/include/simt_emu.h) and compared with the CPU kernel (lantern/cpu/tree_attention.h)
// on the same inputs: every dtype and padded head dim, GQA, T = 1 and T > 64, cache_len 0, Lmax = cache_len + T,
// odd Dh, padded strides, NaN in every unused cache position, and invalid rows (which must come out NaN).
// Build: g++ -std=c++20 -pthread -DLANTERN_SIMT_EMULATION -DLANTERN_NO_TARGET_CLONES
//        -I csrc/tests/cuda_emulation/include -I csrc/include (tests/ops/test_tree_attention_cuda_emulated.py).
#include "simt_emu.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdio>
#include <random>

// CUDA vector types and intrinsics the kernel uses beyond what simt_emu.h provides.
struct float4 {
  float x, y, z, w;
};
struct float2 {
  float x, y;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float a, float b, float c, float d) { return {a, b, c, d}; }
inline float2 make_float2(float a, float b) { return {a, b}; }
template <class T>
T __shfl_xor_sync(unsigned, T v, int m) {
  int l = threadIdx.x & 31;
  return emu_exchange(v, l ^ m, true);
}
inline void __syncwarp(unsigned = 0xffffffffu) { emu::warp_sync(); }
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline float __uint_as_float(unsigned i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}
inline double __hiloint2double(int hi, int lo) {
  uint64_t b = (uint64_t)(uint32_t)hi << 32 | (uint32_t)lo;
  double d;
  std::memcpy(&d, &b, 8);
  return d;
}
inline __half __ushort_as_half(unsigned short x) { return __half{x}; }
inline __half __float2half_rn(float f) { return __half{lantern::cpu::float_to_fp16(f)}; }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16{lantern::cpu::float_to_bf16(f)}; }
alignas(16) static float emu_smem[64 * 1024];
inline float* lantern_emu_dynamic_smem() { return emu_smem; }
#include "lantern/cuda/tree_attention.cuh"
#include "lantern/cpu/tree_attention.h"

using lantern::cpu::DType;
template <class T>
DType dt();
template <>
DType dt<float>() {
  return DType::kFloat32;
}
template <>
DType dt<double>() {
  return DType::kFloat64;
}
template <>
DType dt<__half>() {
  return DType::kFloat16;
}
template <>
DType dt<__nv_bfloat16>() {
  return DType::kBFloat16;
}
template <class T>
T fromf(float f);
template <>
float fromf<float>(float f) {
  return f;
}
template <>
double fromf<double>(float f) {
  return f;
}
template <>
__half fromf<__half>(float f) {
  return __half{lantern::cpu::float_to_fp16(f)};
}
template <>
__nv_bfloat16 fromf<__nv_bfloat16>(float f) {
  return __nv_bfloat16{lantern::cpu::float_to_bf16(f)};
}
template <class T>
float tof(T x);
template <>
float tof<float>(float x) {
  return x;
}
template <>
float tof<double>(double x) {
  return (float)x;
}
template <>
float tof<__half>(__half x) {
  return __half2float(x);
}
template <>
float tof<__nv_bfloat16>(__nv_bfloat16 x) {
  return __bfloat162float(x);
}

int failures = 0;
// q [B, H, T, Dh + qpad] and K/V [B, Hkv, Lmax, Dh + kvpad] (the pads make the strides non-dense); random
// trees (each node's parent drawn among the earlier nodes).
template <class E, int Dp>
void run_case(int B, int H, int Hkv, int T, int Dh, int Lmax, std::vector<int64_t> len, int kvpad, int qpad,
              unsigned seed, bool corrupt = false) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int64_t q_st = Dh + qpad, q_sh = T * q_st, q_sb = H * q_sh;
  const int64_t k_sl = Dh + kvpad, k_sh = Lmax * k_sl, k_sb = Hkv * k_sh;
  std::vector<E> q(B * q_sb), k(B * k_sb), v(B * k_sb);
  for (auto& x : q) x = fromf<E>(nd(rng) * 2.f);
  for (int64_t i = 0; i < (int64_t)k.size(); ++i) {  // positions >= len + T hold NaN
    const int64_t b = i / k_sb, pos = (i % k_sh) / k_sl;
    const bool unused = len[b] < 0 || pos >= len[b] + T;
    k[i] = fromf<E>(unused ? NAN : nd(rng));
    v[i] = fromf<E>(unused ? NAN : nd(rng));
  }
  if (corrupt) {  // non-finite inputs: the rows that read them come out NaN in full, no other row is touched
    const auto at = [&](int64_t b, int64_t g, int64_t pos, int64_t d) { return b * k_sb + g * k_sh + pos * k_sl + d; };
    v[at(0, 0, len[0] + T - 1, 1)] = fromf<E>(NAN);        // the last tree node's value: only that node reads it
    k[at(0, Hkv - 1, len[0] + T - 1, 0)] = fromf<E>(INFINITY);  // its key, in the last kv head
    q[(H - 1) * q_sh + 0 * q_st + 2] = fromf<E>(-INFINITY);  // one query element of row 0
    if (B > 1 && len[1] > 0) k[at(1, 0, 0, 3)] = fromf<E>(NAN);  // a prefix key of row 1: its whole kv group
  }
  const int W = (T + 31) / 32;
  std::vector<int32_t> mask(B * T * W, 0);
  for (int b = 0; b < B; ++b) {
    std::vector<int> parent(T);
    for (int i = 0; i < T; ++i) parent[i] = i == 0 ? -1 : (int)(rng() % i);
    for (int i = 0; i < T; ++i)
      for (int j = i; j >= 0; j = parent[j]) mask[(b * T + i) * W + j / 32] |= (int32_t)(1u << (j % 32));
  }
  const int G = H / Hkv;
  std::vector<E> o_gpu(B * H * T * Dh, fromf<E>(-777.f));
  lantern::cuda::TreeAttnParams p{};
  p.q = q.data();
  p.k = k.data();
  p.v = v.data();
  p.o = o_gpu.data();
  p.cache_len = len.data();
  p.tree_mask = mask.data();
  p.q_sb = q_sb;
  p.q_sh = q_sh;
  p.q_st = q_st;
  p.k_sb = k_sb;
  p.k_sh = k_sh;
  p.k_sl = k_sl;
  p.v_sb = k_sb;
  p.v_sh = k_sh;
  p.v_sl = k_sl;
  p.Lmax = Lmax;
  p.B = B;
  p.H = H;
  p.Hkv = Hkv;
  p.T = T;
  p.Dh = Dh;
  p.W = W;
  p.blocks_per_head = (int)lantern::cuda::tree_attn_blocks_per_head(H, Hkv, T);
  p.qk_scale = (float)(1.4426950408889634 / std::sqrt((double)Dh));
  const int64_t chunk = 16 / sizeof(E);
  p.vec_loads = Dh == Dp && k_sl % chunk == 0 && k_sh % chunk == 0;
  const int blocks = B * Hkv * p.blocks_per_head;
  for (int blk = 0; blk < blocks; ++blk)
    emu::run_block(blk, lantern::cuda::kTreeAttnThreads, [&] { lantern::cuda::tree_attention_kernel<E, Dp>(p); });
  // CPU reference (valid rows only)
  std::vector<int64_t> len_ok(len);
  for (auto& x : len_ok)
    if (x < 0 || x + T > Lmax) x = 0;
  std::vector<E> o_cpu(B * H * T * Dh);
  lantern::cpu::AttnProblem cp{
      q.data(), k.data(), v.data(),      o_cpu.data(), dt<E>(), q_sb, q_sh, q_st, k_sb, k_sh, k_sl, k_sb,
      k_sh,     k_sl,     len_ok.data(), mask.data(),  B,       H,    Hkv,  T,    Dh,   Lmax, W};
  lantern::cpu::AttnScratch ws;
  ws.resize(Dh);
  const int64_t items = (int64_t)B * Hkv * lantern::cpu::attn_blocks_per_head(cp);
  for (int64_t it = 0; it < items; ++it) lantern::cpu::attend_item(cp, it, ws);
  const float tol = sizeof(E) == 2 ? (dt<E>() == DType::kBFloat16 ? 1.6e-2f : 2e-3f) : 2e-5f;
  double maxerr = 0;
  int bad = 0, nan_out = 0;
  for (int b = 0; b < B; ++b) {
    const bool invalid = len[b] < 0 || len[b] + T > Lmax;
    for (int64_t i = 0; i < (int64_t)H * T * Dh; ++i) {
      const float g = tof<E>(o_gpu[b * H * T * Dh + i]), c = tof<E>(o_cpu[b * H * T * Dh + i]);
      if (invalid) {
        if (!std::isnan(g)) ++bad;
        continue;
      }
      if (std::isnan(g) || std::isnan(c)) {
        bad += std::isnan(g) != std::isnan(c);
        nan_out += std::isnan(g);
        continue;
      }
      const double e = std::fabs(g - c) / (1.0 + std::fabs(c));
      if (!(e <= tol)) ++bad;
      if (e > maxerr) maxerr = e;
    }
  }
  if (corrupt && (nan_out == 0 || nan_out == B * H * T * Dh)) ++bad;  // some rows poisoned, not all
  std::printf("%-6s Dp=%3d B=%d H=%d Hkv=%d T=%2d Dh=%3d Lmax=%4d vec=%d  max rel err %.2e  NaN out %d  bad %d\n",
              dt<E>() == DType::kFloat32   ? "f32"
              : dt<E>() == DType::kFloat64 ? "f64"
              : dt<E>() == DType::kFloat16 ? "f16"
                                           : "bf16",
              Dp, B, H, Hkv, T, Dh, Lmax, (int)p.vec_loads, maxerr, nan_out, bad);
  if (bad) ++failures;
}

int main() {
  run_case<float, 64>(2, 4, 2, 9, 64, 300, {200, 3}, 0, 0, 1);          // GQA, vec loads, multi prefix tiles
  run_case<float, 64>(1, 2, 2, 1, 64, 70, {69}, 0, 0, 2);               // T = 1, Lmax = L + T exactly
  run_case<__nv_bfloat16, 64>(1, 3, 1, 21, 64, 200, {130}, 0, 4, 3);   // G = 3: rows 63 -> 4 blocks
  run_case<__half, 32>(2, 2, 1, 40, 20, 120, {0, 80}, 3, 1, 4);         // cache_len 0, Dh 20 (padded), odd kv stride
  run_case<double, 128>(1, 2, 2, 70, 128, 200, {100}, 0, 0, 5);         // T > 64: several tree tiles, 3 mask words
  run_case<float, 32>(1, 1, 1, 33, 7, 40, {7}, 1, 0, 6);                // Dh odd, T = 33 (2 words)
  run_case<__nv_bfloat16, 128>(1, 4, 4, 5, 100, 50, {45}, 0, 0, 7);     // Dh 100 padded to 128, Lmax = L + T
  run_case<float, 256>(1, 2, 1, 6, 256, 80, {40}, 0, 0, 8);             // Dp 256, N = 32
  run_case<float, 64>(3, 2, 1, 4, 64, 20, {17, -1, 16}, 0, 0, 9);       // invalid rows -> NaN, valid row beside
  run_case<__half, 64>(1, 20, 20, 59, 64, 700, {576}, 0, 0, 10);        // LlamaGen-XL shape
  run_case<float, 64>(2, 4, 2, 9, 64, 300, {200, 3}, 0, 0, 11, true);   // non-finite q / K / V: NaN rows agree
  run_case<__nv_bfloat16, 32>(2, 2, 2, 40, 20, 120, {5, 80}, 3, 1, 12, true);  // scalar loads, 2 tree tiles
  run_case<double, 64>(2, 2, 1, 5, 64, 90, {70, 64}, 0, 0, 13, true);   // vec loads of float64
  if (failures)
    std::printf("tree_attention_cuda_emulated: %d case(s) FAILED\n", failures);
  else
    std::printf("tree_attention_cuda_emulated: OK\n");
  return failures != 0;
}
