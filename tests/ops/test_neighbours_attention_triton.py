"""The Triton kernels of latent_neighbours (lantern_kernels/latent_neighbours.py) and tree_attention
(lantern_kernels/tree_attention.py) against the references. Without a GPU they run under Triton's
interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1), so shapes are small; the
LlamaGen-shape tests are marked gpu.

Tolerances. latent_neighbours: bit-exact (same float32 arithmetic as the reference, no FMA), so tables are
compared with torch.equal. tree_attention, against the float32 reference: float32 / float64 inputs
rtol = atol = 2e-5 (IEEE float32 dots, online softmax: ~1e-6 observed); float16 2e-3 and bfloat16 2e-2
(about one ulp of the output plus P rounded to the input dtype before P @ V)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

import lantern
from lantern import _backend, ops
from lantern.ops import fused_triton
from lantern.ops.reference.latent_neighbours import latent_neighbours as reference_neighbours
from lantern.ops.reference.tree_attention import tree_attention as reference_attention
from neighbour_check import assert_neighbours_valid
from tree_cases import random_parents

pytest.importorskip("triton")
if not (torch.cuda.is_available() or fused_triton.interpreting()):
    pytest.skip("the triton backend needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from lantern_kernels import latent_neighbours as triton_neighbours_module  # noqa: E402
from lantern_kernels import tree_attention as triton_attention_module  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_neighbours(codebook, K, normalize=False):
    with lantern.fused("triton"):
        return ops.latent_neighbours(codebook, K, normalize=normalize)


def triton_attention(q, k, v, cache_len, mask):
    with lantern.fused("triton"):
        return ops.tree_attention(q, k, v, cache_len, mask)


# ---- latent_neighbours -------------------------------------------------------------------------------

def gaussian_codebook(V, d, seed, dtype=torch.float32):
    return torch.randn(V, d, generator=torch.Generator().manual_seed(seed)).to(dtype).to(DEVICE)


def integer_codebook(V, d, seed, spread=2):
    """Small integer coordinates: exact distances, ties everywhere (the K-th distance sits in a tie group)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-spread, spread + 1, (V, d), generator=g).to(torch.float32).to(DEVICE)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("V,d,K", [(2, 1, 1), (50, 8, 49), (300, 8, 20), (257, 3, 64), (70, 5, 33)])
def test_neighbours_equal_reference(V, d, K, normalize):
    """300 codes: several row programs and two column tiles under the interpreter's tiling; K = V - 1;
    K not a power of two (padded lanes in the ordering step)."""
    codebook = gaussian_codebook(V, d, seed=V * d + K)
    got = triton_neighbours(codebook, K, normalize)
    assert got.dtype == torch.int32 and tuple(got.shape) == (V, K) and got.device == codebook.device
    assert torch.equal(got, reference_neighbours(codebook, K, normalize))
    assert_neighbours_valid(codebook.cpu(), K, normalize, got.cpu())


@pytest.mark.parametrize("V,d,K,spread", [(200, 2, 30, 2), (120, 8, 119, 1), (64, 1, 10, 3), (90, 3, 45, 0)])
def test_neighbours_ties_go_to_lower_index(V, d, K, spread):
    """spread 0: every code is the same point, all distances 0, the table is plain index order."""
    codebook = integer_codebook(V, d, seed=V + d, spread=spread)
    assert torch.equal(triton_neighbours(codebook, K), reference_neighbours(codebook, K, False))


def test_neighbours_duplicates_and_directions():
    codebook = torch.tensor([[0.0, 0.0], [5.0, 5.0], [0.0, 0.0], [1.0, 0.0], [5.0, 5.0]], device=DEVICE)
    assert triton_neighbours(codebook, 4).tolist() == [[2, 3, 1, 4], [4, 3, 0, 2], [0, 3, 1, 4], [0, 2, 1, 4],
                                                       [1, 3, 0, 2]]
    directions = torch.tensor([[1.0, 0.0], [0.8, 0.6], [10.0, 0.0], [0.0, 3.0]], device=DEVICE)
    assert triton_neighbours(directions, 1, normalize=False)[0].tolist() == [1]
    assert triton_neighbours(directions, 1, normalize=True)[0].tolist() == [2]


def test_neighbours_close_codes_far_from_origin():
    """Direct differences keep the digits the ||x||^2 + ||y||^2 - 2 x.y expansion would cancel."""
    codebook = 100.0 + 0.01 * gaussian_codebook(160, 8, seed=10)
    got = triton_neighbours(codebook, 10)
    assert torch.equal(got, reference_neighbours(codebook, 10, False))
    assert_neighbours_valid(codebook.cpu(), 10, False, got.cpu())


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy, on purpose
def test_neighbours_huge_distances_saturate_like_the_reference():
    """Squared distances that overflow float32 to +inf (bits 0x7f800000) are still ranked, by index."""
    codebook = gaussian_codebook(40, 2, seed=11) * 3e19
    assert torch.equal(triton_neighbours(codebook, 12), reference_neighbours(codebook, 12, False))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_neighbours_other_dtypes(dtype):
    codebook = gaussian_codebook(90, 8, seed=5, dtype=dtype)
    for normalize in (False, True):
        assert torch.equal(triton_neighbours(codebook, 16, normalize), reference_neighbours(codebook, 16, normalize))


