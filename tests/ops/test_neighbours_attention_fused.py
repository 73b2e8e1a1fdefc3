"""The CPU kernels of latent_neighbours (csrc/cpu/latent_neighbours.cpp) and tree_attention
(csrc/cpu/tree_attention.cpp) against the references, on shapes the generic tests do not reach: the sampled
threshold and its fallback (V >= 4096), several key / query / tree tiles, Dh with and without a fixed-size
path, GQA, strided caches, every dtype; plus opcheck and torch.compile."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import lantern
from lantern import ops
from lantern.ops.reference.tree_attention import tree_attention as reference_attention
from neighbour_check import exact_table

pytest.importorskip("lantern._C", reason="lantern._C is not built (pip install --no-build-isolation -e .)")
from lantern.ops import fused_cpu  # noqa: E402,F401


# ---- latent_neighbours -------------------------------------------------------------------------------

def cpu_table(codebook, K, normalize):
    with lantern.fused("cpu"):
        return ops.latent_neighbours(codebook, K, normalize=normalize).numpy()


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("V,d,K", [(4096, 8, 1000), (4096, 3, 64), (5000, 8, 1), (300, 8, 299)])
def test_neighbours_equal_exact_order(V, d, K, normalize):
    codebook = torch.randn(V, d, generator=torch.Generator().manual_seed(V + K))
    np.testing.assert_array_equal(cpu_table(codebook, K, normalize), exact_table(codebook, K, normalize))


def test_neighbours_ties_at_scale():
    """Integer codes: exact distances, ties everywhere (the sampled threshold sits inside a tie group)."""
    codebook = torch.randint(-2, 3, (4096, 4), generator=torch.Generator().manual_seed(1)).float()
    np.testing.assert_array_equal(cpu_table(codebook, 700, False), exact_table(codebook, 700, False))


def test_neighbours_fallback_when_the_sample_misleads():
    """Every 4th code (the sampled ones at V = 4096) sits at one point: the sampled threshold admits only
    those 1024 codes, fewer than K = 1100, so the kernel must redo those rows without it."""
    g = torch.Generator().manual_seed(2)
    codebook = torch.randn(4096, 8, generator=g) * 10
    codebook[::4] = 0.5
    np.testing.assert_array_equal(cpu_table(codebook, 1100, False), exact_table(codebook, 1100, False))


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_neighbours_other_dtypes_equal_reference(dtype):
    codebook = torch.randn(600, 8, generator=torch.Generator().manual_seed(3)).to(dtype)
    want = ops.latent_neighbours(codebook, 40, normalize=True)
    with lantern.fused("cpu"):
        assert torch.equal(ops.latent_neighbours(codebook, 40, normalize=True), want)


def test_neighbours_bad_k_through_op():
    with pytest.raises(ValueError, match="K must be"):
        torch.ops.lantern.latent_neighbours(torch.randn(5, 2), 5, False)


# ---- tree_attention ----------------------------------------------------------------------------------

def random_parents(T, g):
    parents = [-1]
    for i in range(1, T):
        parents.append(int(torch.randint(0, i, (1,), generator=g)) if torch.rand(1, generator=g) < 0.8 else -1)
    # padding nodes must not be parents
    for i in range(1, T):
        if parents[i] >= 1 and parents[parents[i]] == -1:
            parents[i] = 0
    return parents


def attention_case(B, H, Hkv, T, Dh, cache_len, Lmax, dtype, seed, layout="contiguous"):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=g).to(dtype)
    if layout == "contiguous":
        k = torch.randn(B, Hkv, Lmax, Dh, generator=g)
        v = torch.randn(B, Hkv, Lmax, Dh, generator=g)
    else:  # [B, Lmax, Hkv, Dh] storage viewed as [B, Hkv, Lmax, Dh]
        k = torch.randn(B, Lmax, Hkv, Dh, generator=g).transpose(1, 2)
        v = torch.randn(B, Lmax, Hkv, Dh, generator=g).transpose(1, 2)
    cache_len = torch.tensor(cache_len, dtype=torch.int64)
    for b in range(B):  # never read: garbage past cache_len + T
        k[b, :, int(cache_len[b]) + T:] = float("nan")
        v[b, :, int(cache_len[b]) + T:] = float("nan")
    parents = torch.tensor([random_parents(T, g) for _ in range(B)])
    return q, k.to(dtype), v.to(dtype), cache_len, ops.ancestor_mask(parents)


CASES = [
    # B, H, Hkv, T, Dh, cache_len, Lmax
    (2, 16, 16, 64, 64, [1024, 300], 1100),  # the benchmark shape, ragged prefixes
    (1, 8, 2, 70, 128, [65], 200),            # 3 tree words, 2 tree tiles, Dh = 128 path, GQA 4
    (3, 6, 3, 5, 80, [0, 7, 130], 140),       # Dh = 80 (generic path), empty prefix
    (2, 4, 1, 33, 16, [64, 63], 100),         # MQA: 4 heads x 33 queries = 132 rows (3 row blocks)
    (2, 2, 2, 1, 64, [9, 200], 201),          # T = 1 (decoding)
]


@pytest.mark.parametrize("layout", ["contiguous", "strided"])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}H{c[1]}kv{c[2]}T{c[3]}Dh{c[4]}" for c in CASES])
def test_attention_matches_reference(case, layout):
    q, k, v, cache_len, mask = attention_case(*case, dtype=torch.float32, seed=sum(case[:5]), layout=layout)
    want = reference_attention(q, k, v, cache_len, mask)
    with lantern.fused("cpu"):
        got = ops.tree_attention(q, k, v, cache_len, mask)
    assert got.dtype == q.dtype and got.shape == q.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-5), (torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_attention_dtypes(dtype, tol):
    q, k, v, cache_len, mask = attention_case(2, 4, 2, 9, 32, [20, 3], 40, dtype=dtype, seed=5)
    want = reference_attention(q, k, v, cache_len, mask)
    with lantern.fused("cpu"):
        got = ops.tree_attention(q, k, v, cache_len, mask)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


def test_attention_kernel_rejects_cache_len_past_the_cache():
    q, k, v, cache_len, mask = attention_case(1, 2, 2, 4, 8, [10], 14, dtype=torch.float32, seed=6)
    with pytest.raises(ValueError, match="cache_len"):
        torch.ops.lantern.tree_attention(q, k, v, torch.tensor([11]), mask)
    with pytest.raises(ValueError, match="multiple"):
        torch.ops.lantern.tree_attention(q[:, :1].expand(1, 3, 4, 8).contiguous(), k, v, cache_len, mask)


def test_opcheck_and_compile():
    q, k, v, cache_len, mask = attention_case(2, 4, 2, 9, 16, [20, 3], 40, dtype=torch.float32, seed=7)
    k = torch.nan_to_num(k)
    v = torch.nan_to_num(v)
    torch.library.opcheck(torch.ops.lantern.tree_attention.default, (q, k, v, cache_len, mask))
    codebook = torch.randn(40, 4)
    torch.library.opcheck(torch.ops.lantern.latent_neighbours.default, (codebook, 5, True))

    def step(q, k, v, cache_len, mask, codebook):
        o = torch.ops.lantern.tree_attention(q * 1.0, k, v, cache_len, mask)
        return o.sum(-1), torch.ops.lantern.latent_neighbours(codebook, 5, True) + 0

    torch._dynamo.reset()
    got = torch.compile(step, fullgraph=True)(q, k, v, cache_len, mask, codebook)
    want = step(q, k, v, cache_len, mask, codebook)
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[1], want[1])


def test_public_ops_route_to_cpu():
    with lantern.fused("auto"):
        for name in ("verify", "latent_neighbours", "tree_attention", "compact_kv", "philox_uniform"):
            assert lantern._backend.resolve(name, torch.device("cpu")) is getattr(fused_cpu, name), name
    assert lantern.fused_ops("cpu")["tree_attention"] and lantern.fused_ops("cpu")["latent_neighbours"]
