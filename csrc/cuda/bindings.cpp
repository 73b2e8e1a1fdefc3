// The torch side of lantern's CUDA kernels, one section per op: argument checks (op_checks.h), the device guard,
// contiguous inputs and outputs from the caching allocator, then the op's launcher (lantern/cuda/launch.h,
// defined with its kernels in csrc/cuda/<op>.cu) on the current stream. Compiled by the host compiler alone;
// nvcc compiles only the torch-free kernels. No binding synchronises with the host, so every op is CUDA-graph
// capturable.
#include <ATen/ops/add.h>
#include <ATen/ops/div.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/norm.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <tuple>

#include "kernel_registry.h"
#include "lantern/cuda/launch.h"
#include "op_checks.h"

namespace {

namespace lc = lantern::cuda;

cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

// The launcher's element type of a floating dtype it reads in place.
lc::Elem elem_of(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return lc::Elem::kFloat32;
    case at::kDouble:
      return lc::Elem::kFloat64;
    case at::kHalf:
      return lc::Elem::kFloat16;
    case at::kBFloat16:
      return lc::Elem::kBFloat16;
    default:
      TORCH_CHECK(false, "lantern: internal error, no CUDA kernel reads ", dtype, " in place");
  }
}

// ---- philox_uniform (SPEC §5): the seed is read on the device ----

at::Tensor philox_uniform_cuda(const at::Tensor& seed, const at::Tensor& c0, const at::Tensor& c1, const at::Tensor& c2,
                               const at::Tensor& c3) {
  const c10::cuda::CUDAGuard guard(c0.device());
  const auto c = lantern::check_philox(seed, c0, c1, c2, c3);  // 4 x int64 [*shape], contiguous
  at::Tensor out = at::empty(c[0].sizes(), c[0].options().dtype(at::kFloat));  // float32 [*shape]
  const int64_t n = out.numel();
  if (n == 0) return out;
  C10_CUDA_CHECK(lc::launch_philox_uniform(static_cast<const uint64_t*>(seed.data_ptr()), c[0].data_ptr<int64_t>(),
                                           c[1].data_ptr<int64_t>(), c[2].data_ptr<int64_t>(), c[3].data_ptr<int64_t>(),
                                           out.data_ptr<float>(), n, current_stream()));
  return out;
}

// ---- continuous_verify (docs/cspd.md): one thread per token; seed and offset read on the device ----

std::tuple<at::Tensor, at::Tensor, at::Tensor> continuous_verify_cuda(
    const at::Tensor& draft, const at::Tensor& mu_p, const at::Tensor& sigma_p, const at::Tensor& mu_q,
    const at::Tensor& sigma_q, const at::Tensor& logsig_p, const at::Tensor& logsig_q, const at::Tensor& rows,
    const at::Tensor& positions, c10::string_view rule, double bandwidth, c10::string_view sigma_ratio,
    int64_t max_tries, const at::Tensor& seed, const at::Tensor& offset) {
  const c10::cuda::CUDAGuard guard(draft.device());
  auto c = lantern::prepare_continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions,
                                              rule, bandwidth, sigma_ratio, max_tries, seed, offset);
  const int64_t M = c.dims.B * c.dims.N;
  if (M == 0) return {c.tokens, c.accepted, c.tries};
  const lc::ContinuousVerifyLaunch a{c.x.data_ptr<float>(),
                                     c.mu_p.data_ptr<float>(),
                                     c.sigma_p.data_ptr<float>(),
                                     c.mu_q.data_ptr<float>(),
                                     c.sigma_q.data_ptr<float>(),
                                     c.logsig_p.data_ptr<float>(),
                                     c.logsig_q.data_ptr<float>(),
                                     c.rows.data_ptr<int64_t>(),
                                     c.positions.data_ptr<int64_t>(),
                                     static_cast<const uint64_t*>(seed.data_ptr()),
                                     offset.data_ptr<int64_t>(),
                                     c.rule,
                                     c.tokens.data_ptr<float>(),
                                     c.accepted.data_ptr<bool>(),
                                     c.tries.data_ptr<int32_t>(),
                                     M,
                                     c.dims.N,
                                     c.dims.C};
  C10_CUDA_CHECK(lc::launch_continuous_verify(a, current_stream()));
  return {c.tokens, c.accepted, c.tries};
}