@pytest.mark.parametrize("codebook,K,exc,name", [
    (torch.randn(5), 2, ValueError, "codebook"),
    (torch.randn(5, 2).to(torch.int64), 2, TypeError, "codebook"),
    (torch.randn(1, 2), 1, ValueError, "codebook"),
    (torch.tensor([[0.0, float("nan")], [1.0, 1.0]]), 1, ValueError, "codebook"),
    (torch.randn(5, 2), 5, ValueError, "K"),
    (torch.randn(5, 2), 0, ValueError, "K"),
    (torch.randn(5, 2), 2.0, TypeError, "K"),
])
def test_neighbours_bad_input(codebook, K, exc, name):
    with pytest.raises(exc, match=f"^{name} "):
        triton_neighbours(codebook.to(DEVICE), K)


# ---- tree_attention ----------------------------------------------------------------------------------

def attention_case(B, H, Hkv, T, Dh, cache_len, Lmax, dtype, seed, layout="contiguous", pad_prob=0.2):
    """q [B, H, T, Dh]; caches [B, Hkv, Lmax, Dh] ('strided': a [B, Lmax, Hkv, Dh] buffer viewed as such)
    holding NaN past each row's cache_len + T (never to be read); a random tree per row with padding."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=g)
    if layout == "contiguous":
        k, v = torch.randn(B, Hkv, Lmax, Dh, generator=g), torch.randn(B, Hkv, Lmax, Dh, generator=g)
    else:
        k = torch.randn(B, Lmax, Hkv, Dh, generator=g).transpose(1, 2)
        v = torch.randn(B, Lmax, Hkv, Dh, generator=g).transpose(1, 2)
    cache_len = torch.tensor(cache_len, dtype=torch.int64)
    for b in range(B):
        k[b, :, int(cache_len[b]) + T:] = float("nan")
        v[b, :, int(cache_len[b]) + T:] = float("nan")
    mask = ops.ancestor_mask(random_parents(random.Random(seed), B, T, pad_prob))
    return tuple(t.to(DEVICE) for t in (q.to(dtype), k.to(dtype), v.to(dtype), cache_len, mask))


CASES = [
    # B, H, Hkv, T, Dh, cache_len, Lmax
    (2, 4, 4, 64, 64, [300, 20], 400),   # ragged prefixes, several prefix tiles, a partial last tile
    (1, 8, 2, 70, 128, [65], 200),       # 3 tree words (bit 31 set: negative int32), 2 tree tiles, GQA 4
    (3, 6, 3, 5, 80, [0, 7, 130], 140),  # Dh = 80 (padded lanes), an empty prefix
    (2, 4, 1, 33, 16, [64, 63], 100),    # MQA: 4 heads x 33 nodes = 132 packed rows (3 row blocks)
    (2, 2, 2, 1, 8, [9, 200], 201),      # T = 1 (decoding), Dh below a dot tile
]
CASE_IDS = [f"B{c[0]}H{c[1]}kv{c[2]}T{c[3]}Dh{c[4]}" for c in CASES]


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_attention_matches_reference(case, layout):
    q, k, v, cache_len, mask = attention_case(*case, dtype=torch.float32, seed=sum(case[:5]), layout=layout)
    got = triton_attention(q, k, v, cache_len, mask)
    assert got.dtype == q.dtype and got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, reference_attention(q, k, v, cache_len, mask), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 2e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
@pytest.mark.parametrize("case", [CASES[1], CASES[2]], ids=[CASE_IDS[1], CASE_IDS[2]])
def test_attention_dtypes(case, dtype, tol):
    q, k, v, cache_len, mask = attention_case(*case, dtype=dtype, seed=5)
    got = triton_attention(q, k, v, cache_len, mask)
    assert got.dtype == dtype
    want = reference_attention(q, k, v, cache_len, mask)
    torch.testing.assert_close(got.double(), want.double(), rtol=tol, atol=tol)


def test_attention_chain_is_causal_attention():
    """A chain tree over an empty prefix is causal self-attention over the T new positions."""
    B, H, T, Dh = 2, 4, 40, 32
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, H, T, Dh, generator=g).to(DEVICE) for _ in range(3))
    chain = torch.arange(-1, T - 1).expand(B, T).to(DEVICE)
    got = triton_attention(q, k, v, torch.zeros(B, dtype=torch.int64, device=DEVICE), ops.ancestor_mask(chain))
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True), rtol=2e-5, atol=2e-5)


def test_attention_bad_input():
    q, k, v, cache_len, mask = attention_case(1, 2, 2, 4, 8, [10], 14, dtype=torch.float32, seed=6)
    with pytest.raises(ValueError, match="^cache_len must"):
        triton_attention(q, k, v, cache_len + 1, mask)
    with pytest.raises(ValueError, match="multiple"):
        triton_attention(q[:, :1].expand(1, 3, 4, 8).contiguous(), k, v, cache_len, mask)
    with pytest.raises(TypeError, match="^k_cache must"):
        triton_attention(q, k.double(), v, cache_len, mask)
    with pytest.raises(ValueError, match="^tree_mask must set bit i"):
        triton_attention(q, k, v, cache_len, torch.zeros_like(mask))  # a node that does not see itself
    with pytest.raises(ValueError, match="^q must have a contiguous last"):
        triton_attention(q.transpose(2, 3).contiguous().transpose(2, 3), k, v, cache_len, mask)


# ---- backend selection ---------------------------------------------------------------------------------

def test_enable_fused_triton_switches_the_public_ops():
    codebook = gaussian_codebook(30, 3, seed=12)
    lantern.enable_fused("triton")
    try:
        assert _backend.active_backend() == "triton"
        assert lantern.fused_ops()["latent_neighbours"] and lantern.fused_ops()["tree_attention"]
        got = ops.latent_neighbours(codebook, 4)
    finally:
        lantern.disable_fused()
    assert _backend.active_backend() == "reference" and not any(lantern.fused_ops().values())
    assert torch.equal(got, reference_neighbours(codebook, 4, False))


def test_triton_backend_routes_its_kernels():
    with lantern.fused("triton"):
        dev = torch.device(DEVICE)
        assert _backend.resolve("latent_neighbours", dev) is triton_neighbours_module.latent_neighbours
        assert _backend.resolve("tree_attention", dev) is triton_attention_module.tree_attention
    fused = lantern.fused_ops("triton")
    assert fused["latent_neighbours"] and fused["tree_attention"] and fused["compact_kv"]


def test_auto_prefers_cuda_then_triton_on_cuda_tensors(monkeypatch):
    """Resolution only (no CUDA tensor is made): a usable cuda kernel wins; without one, triton's runs."""
    _backend._load_backends()  # so the real availability checks are in place before they are replaced
    cuda = torch.device("cuda")
    fake_cuda_kernel = object()
    monkeypatch.setitem(_backend._REGISTRY["cuda"], "tree_attention", fake_cuda_kernel)
    monkeypatch.setitem(_backend._AVAILABILITY, "cuda", lambda: None)
    with lantern.fused("auto"):
        assert _backend.resolve("tree_attention", cuda) is fake_cuda_kernel
        monkeypatch.setitem(_backend._AVAILABILITY, "cuda", lambda: "not built")
        assert _backend.resolve("tree_attention", cuda) is triton_attention_module.tree_attention
        monkeypatch.setitem(_backend._AVAILABILITY, "triton", lambda: "no triton")
        assert _backend.resolve("tree_attention", cuda) is reference_attention
        on_cpu = _backend.resolve("latent_neighbours", torch.device("cpu"))  # auto never picks triton for CPU
        assert on_cpu in (_backend._REGISTRY["cpu"].get("latent_neighbours"), reference_neighbours)


