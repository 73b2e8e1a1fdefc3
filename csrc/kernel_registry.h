// Deferred kernel registration. A kernel file registers its kernel with LANTERN_KERNEL(CPU | CUDA, op, fn):
// that only records the registration when lantern._C loads. The registrations run when Python calls
// lantern._C.register_kernels() (csrc/ops.cpp), after the op modules declared the schemas, so a kernel whose
// signature does not match its schema (a stale build) raises a Python exception there instead of aborting the
// process from a static initializer, as TORCH_LIBRARY_IMPL would.
#pragma once

#include <torch/library.h>

#include <functional>
#include <utility>
#include <vector>

namespace lantern {

struct KernelRegistration {
  c10::DispatchKey key;
  std::function<void(torch::Library&)> add;  // m.impl(op, kernel) on the library of `key`
};

// Every LANTERN_KERNEL of the module, in load order.
inline std::vector<KernelRegistration>& kernel_registrations() {
  static std::vector<KernelRegistration> registrations;
  return registrations;
}

struct DeferredKernel {
  DeferredKernel(c10::DispatchKey key, std::function<void(torch::Library&)> add) {
    kernel_registrations().push_back({key, std::move(add)});
  }
};

}  // namespace lantern

#define LANTERN_KERNEL(KEY, OP, FN)                                            \
  static const ::lantern::DeferredKernel lantern_deferred_kernel_##OP##_##KEY( \
      c10::DispatchKey::KEY, [](torch::Library& m) { m.impl(#OP, FN); })
