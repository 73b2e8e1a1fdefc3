// Standalone test of lantern's torch-free CPU kernels under AddressSanitizer + UndefinedBehaviorSanitizer.
// No torch: it includes the headers the op bindings call (csrc/include/lantern) and runs them on raw
// pointers over adversarial inputs: T = 1, V = 1, k = K, padding-only trees, all -inf but one logit,
// top_k = V - 1, tiny top_p, zero-mass residuals, huge / tiny / non-finite logits, ragged trees, invalid
// trees and neighbour ids (error paths), every input dtype; neighbour tables with ties, duplicates and
// non-finite codes; tree attention with empty prefixes, odd Dh, GQA, masks with stray bits.
// Every output is checked to be in range. Build and run (tests/ops/test_sanitizers.py does this):
//   g++ -std=c++17 -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=all -I csrc/include \
//       csrc/tests/sanitize_main.cpp -o sanitize && ./sanitize
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <utility>
#include <vector>

#include "lantern/compact_kv.h"
#include "lantern/cpu/latent_neighbours.h"
#include "lantern/cpu/tree_attention.h"
#include "lantern/cpu/verify_walk.h"
#include "lantern/philox.h"

#define CHECK(cond)                                                                   \
  do {                                                                                \
    if (!(cond)) {                                                                    \
      std::fprintf(stderr, "CHECK failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)

using lantern::cpu::DType;

namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

struct Rng {  // splitmix64
  uint64_t s;
  uint64_t next() {
    uint64_t z = (s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  int64_t below(int64_t n) { return n <= 0 ? 0 : static_cast<int64_t>(next() % static_cast<uint64_t>(n)); }
  float uniform() { return static_cast<float>(next() >> 40) / static_cast<float>(1 << 24); }
  float normal() {  // Box-Muller
    const float u = uniform() + 1e-7f, v = uniform();
    return std::sqrt(-2.f * std::log(u)) * std::cos(6.2831853f * v);
  }
  bool coin(float p) { return uniform() < p; }
};

// float values stored as elements of type t.
std::vector<unsigned char> encode(const std::vector<float>& x, DType t) {
  const size_t n = x.size();
  std::vector<unsigned char> out(n * (t == DType::kFloat64 ? 8 : t == DType::kFloat32 ? 4 : 2) + 1);
  switch (t) {
    case DType::kFloat32:
      if (n > 0) std::memcpy(out.data(), x.data(), n * 4);
      break;
    case DType::kFloat64:
      for (size_t i = 0; i < n; ++i) {
        const double v = x[i];
        std::memcpy(out.data() + 8 * i, &v, 8);
      }
      break;
    case DType::kBFloat16:
    case DType::kFloat16:
      for (size_t i = 0; i < n; ++i) {
        const uint16_t h =
            t == DType::kBFloat16 ? lantern::cpu::float_to_bf16(x[i]) : lantern::cpu::float_to_fp16(x[i]);
        std::memcpy(out.data() + 2 * i, &h, 2);
      }
      break;
  }
  return out;
}

// ---- verify ------------------------------------------------------------------------------------------

struct VerifyCase {
  int64_t T = 1, V = 1, K = 0;
  DType dtype = DType::kFloat32;
  std::vector<float> logits, uncond, draft;  // [T, V]; uncond / draft may be empty
  std::vector<int64_t> tokens, parents;      // [T]
  std::vector<int32_t> nbrs;                 // [V, K]
  float cfg = 1.f, temperature = 1.f, delta = 0.f, lam = 1.f;
  int64_t top_k = 0;
  double top_p = 1.0;
  int32_t k = 0;
  bool lambda = false, node_budget = false;
  uint64_t seed = 0;
  uint32_t offset = 0, row = 0;
};

// Runs the walk in compute type Real; checks every output is in range. Returns the status.
template <class Real>
lantern::cpu::VerifyStatus run_verify(const VerifyCase& c, int64_t* next_out = nullptr,
                                      const lantern::cpu::ParallelChunks* parallel = nullptr,
                                      std::vector<int64_t>* outputs = nullptr) {
  const auto lc = encode(c.logits, c.dtype), lu = encode(c.uncond, c.dtype), dr = encode(c.draft, c.dtype);
  const lantern::cpu::VerifyRow<Real> row{
      {lc.data(), c.dtype},
      {c.uncond.empty() ? nullptr : lu.data(), c.dtype},
      {c.draft.empty() ? nullptr : dr.data(), c.dtype},
      c.tokens.data(),
      c.parents.data(),
      c.nbrs.empty() ? nullptr : c.nbrs.data(),
      c.T,
      c.V,
      c.K,
      lantern::cpu::TargetSettings<Real>{static_cast<Real>(c.cfg), static_cast<Real>(c.temperature), c.top_k, c.top_p},
      lantern::Relaxation<Real>{c.k, static_cast<Real>(c.delta), static_cast<Real>(c.lam - 1.f), c.lambda,
                                c.node_budget},
      c.seed,
      c.offset,
      c.row};
  std::vector<int64_t> path(static_cast<size_t>(c.T > 1 ? c.T - 1 : 0) + 1, 12345);  // one guard slot
  std::vector<int8_t> status(static_cast<size_t>(c.T) + 1, 99);
  int64_t accept_len = -7, next = -7;
  lantern::cpu::VerifyWalker<Real> walker(c.V);
  if (parallel != nullptr) walker.set_parallel(*parallel);
  const auto st = walker.run(row, {&accept_len, path.data(), &next, status.data()});
  if (outputs != nullptr) {  // accept_len, next, path, status
    *outputs = {accept_len, next};
    outputs->insert(outputs->end(), path.begin(), path.end());
    outputs->insert(outputs->end(), status.begin(), status.end());
  }
  const int64_t width = c.T > 1 ? c.T - 1 : 0;
  CHECK(path[width] == 12345 && status[c.T] == 99);  // nothing written past the row
  CHECK(next >= 0 && next < c.V);
  CHECK(accept_len >= 0 && accept_len <= width);
  for (int64_t j = 0; j < width; ++j) CHECK(j < accept_len ? (path[j] >= 1 && path[j] < c.T) : path[j] == -1);
  for (int64_t i = 0; i < c.T; ++i) CHECK(status[i] >= -1 && status[i] <= 1);
  if (st.error == lantern::cpu::VerifyError::kOk) {
    CHECK(status[0] == -1);
    for (int64_t j = 0; j < accept_len; ++j) CHECK(status[path[j]] == 1);
  }
  if (next_out) *next_out = next;
  return st;
}

lantern::cpu::VerifyStatus run_both(const VerifyCase& c) {
  const auto a = run_verify<float>(c);
  const auto b = run_verify<double>(c);
  CHECK(a.error == b.error);
  return a;
}

std::vector<int32_t> ring_neighbours(int64_t V, int64_t K) {
  std::vector<int32_t> n(static_cast<size_t>(V * K));
  for (int64_t x = 0; x < V; ++x)
    for (int64_t i = 0; i < K; ++i) n[x * K + i] = static_cast<int32_t>((x + 1 + i) % V);
  return n;
}

// A random valid case with extreme choices mixed in.
VerifyCase random_verify_case(Rng& r, int64_t V = 0) {
  VerifyCase c;
  const int64_t Vs[] = {1, 2, 3, 8, 33, 256, 1000};
  const int64_t Ts[] = {1, 2, 3, 6, 17, 40};
  c.V = Vs[r.below(7)];
  if (V > 0) c.V = V;
  c.T = Ts[r.below(6)];
  c.dtype = static_cast<DType>(r.below(4));
  c.K = c.V > 1 ? 1 + r.below(std::min<int64_t>(c.V - 1, 12)) : 0;
  c.k = c.K > 0 ? static_cast<int32_t>(r.below(c.K + 1)) : 0;
  if (c.K > 0 && r.coin(0.3f)) c.k = static_cast<int32_t>(c.K);  // k = K
  c.nbrs = ring_neighbours(c.V, c.K);
  const int style = static_cast<int>(r.below(6));
  c.logits.resize(static_cast<size_t>(c.T * c.V));
  for (auto& l : c.logits) {
    switch (style) {
      case 0:
        l = r.normal();
        break;
      case 1:
        l = r.coin(0.9f) ? -kInf : r.normal();
        break;       // mostly -inf
      case 2:
        l = r.coin(0.5f) ? 3e38f : -3e38f;
        break;            // huge
      case 3:
        l = r.normal() * 1e-38f;
        break;                       // tiny
      case 4:
        l = std::round(r.normal() * 2.f) / 2.f;
        break;        // ties
      default:
        l = r.normal() * 30.f;
        break;                        // peaked
    }
  }
  for (int64_t t = 0; t < c.T; ++t)  // all -inf but one, sometimes
    if (r.coin(0.15f)) {
      for (int64_t i = 0; i < c.V; ++i) c.logits[t * c.V + i] = -kInf;
      c.logits[t * c.V + r.below(c.V)] = 0.f;
    }
  if (r.coin(0.4f)) {
    c.uncond.resize(c.logits.size());
    for (auto& u : c.uncond) u = r.coin(0.05f) ? -kInf : r.normal() * (style == 2 ? 1e38f : 1.f);
    c.cfg = r.coin(0.2f) ? 0.f : (r.coin(0.2f) ? 1e30f : 1.f + 4.f * r.uniform());
  }
  if (r.coin(0.35f)) {
    c.draft.resize(c.logits.size());
    for (auto& d : c.draft) d = r.coin(0.2f) ? 0.f : r.uniform();
    if (r.coin(0.1f)) std::fill(c.draft.begin(), c.draft.end(), 0.f);  // zero drafter rows
  }
  c.temperature = r.coin(0.25f) ? 0.f : (r.coin(0.1f) ? 1e-30f : 0.3f + r.uniform());
  const int64_t topks[] = {0, 1, c.V - 1, c.V, c.V + 5, -3, 2};
  c.top_k = topks[r.below(7)];
  const double topps[] = {1.0, 1e-9, 0.5, 0.999999, 0.0, 2.0};
  c.top_p = topps[r.below(6)];
  c.lambda = r.coin(0.3f);
  c.lam = c.lambda ? 1.f + 3.f * r.uniform() : 1.f;
  c.delta = r.coin(0.2f) ? 0.f : (r.coin(0.1f) ? 10.f : r.uniform() * 0.5f);
  c.node_budget = !c.lambda && r.coin(0.5f);
  c.seed = r.next();
  c.offset = static_cast<uint32_t>(r.next());
  c.row = static_cast<uint32_t>(r.below(1 << 20));
  // tree: padding, chains, bushes; tokens often the parent's favourites
  c.parents.assign(static_cast<size_t>(c.T), -1);
  c.tokens.assign(static_cast<size_t>(c.T), -1);
  c.tokens[0] = r.below(c.V);
  const float pad = r.coin(0.2f) ? 1.f : 0.2f;  // sometimes a padding-only tree
  std::vector<int64_t> real{0};
  for (int64_t i = 1; i < c.T; ++i) {
    if (r.coin(pad)) continue;
    c.parents[i] = r.coin(0.5f) ? real.back() : real[r.below(static_cast<int64_t>(real.size()))];
    c.tokens[i] = r.below(c.V);
    real.push_back(i);
  }
  return c;
}

void test_verify_random() {
  Rng r{1};
  for (int n = 0; n < 600; ++n) {
    const VerifyCase c = random_verify_case(r);
    const auto st = run_both(c);
    CHECK(st.error == lantern::cpu::VerifyError::kOk);
  }
}

// The vocabulary passes split into chunks (as the op binding does when a batch has fewer rows than threads)
// give the same outputs as one pass, whatever the partition: here uneven pieces run in reverse order.
template <class Real>
void test_verify_split_vocabulary() {
  const lantern::cpu::ParallelChunks reversed = [](int64_t n, int64_t grain,
                                                   const std::function<void(int64_t, int64_t)>& body) {
    std::vector<std::pair<int64_t, int64_t>> pieces;
    for (int64_t lo = 0, i = 0; lo < n; ++i) {
      const int64_t hi = std::min(n, lo + (i % 2 ? grain / 2 + 1 : 2 * grain));
      pieces.emplace_back(lo, hi);
      lo = hi;
    }
    for (auto it = pieces.rbegin(); it != pieces.rend(); ++it) body(it->first, it->second);
  };
  Rng r{7};
  for (int n = 0; n < 24; ++n) {
    const VerifyCase c = random_verify_case(r, n % 3 == 0 ? 8192 : (n % 3 == 1 ? 9001 : 16384));
    std::vector<int64_t> whole, split;
    const auto a = run_verify<Real>(c, nullptr, nullptr, &whole);
    const auto b = run_verify<Real>(c, nullptr, &reversed, &split);
    CHECK(a.error == b.error && a.where == b.where);
    CHECK(whole == split);
  }
}

void test_verify_edges() {
  // V = 1, T = 1: the only token, nothing to test
  VerifyCase c;
  c.logits = {0.f};
  c.tokens = {0};
  c.parents = {-1};
  int64_t next = -1;
  CHECK(run_verify<float>(c, &next).error == lantern::cpu::VerifyError::kOk && next == 0);
  // zero-mass residual with sampled drafts: q' = P = uniform over 4 tokens, x has P(x) = q'(x) = 0
  c = VerifyCase{};
  c.T = 2;
  c.V = 6;
  c.logits = {0, 0, 0, 0, -kInf, -kInf, 0, 0, 0, 0, -kInf, -kInf};
  c.draft = {0.25f, 0.25f, 0.25f, 0.25f, 0, 0, 0.25f, 0.25f, 0.25f, 0.25f, 0, 0};
  c.tokens = {0, 5};
  c.parents = {-1, 0};
  for (uint32_t row = 0; row < 50; ++row) {
    c.row = row;
    CHECK(run_verify<float>(c, &next).error == lantern::cpu::VerifyError::kOk && next < 4);
  }
  // every logit -inf (the reference gives NaN): still a valid token and no out-of-bounds access
  c = VerifyCase{};
  c.T = 3;
  c.V = 5;
  c.logits.assign(15, -kInf);
  c.tokens = {0, 1, 2};
  c.parents = {-1, 0, 1};
  c.K = 2;
  c.k = 2;
  c.nbrs = ring_neighbours(5, 2);
  run_both(c);
  c.temperature = 0.f;
  run_both(c);
  // k = 0 with no table but K > 0 (what the op binding passes when k = 0): rejections touch no neighbour
  c = VerifyCase{};
  c.T = 4;
  c.V = 7;
  c.K = 5;
  c.logits.assign(28, 0.f);
  c.tokens = {0, 1, 2, 3};
  c.parents = {-1, 0, 0, 0};
  c.delta = 0.5f;
  for (uint32_t row = 0; row < 20; ++row) {
    c.row = row;
    CHECK(run_both(c).error == lantern::cpu::VerifyError::kOk);
  }
}

void test_verify_errors() {
  VerifyCase c;
  c.T = 4;
  c.V = 5;
  c.K = 2;
  c.k = 2;
  c.logits.assign(20, 0.f);
  c.nbrs = ring_neighbours(5, 2);
  c.tokens = {0, 1, 2, 3};
  using E = lantern::cpu::VerifyError;
  c.parents = {0, 0, 0, 0};
  CHECK(run_both(c).error == E::kRoot);
  c.parents = {-1, 0, 3, 1};  // forward edge
  CHECK(run_both(c).error == E::kParent);
  c.parents = {-1, 0, 2, 1};  // self loop
  CHECK(run_both(c).error == E::kParent);
  c.parents = {-1, -1, 1, 0};  // child of padding
  CHECK(run_both(c).error == E::kParent);
  c.parents = {-1, -5, 0, 0};
  CHECK(run_both(c).error == E::kParent);
  c.parents = {-1, 0, 0, 1};
  c.tokens = {0, 1, 5, 3};
  CHECK(run_both(c).error == E::kToken);
  c.tokens = {0, 1, -2, 3};
  CHECK(run_both(c).error == E::kToken);
  c.tokens = {0, 1, 2, 3};
  c.nbrs[1 * 2 + 1] = 7;  // token 1's second neighbour
  CHECK(run_both(c).error == E::kNeighbour);
  c.nbrs[1 * 2 + 1] = -1;
  CHECK(run_both(c).error == E::kNeighbour);
  c.temperature = 0.f;
  CHECK(run_both(c).error == E::kNeighbour);
  c.nbrs = ring_neighbours(5, 2);
  c.k = 3;  // k > K
  CHECK(run_both(c).error == E::kNeighbour);
  c.k = 2;
  c.nbrs.clear();  // no table
  CHECK(run_both(c).error == E::kNeighbour);
}

void test_selection() {
  lantern::cpu::SelectScratch<float> s;
  const float x[] = {1.f, -kInf, 3.f, 3.f, std::nanf(""), -0.f, 0.f, 2.f};
  CHECK(lantern::cpu::kth_largest<float>(x, 8, 1, s) != 0.f);  // NaN sorts above; no crash
  CHECK(lantern::cpu::kth_largest<float>(x + 1, 1, 1, s) == -kInf);
  const float y[] = {5.f, 1.f, 3.f, 3.f, 2.f};
  CHECK(lantern::cpu::kth_largest<float>(y, 5, 2, s) == 3.f && lantern::cpu::kth_largest<float>(y, 5, 3, s) == 3.f);
  CHECK(lantern::cpu::kth_largest<float>(y, 5, 4, s) == 2.f && lantern::cpu::kth_largest<float>(y, 5, 99, s) == 1.f);
  const float pi[] = {0.5f, 0.25f, 0.25f, 0.f};
  const int32_t idx[] = {0, 1, 2, 3};
  CHECK(lantern::cpu::top_p_threshold<float>(pi, idx, 4, 0.5, s) == 0.25f);   // S(0.25) = 0.5 <= 0.5: kept
  CHECK(lantern::cpu::top_p_threshold<float>(pi, idx, 4, 0.49, s) == 0.5f);   // ties dropped together
  CHECK(lantern::cpu::top_p_threshold<float>(pi, idx, 4, 1e-9, s) == 0.5f);
  CHECK(std::isinf(lantern::cpu::top_p_threshold<float>(pi + 3, idx, 1, 0.5, s)));
  lantern::cpu::SelectScratch<double> sd;
  const double z[] = {0.1, 0.7, 0.2};
  CHECK(lantern::cpu::kth_largest<double>(z, 3, 2, sd) == 0.2);
}

void test_conversions() {
  CHECK(lantern::cpu::fp16_to_float(0x3c00) == 1.f && lantern::cpu::fp16_to_float(0x0001) == std::ldexp(1.f, -24));
  CHECK(std::isinf(lantern::cpu::fp16_to_float(0x7c00)) && std::isnan(lantern::cpu::fp16_to_float(0x7e00)));
  for (uint32_t h = 0; h < 0x10000; ++h) {  // every finite half round-trips
    const float f = lantern::cpu::fp16_to_float(static_cast<uint16_t>(h));
    if (std::isfinite(f)) CHECK(lantern::cpu::float_to_fp16(f) == h);
  }
  CHECK(lantern::cpu::float_to_fp16(65520.f) == 0x7c00 && lantern::cpu::float_to_fp16(1e-9f) == 0);
  CHECK(lantern::cpu::bf16_to_float(lantern::cpu::float_to_bf16(1.f)) == 1.f);
  CHECK(lantern::philox_word0(0, 0, 0, 0, 0) == 0x6627e8d5u);
  CHECK(lantern::philox_word0(~0ull, ~0u, ~0u, ~0u, ~0u) == 0x408f276du);
}

// ---- latent_neighbours -------------------------------------------------------------------------------

void check_table(const std::vector<float>& codes, int64_t V, int64_t d, int64_t K) {
  std::vector<float> ct(static_cast<size_t>(V * d));
  lantern::cpu::transpose_codes(codes.data(), V, d, ct.data());
  std::vector<int32_t> out(static_cast<size_t>(V * K) + 1, 777);
  lantern::cpu::NeighbourScratch ws;
  for (int64_t r0 = 0; r0 < V; r0 += lantern::cpu::kNbrRows)
    lantern::cpu::neighbour_rows(codes.data(), ct.data(), V, d, K, r0, std::min(V, r0 + lantern::cpu::kNbrRows),
                                 out.data(), ws);
  CHECK(out[V * K] == 777);
  const bool finite = std::all_of(codes.begin(), codes.end(), [](float v) { return std::isfinite(v); });
  for (int64_t x = 0; x < V; ++x)
    for (int64_t i = 0; i < K; ++i) {
      const int32_t y = out[x * K + i];
      CHECK(y >= -1 && y < V && y != x);
      if (finite) CHECK(y >= 0);
    }
}

void test_neighbours() {
  Rng r{2};
  check_table({0.f, 1.f}, 2, 1, 1);                                         // V = 2
  check_table(std::vector<float>(64 * 3, 1.f), 64, 3, 63);                 // all duplicates, K = V - 1
  std::vector<float> c(4096 * 2);
  for (auto& v : c) v = std::round(r.normal());                            // ties, sampled threshold
  check_table(c, 4096, 2, 1100);
  for (size_t i = 0; i < c.size(); i += 8) c[i] = 0.5f;                    // fallback rows
  check_table(c, 4096, 2, 1100);
  std::vector<float> bad(300 * 4);
  for (auto& v : bad) v = r.coin(0.1f) ? kInf : (r.coin(0.1f) ? std::nanf("") : r.normal() * 1e30f);
  check_table(bad, 300, 4, 50);                                            // non-finite codes (direct calls)
  check_table(bad, 300, 4, 299);
}

// ---- tree attention ----------------------------------------------------------------------------------

void attention_case(Rng& r, int64_t B, int64_t H, int64_t Hkv, int64_t T, int64_t Dh, int64_t Lmax, DType dt,
                    float scale) {
  const int64_t W = (T + 31) / 32;
  std::vector<float> q(static_cast<size_t>(B * H * T * Dh)), k(static_cast<size_t>(B * Hkv * Lmax * Dh)), v(k.size());
  for (auto& x : q) x = r.normal() * scale;
  for (auto& x : k) x = r.normal() * scale;
  for (auto& x : v) x = r.normal();
  std::vector<int64_t> len(static_cast<size_t>(B));
  for (auto& l : len) l = r.below(Lmax - T + 1);
  for (int64_t b = 0; b < B; ++b)  // never read: NaN past cache_len + T
    for (int64_t g = 0; g < Hkv; ++g)
      for (int64_t p = len[b] + T; p < Lmax; ++p)
        for (int64_t d = 0; d < Dh; ++d)
          k[((b * Hkv + g) * Lmax + p) * Dh + d] = v[((b * Hkv + g) * Lmax + p) * Dh + d] = std::nanf("");
  std::vector<int32_t> mask(static_cast<size_t>(B * T * W));
  for (auto& m : mask) m = static_cast<int32_t>(r.next());  // any bits, stray ones past T included
  const auto qe = encode(q, dt), ke = encode(k, dt), ve = encode(v, dt);
  std::vector<unsigned char> o = encode(std::vector<float>(q.size() + 1, 0.f), dt);
  lantern::cpu::AttnProblem p{qe.data(),   ke.data(), ve.data(),
                              o.data(),    dt,        H * T * Dh,
                              T * Dh,      Dh,        Hkv * Lmax * Dh,
                              Lmax * Dh,   Dh,        Hkv * Lmax * Dh,
                              Lmax * Dh,   Dh,        len.data(),
                              mask.data(), B,         H,
                              Hkv,         T,         Dh,
                              Lmax,        W};
  lantern::cpu::AttnScratch ws;
  ws.resize(Dh);
  const int64_t items = B * Hkv * lantern::cpu::attn_blocks_per_head(p);
  for (int64_t i = 0; i < items; ++i) lantern::cpu::attend_item(p, i, ws);
  // outputs are finite wherever a query attends to something finite (its own key is set half the time)
  if (dt == DType::kFloat32 && scale < 10.f) {
    const float* of = reinterpret_cast<const float*>(o.data());
    for (int64_t b = 0; b < B; ++b)
      for (int64_t h = 0; h < H; ++h)
        for (int64_t t = 0; t < T; ++t) {
          const bool own = (static_cast<uint32_t>(mask[(b * T + t) * W + t / 32]) >> (t % 32)) & 1u;
          if (len[b] > 0 || own)
            for (int64_t d = 0; d < Dh; ++d) CHECK(std::isfinite(of[((b * H + h) * T + t) * Dh + d]));
        }
  }
}

void test_attention() {
  Rng r{3};
  attention_case(r, 1, 1, 1, 1, 1, 1, DType::kFloat32, 1.f);      // T = 1, Dh = 1, no prefix
  attention_case(r, 2, 4, 2, 33, 64, 200, DType::kFloat32, 1.f);  // two mask words, GQA, fixed Dh
  attention_case(r, 2, 3, 1, 70, 128, 140, DType::kFloat32, 1.f); // two tree tiles, MQA, Dh = 128
  attention_case(r, 1, 2, 2, 5, 7, 80, DType::kBFloat16, 1.f);
  attention_case(r, 1, 2, 2, 5, 7, 80, DType::kFloat16, 1.f);
  attention_case(r, 1, 2, 1, 9, 16, 90, DType::kFloat64, 1.f);
  attention_case(r, 1, 2, 2, 4, 8, 40, DType::kFloat32, 1e20f);   // scores overflow to inf
  attention_case(r, 3, 4, 4, 1, 64, 100, DType::kBFloat16, 1.f);  // the few-row path: an AR step
  attention_case(r, 2, 4, 4, 3, 64, 90, DType::kBFloat16, 1.f);   // a chain of 2
  attention_case(r, 2, 4, 2, 2, 64, 130, DType::kFloat32, 1.f);   // 4 rows an item (GQA), read in place
}

// The few-row scores: 16 keys at a time through the shuffle butterfly (where the compiler has it) against
// one key at a time, any key count (partial blocks of 16) and rows per item, keys at a stride.
void test_attention_butterfly() {
  Rng r{11};
  constexpr int64_t kKeys = 70, kStride = 80, kDh = 64;
  std::vector<float> k(kKeys * kStride), q(4 * kDh), a(kKeys * 4), b(kKeys * 4);
  for (auto& x : k) x = r.normal();
  for (auto& x : q) x = r.normal();
  for (int64_t M = 1; M <= 4; ++M)
    for (int64_t n = 1; n <= kKeys; ++n) {
      lantern::cpu::attn_scores_dot16_nv<4>(k.data(), kStride, n, q.data(), M, a.data());
      lantern::cpu::attn_scores_dot_nv<4>(k.data(), kStride, n, q.data(), M, b.data());
      for (int64_t i = 0; i < n * M; ++i) CHECK(std::fabs(a[i] - b[i]) <= 1e-5f * (1.f + std::fabs(b[i])));
    }
}

void test_compact_kv_rows() {
  const int64_t path[] = {0, 2, -1, 9};
  using E = lantern::CompactKVError;
  CHECK(lantern::compact_kv_check_row(2, 3, path, 4, 10).error == E::kOk);
  CHECK(lantern::compact_kv_check_row(3, 3, path, 4, 10).error == E::kPadding);
  CHECK(lantern::compact_kv_check_row(5, 0, path, 4, 10).error == E::kNKeep);
  CHECK(lantern::compact_kv_check_row(2, 9, path, 4, 10).error == E::kCacheLen);
  CHECK(lantern::compact_kv_check_row(4, 1, path + 1, 3, 10).error == E::kNKeep);
}

}  // namespace

int main() {
  test_conversions();
  test_selection();
  test_verify_edges();
  test_verify_errors();
  test_verify_random();
  test_verify_split_vocabulary<float>();
  test_verify_split_vocabulary<double>();
  test_neighbours();
  test_attention();
  test_attention_butterfly();
  test_compact_kv_rows();
  std::printf("sanitize_main: OK\n");
  return 0;
}