// ---- compact_kv (SPEC §6): every layer (and K and V) in one launch ----
// Data-dependent validation happens on the host in lantern.ops (a sync kept out of this op so that it stays
// graph-capturable); the kernel skips a row whose indices would leave [0, Lmax), never reading or writing it.

at::Tensor compact_kv_cuda(at::Tensor& cache, const at::Tensor& cache_len, const at::Tensor& path_nodes,
                           const at::Tensor& n_keep) {
  const c10::cuda::CUDAGuard guard(cache.device());
  const auto g = lantern::check_compact_kv(cache, cache_len, path_nodes, n_keep);
  const at::Tensor len = cache_len.contiguous(), path = path_nodes.contiguous(), keep = n_keep.contiguous();
  TORCH_CHECK_VALUE(g.L * g.B < (int64_t{1} << 31), "compact_kv: too many (leading, batch) slices: ", g.L * g.B);
  const int64_t row_bytes = g.Dh * static_cast<int64_t>(cache.element_size());
  if (g.L * g.B > 0 && g.H * row_bytes > 0 && g.P > 0) {
    // The widest copy unit that divides the row, matches the base pointer's alignment (rows start at multiples
    // of row_bytes from it) and leaves room for 32 threads x P slots in shared memory.
    const auto align = reinterpret_cast<uintptr_t>(cache.data_ptr()) | static_cast<uintptr_t>(row_bytes);
    const auto fits = [&](int64_t vec) { return align % vec == 0 && 32 * g.P * vec <= lc::kCompactKVSharedBytes; };
    TORCH_CHECK_VALUE(fits(1), "compact_kv: path_nodes.shape[1] = ", g.P, " exceeds the CUDA kernel's limit of ",
                      lc::kCompactKVSharedBytes / 32, " kept nodes");
    const int64_t vec_bytes = fits(16) ? 16 : fits(8) ? 8 : fits(4) ? 4 : fits(2) ? 2 : 1;
    C10_CUDA_CHECK(lc::launch_compact_kv(cache.data_ptr(), len.data_ptr<int64_t>(), path.data_ptr<int64_t>(),
                                         keep.data_ptr<int64_t>(), g.L, g.B, g.H, g.Lmax, g.P, row_bytes, vec_bytes,
                                         current_stream()));
  }
  return at::add(cache_len, n_keep);
}

// ---- latent_neighbours (SPEC §2) ----
// float32 / float64 / float16 / bfloat16 codebooks are read in place (the kernel converts each element to float32
// exactly as .to(float32) does); other floating dtypes, and every codebook when `normalize`, are first converted
// with .to(float32) and normalised with the ATen ops F.normalize uses, on the device, so the rows are the
// reference's bits. The kernel reads the codebook transposed, [d, V].

at::Tensor latent_neighbours_cuda(const at::Tensor& codebook, int64_t K, bool normalize) {
  const c10::cuda::CUDAGuard guard(codebook.device());
  lantern::check_latent_neighbours(codebook, K);
  at::Tensor codes = codebook.detach();  // [V, d]
  const at::ScalarType dtype = codes.scalar_type();
  const bool read_in_place =
      dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16;
  if (normalize || !read_in_place) codes = codes.to(at::kFloat);
  if (normalize) codes = at::div(codes, codes.norm(2, {1}, /*keepdim=*/true).clamp_min(1e-12));  // F.normalize
  const at::Tensor ct = codes.t().contiguous();  // [d, V]
  const int64_t V = codes.size(0), d = codes.size(1);
  at::Tensor out = at::empty({V, K}, codebook.options().dtype(at::kInt));  // [V, K]
  C10_CUDA_CHECK(lc::launch_latent_neighbours(ct.const_data_ptr(), elem_of(ct.scalar_type()), V, d, K,
                                              out.mutable_data_ptr<int32_t>(), current_stream()));
  return out;
}

