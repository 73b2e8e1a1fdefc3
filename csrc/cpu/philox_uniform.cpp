// CPU kernel of lantern::philox_uniform (SPEC §5): out[i] = uniform(Philox4x32-10(seed, c0..c3[i]) word 0).
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>

#include "lantern/philox.h"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

at::Tensor philox_uniform_cpu(const at::Tensor& seed, const at::Tensor& c0, const at::Tensor& c1, const at::Tensor& c2,
                              const at::Tensor& c3) {
  const auto c = lantern::check_philox(seed, c0, c1, c2, c3);  // 4 x int64 [*shape], contiguous
  at::Tensor out = at::empty(c[0].sizes(), c[0].options().dtype(at::kFloat));  // float32 [*shape]
  const uint64_t s = *static_cast<const uint64_t*>(seed.data_ptr());
  const int64_t *p0 = c[0].data_ptr<int64_t>(), *p1 = c[1].data_ptr<int64_t>(), *p2 = c[2].data_ptr<int64_t>(),
                *p3 = c[3].data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  at::parallel_for(0, out.numel(), 1 << 14, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i)
      o[i] = lantern::philox_uniform(s, static_cast<uint32_t>(p0[i]), static_cast<uint32_t>(p1[i]),
                                     static_cast<uint32_t>(p2[i]), static_cast<uint32_t>(p3[i]));
  });
  return out;
}

}  // namespace

LANTERN_KERNEL(CPU, philox_uniform, &philox_uniform_cpu);
