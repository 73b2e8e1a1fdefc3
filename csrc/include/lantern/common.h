// Shared macros for lantern's kernels. Torch-free, C++17: host code, nvcc and standalone tests include it.
#pragma once

#if defined(__CUDACC__)
#define LANTERN_HOST_DEVICE __host__ __device__
#define LANTERN_INLINE __forceinline__
#else
#define LANTERN_HOST_DEVICE
#define LANTERN_INLINE inline
#endif