// ---- tree_attention (SPEC §6) ----
// cache_len is read on the device: a batch row whose cache_len is out of range gets NaN output
// (lantern.ops.tree_attention checks the values on the host first; the CPU kernel raises instead).

at::Tensor last_dim_contiguous(const at::Tensor& t) { return t.size(-1) > 1 && t.stride(-1) != 1 ? t.contiguous() : t; }

bool fits_int32(int64_t x) { return x <= std::numeric_limits<int32_t>::max(); }

// 16-byte chunks of K/V rows are safe to read when Dh fills the padded width (no column mask) and every row
// start is 16-byte aligned: aligned base pointers and strides that are multiples of the chunk.
bool vec_loads_ok(const at::Tensor& k, const at::Tensor& v, int64_t Dh, int64_t Dp) {
  if (Dh != Dp) return false;
  const int64_t chunk = 16 / static_cast<int64_t>(k.element_size());
  for (const at::Tensor* t : {&k, &v}) {
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0) return false;
    for (int d = 0; d < 3; ++d)
      if (t->size(d) > 1 && t->stride(d) % chunk != 0) return false;
  }
  return true;
}

// A padded head dim whose shared memory is over the default 48 KiB needs the device to allow the opt-in.
void check_shared_memory(int Dp, int64_t Dh) {
  const int smem = lc::tree_attn_smem_bytes(Dp);
  if (smem <= 48 * 1024) return;
  int device = 0, optin = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  TORCH_CHECK(smem <= optin, "tree_attention: head dim Dh=", Dh, " needs ", smem,
              " bytes of shared memory per block; this GPU allows ", optin);
}

at::Tensor tree_attention_cuda(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& cache_len, const at::Tensor& tree_mask) {
  const c10::cuda::CUDAGuard guard(q.device());
  const auto d = lantern::check_tree_attention(q, k_cache, v_cache, cache_len, tree_mask);
  const auto dtype = q.scalar_type();
  TORCH_CHECK_TYPE(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kBFloat16 || dtype == at::kHalf,
                   "tree_attention: q must be float32, float64, bfloat16 or float16, got ", dtype);
  TORCH_CHECK_VALUE(d.Dh <= lc::kTreeAttnMaxDh, "tree_attention: head dim Dh=", d.Dh,
                    " exceeds the CUDA kernel's limit of ", lc::kTreeAttnMaxDh);
  const int64_t W = (d.T + 31) / 32, G = d.H / d.Hkv;
  const int64_t blocks_per_head = lc::tree_attn_blocks_per_head(d.H, d.Hkv, d.T);
  const int64_t blocks = d.B * d.Hkv * blocks_per_head;
  TORCH_CHECK_VALUE(fits_int32(G * d.T + lc::kTreeAttnRows) && fits_int32(d.B * d.T * W) && fits_int32(d.B * d.H) &&
                        fits_int32(blocks),
                    "tree_attention: too large for the CUDA kernel's 32-bit indices (B=", d.B, ", H=", d.H, ", T=", d.T,
                    ")");
  const int Dp = lc::tree_attn_padded_dh(d.Dh);
  check_shared_memory(Dp, d.Dh);
  const at::Tensor qc = last_dim_contiguous(q), kc = last_dim_contiguous(k_cache), vc = last_dim_contiguous(v_cache);
  const at::Tensor len = cache_len.contiguous(), mask = tree_mask.contiguous();  // [B], [B, T, W]
  at::Tensor o = at::empty({d.B, d.H, d.T, d.Dh}, q.options());                   // [B, H, T, Dh]
  lc::TreeAttnParams p{};
  p.q = qc.data_ptr();
  p.k = kc.data_ptr();
  p.v = vc.data_ptr();
  p.o = o.data_ptr();
  p.cache_len = len.data_ptr<int64_t>();
  p.tree_mask = mask.data_ptr<int32_t>();
  p.q_sb = qc.stride(0), p.q_sh = qc.stride(1), p.q_st = qc.stride(2);
  p.k_sb = kc.stride(0), p.k_sh = kc.stride(1), p.k_sl = kc.stride(2);
  p.v_sb = vc.stride(0), p.v_sh = vc.stride(1), p.v_sl = vc.stride(2);
  p.Lmax = d.Lmax;
  p.B = static_cast<int>(d.B), p.H = static_cast<int>(d.H), p.Hkv = static_cast<int>(d.Hkv);
  p.T = static_cast<int>(d.T), p.Dh = static_cast<int>(d.Dh), p.W = static_cast<int>(W);
  p.blocks_per_head = static_cast<int>(blocks_per_head);
  p.qk_scale = static_cast<float>(1.4426950408889634 / std::sqrt(static_cast<double>(d.Dh)));
  p.vec_loads = vec_loads_ok(kc, vc, d.Dh, Dp);
  C10_CUDA_CHECK(lc::launch_tree_attention(p, elem_of(dtype), Dp, blocks, current_stream()));
  return o;
}

