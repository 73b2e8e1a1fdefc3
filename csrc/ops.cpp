// lantern._C: the schemas of lantern's custom ops (torch.ops.lantern.*) and a tiny Python module.
// Kernels live in one file per op per backend: csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu.
#include <pybind11/pybind11.h>
#include <torch/library.h>

TORCH_LIBRARY(lantern, m) {
  // SPEC §6. cache [..., B, Hkv, Lmax, Dh] (any float dtype, contiguous) is modified in place: for
  // i < n_keep[b], position cache_len[b] + i <- cache_len[b] + path_nodes[b, i], every source read before
  // anything is written (so any order is safe). cache_len, n_keep int64 [B]; path_nodes int64 [B, P], -1 padded.
  // Returns cache_len + n_keep.
  m.def("compact_kv(Tensor(a!) cache, Tensor cache_len, Tensor path_nodes, Tensor n_keep) -> Tensor");
  // SPEC §5. float32 uniforms from Philox4x32-10 word 0, shape = broadcast of the counters. The seed is a
  // one-element int64 tensor on the counters' device holding the 64-bit seed's bits (values >= 2^63 as
  // negative int64): a device tensor, so a captured CUDA graph can replay with a new seed. Counters are
  // integer tensors taken modulo 2^32; the offset (c3) may likewise be a device tensor.
  m.def("philox_uniform(Tensor seed, Tensor c0, Tensor c1, Tensor c2, Tensor c3) -> Tensor");
}

static bool cuda_compiled() {
#ifdef LANTERN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lantern's C++/CUDA kernels, registered as torch.ops.lantern.*";
  m.def("cuda_compiled", &cuda_compiled, "Whether this build contains the CUDA kernels (csrc/cuda).");
}
