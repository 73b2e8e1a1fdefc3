// lantern._C: a tiny Python module beside the kernels. Each op's schema is declared once, in Python, by its
// op module (python/lantern/ops/<op>_op.py, with torch.library); the kernels only register implementations of
// it: LANTERN_KERNEL(CPU / CUDA, op, kernel) in csrc/cpu/<op>.cpp and csrc/cuda/bindings.cpp
// (kernel_registry.h). Those registrations run when Python calls register_kernels() below, after importing the
// module. The argument checks the kernels rely on for memory safety are in op_checks.h.
#include <ATen/Parallel.h>
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

#include "kernel_registry.h"
#include "lantern_build_info.h"  // LANTERN_BUILD_INFO, written by setup.py into build/generated

static bool cuda_compiled() {
#ifdef LANTERN_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// Registers every kernel with torch's dispatcher, all or none: a registration the dispatcher refuses (the
// kernel's signature differs from the schema Python declared: lantern._C is older or newer than the Python
// package) undoes the ones before it and raises RuntimeError naming the op. Later calls do nothing.
static void register_kernels() {
  using Libraries = std::map<c10::DispatchKey, std::unique_ptr<torch::Library>>;
  static Libraries* held = nullptr;  // never freed: the kernels stay registered until the process exits
  if (held != nullptr) return;
  auto libraries = std::make_unique<Libraries>();
  try {
    for (const auto& registration : lantern::kernel_registrations()) {
      auto& library = (*libraries)[registration.key];
      if (!library)
        library =
            std::make_unique<torch::Library>(torch::Library::IMPL, "lantern", registration.key, __FILE__, __LINE__);
      registration.add(*library);
    }
  } catch (const c10::Error& e) {  // `libraries` goes, and with it the kernels registered so far
    throw std::runtime_error(
        std::string("lantern._C does not match the lantern Python package (a stale build?): rebuild it with "
                    "`make install` or `pip install --no-build-isolation -e .`. The dispatcher said: ") +
        e.what_without_backtrace());
  }
  held = libraries.release();
}

// The distinct threads that ran the chunks of an at::parallel_for over `items` items (grain 1) in this
// extension: at::parallel_for is a header template that runs its whole range on the calling thread unless the
// extension itself is compiled with OpenMP, so this says whether the CPU kernels' parallel loops are parallel.
static int64_t parallel_threads(int64_t items) {
  std::mutex mutex;
  std::set<int> threads;
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) {
    std::lock_guard<std::mutex> lock(mutex);
    threads.insert(at::get_thread_num());
  });
  return static_cast<int64_t>(threads.size());
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lantern's C++/CUDA kernels, registered as torch.ops.lantern.* by register_kernels()";
  m.def("cuda_compiled", &cuda_compiled, "Whether this build contains the CUDA kernels (csrc/cuda).");
  m.def(
      "build_info", []() { return std::string(LANTERN_BUILD_INFO); },
      "One line written by setup.py at build time: with or without CUDA kernels, for which architectures.");
  m.def("parallel_threads", &parallel_threads,
        "The distinct threads an at::parallel_for over `items` items ran on in this extension (1 without OpenMP).");
  m.def("register_kernels", &register_kernels,
        "Registers the kernels for the lantern:: schemas declared in Python (lantern.ops); RuntimeError, and "
        "nothing registered, if one does not match.");
}