// ---- verify (SPEC §3-§5): one thread block per row ----
// Schema as on the CPU, with one difference for invalid values: lantern.ops.verify checks token ids, tree order
// and neighbour ids on the host before dispatch; called directly, the CUDA op does not raise on them (that would
// need a host sync) but marks the row: a row whose tree is invalid, or whose visited neighbour rows hold an id
// outside [0, V), gets accept_len = -1, next_token = -1, path = -1 and node_status = -1. Nothing is read or written
// out of bounds. Shapes, dtypes and devices raise (TORCH_CHECK).
//
// Compute type (Real): float64 for float64 logits, float32 otherwise (cfg_scale / temperature come in Real).
// Element types: the kernel reads logits, uncond_logits and draft_probs in their own dtype when uncond has the
// logits' dtype and draft_probs has the logits' dtype or Real's; other mixes are converted to Real's dtype
// first (the same values the kernel's own conversion gives).

template <class T>
const T* ptr_or_null(const at::Tensor& t) {
  return t.defined() ? static_cast<const T*>(t.data_ptr()) : nullptr;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_cuda(
    const at::Tensor& logits, const at::Tensor& tokens, const at::Tensor& parents,
    const std::optional<at::Tensor>& neighbours, const std::optional<at::Tensor>& uncond_logits,
    const at::Tensor& cfg_scale, const at::Tensor& temperature, const at::Tensor& top_k, const at::Tensor& top_p,
    const std::optional<at::Tensor>& draft_probs, int64_t k, double delta, std::optional<double> lam, bool node_budget,
    const at::Tensor& seed, const at::Tensor& offset, const std::optional<at::Tensor>& rows) {
  const c10::cuda::CUDAGuard guard(logits.device());
  const auto d = lantern::check_verify(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature,
                                       top_k, top_p, draft_probs, k, seed, offset, rows);
  TORCH_CHECK_VALUE(logits.is_cuda(), "verify: logits must be a CUDA tensor, got ", logits.device());
  TORCH_CHECK_VALUE(d.B <= int64_t{0x7fffffff}, "verify: B = ", d.B, " exceeds the CUDA grid limit");
  const int64_t B = d.B, T = d.T, V = d.V;
  const auto real = logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  // uncond in another dtype than logits: both read as Real's dtype
  const bool widen = uncond_logits && uncond_logits->scalar_type() != logits.scalar_type();
  const at::Tensor lc = widen ? logits.to(real).contiguous() : logits.contiguous();
  const at::Tensor lu = uncond_logits ? uncond_logits->to(lc.scalar_type()).contiguous() : at::Tensor();
  at::Tensor dr;
  if (draft_probs)
    dr =
        draft_probs->scalar_type() == lc.scalar_type() ? draft_probs->contiguous() : draft_probs->to(real).contiguous();
  const at::Tensor tok = tokens.contiguous(), par = parents.contiguous();
  const at::Tensor nb = (neighbours && k > 0) ? neighbours->contiguous() : at::Tensor();
  const at::Tensor cfg = cfg_scale.contiguous(), temp = temperature.contiguous();
  const at::Tensor tk = top_k.contiguous(), tp = top_p.contiguous();
  const at::Tensor row_words = rows ? rows->contiguous() : at::Tensor();
  const auto opts = logits.options();
  const auto i64 = opts.dtype(at::kLong);
  const at::Tensor l = at::empty({B, V}, opts.dtype(real)), p = at::empty({B, V}, opts.dtype(real));  // scratch
  const at::Tensor q = draft_probs ? at::empty({B, V}, opts.dtype(real)) : at::Tensor();            // scratch
  const at::Tensor tree = at::empty({B, T}, opts.dtype(at::kInt));                                 // scratch
  at::Tensor accept_len = at::empty({B}, i64), path = at::empty({B, T > 1 ? T - 1 : 0}, i64);
  at::Tensor next_token = at::empty({B}, i64), status = at::empty({B, T}, opts.dtype(at::kChar));
  if (B == 0) return {accept_len, path, next_token, status};
  const lc::Elem in = elem_of(lc.scalar_type());
  lc::VerifyLaunch a{};
  a.in = in;
  a.draft_in = dr.defined() ? elem_of(dr.scalar_type()) : in;
  a.logits = lc.data_ptr();
  a.uncond = ptr_or_null<void>(lu);
  a.draft = ptr_or_null<void>(dr);
  a.tokens = tok.data_ptr<int64_t>();
  a.parents = par.data_ptr<int64_t>();
  a.neighbours = nb.defined() ? nb.data_ptr<int32_t>() : nullptr;
  a.cfg_scale = cfg.data_ptr();  // Real: check_verify requires the compute dtype
  a.temperature = temp.data_ptr();
  a.top_k = tk.data_ptr<int64_t>();
  a.top_p = tp.data_ptr<double>();
  a.seed = seed.data_ptr<int64_t>();
  a.offset = offset.data_ptr<int64_t>();
  a.rows = row_words.defined() ? row_words.data_ptr<int64_t>() : nullptr;
  a.k = static_cast<int32_t>(k);
  a.delta = delta;
  a.lam = lam.value_or(0.0);
  a.lambda_mode = lam.has_value();
  a.node_budget = node_budget;
  a.B = d.B, a.T = d.T, a.V = d.V, a.K = d.K;
  a.l = l.data_ptr();
  a.p = p.data_ptr();
  a.q = q.defined() ? q.data_ptr() : nullptr;
  a.tree = tree.data_ptr<int32_t>();
  a.accept_len = accept_len.data_ptr<int64_t>();
  a.path = path.data_ptr<int64_t>();
  a.next_token = next_token.data_ptr<int64_t>();
  a.status = status.data_ptr<int8_t>();
  C10_CUDA_CHECK(lc::launch_verify(a, current_stream()));
  return {accept_len, path, next_token, status};
}

}  // namespace

LANTERN_KERNEL(CUDA, philox_uniform, &philox_uniform_cuda);
LANTERN_KERNEL(CUDA, continuous_verify, &continuous_verify_cuda);
LANTERN_KERNEL(CUDA, compact_kv, &compact_kv_cuda);
LANTERN_KERNEL(CUDA, latent_neighbours, &latent_neighbours_cuda);
LANTERN_KERNEL(CUDA, tree_attention, &tree_attention_cuda);
LANTERN_KERNEL(CUDA, verify, &verify_cuda);