# ---- LlamaGen shapes (GPU only) -----------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [False, True])
def test_gpu_neighbours_llamagen_shape(normalize):
    """V = 16384, d = 8, K = 1000 (LlamaGen's VQ-16 codebook size): the whole table equals the reference."""
    codebook = torch.randn(16384, 8, generator=torch.Generator().manual_seed(0)).cuda()
    got = triton_neighbours(codebook, 1000, normalize)
    assert torch.equal(got, reference_neighbours(codebook, 1000, normalize))
    assert_neighbours_valid(codebook.cpu()[:2048], 100, normalize, triton_neighbours(codebook[:2048], 100,
                                                                                     normalize).cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("L", [256, 1024])
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3), (torch.float32, 2e-5)])
def test_gpu_attention_llamagen_shape(L, dtype, tol):
    """B = 2, H = 16, T = 64, Dh = 64 (the verification forward of a 64-node tree), ragged prefixes."""
    q, k, v, cache_len, mask = attention_case(2, 16, 16, 64, 64, [L, L // 2 + 3], L + 64, dtype=dtype, seed=L)
    got = triton_attention(q, k, v, cache_len, mask)
    torch.testing.assert_close(got.double(), reference_attention(q, k, v, cache_len, mask).double(),
                               rtol=tol, atol=tol)
