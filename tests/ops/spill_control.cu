// Negative control for tests/ops/test_cuda_build.py (plain nvcc, no torch headers): the spill check must
// flag spill_kernel and must not flag the other two.

// 48 live floats per thread under a 32-register cap (1024 threads x 2 blocks per SM): ptxas spills.
__global__ void __launch_bounds__(1024, 2) spill_kernel(const float* in, float* out, int n) {
  float acc[48];
#pragma unroll
  for (int i = 0; i < 48; ++i) acc[i] = in[(threadIdx.x + i * 131) % n];
#pragma unroll
  for (int r = 0; r < 8; ++r) {
#pragma unroll
    for (int i = 0; i < 48; ++i) acc[i] = acc[i] * acc[(i + r + 1) % 48] + in[(i * r) % n];
  }
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < 48; ++i) sum += acc[i];
  out[threadIdx.x] = sum;
}

// A dynamically indexed local array: a stack frame, but no spill.
__global__ void local_array_kernel(const float* in, float* out, int n, int k) {
  float buf[64];
  for (int i = 0; i < 64; ++i) buf[i] = in[(threadIdx.x * 64 + i) % n];
  out[threadIdx.x] = buf[k & 63];
}

__global__ void clean_kernel(const float* in, float* out) { out[threadIdx.x] = 2.f * in[threadIdx.x]; }
