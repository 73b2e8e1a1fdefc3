// lantern._C: a tiny Python module beside the kernels. Each op's schema is declared once, in Python, by its
// op module (python/lantern/ops/<op>.py, with torch.library); the kernels only register implementations of
// it, one file per op per backend: TORCH_LIBRARY_IMPL(lantern, CPU / CUDA) in csrc/cpu/<op>.cpp,
// csrc/cuda/<op>.cu. The argument checks the kernels rely on for memory safety are in op_checks.h.
#include <pybind11/pybind11.h>

#include <string>

#include "lantern_build_info.h"  // LANTERN_BUILD_INFO, written by setup.py into build/generated

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
  m.def(
      "build_info", []() { return std::string(LANTERN_BUILD_INFO); },
      "One line written by setup.py at build time: with or without CUDA kernels, for which architectures.");
}
