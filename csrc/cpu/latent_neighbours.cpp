// CPU kernel of lantern::latent_neighbours (SPEC §2): one call, parallel over blocks of rows; the work is
// lantern::cpu::neighbour_rows (csrc/include/lantern/cpu/latent_neighbours.h).
#include <ATen/Parallel.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/norm.h>

#include "lantern/cpu/latent_neighbours.h"
#include "kernel_registry.h"
#include "op_checks.h"

namespace {

at::Tensor latent_neighbours_cpu(const at::Tensor& codebook, int64_t K, bool normalize) {
  lantern::check_latent_neighbours(codebook, K);
  at::Tensor codes = codebook.detach().to(at::kFloat).contiguous();  // [V, d]
  if (normalize)
    codes = at::div(codes, codes.norm(2, {1}, /*keepdim=*/true).clamp_min(1e-12)).contiguous();  // F.normalize
  const at::Tensor ct = codes.t().contiguous();  // [d, V]
  const int64_t V = codes.size(0), d = codes.size(1);
  at::Tensor out = at::empty({V, K}, codebook.options().dtype(at::kInt));  // [V, K]
  const float* c = codes.data_ptr<float>();
  const float* t = ct.data_ptr<float>();
  int32_t* o = out.data_ptr<int32_t>();
  const int64_t blocks = (V + lantern::cpu::kNbrRows - 1) / lantern::cpu::kNbrRows;
  at::parallel_for(0, blocks, 1, [&](int64_t lo, int64_t hi) {
    lantern::cpu::NeighbourScratch ws;
    for (int64_t blk = lo; blk < hi; ++blk) {
      const int64_t r0 = blk * lantern::cpu::kNbrRows, r1 = std::min(V, r0 + lantern::cpu::kNbrRows);
      lantern::cpu::neighbour_rows(c, t, V, d, K, r0, r1, o, ws);
    }
  });
  return out;
}

}  // namespace

LANTERN_KERNEL(CPU, latent_neighbours, &latent_neighbours_cpu);
