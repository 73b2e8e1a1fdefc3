"""tree_attention (SPEC §6) against per-query float64 attention over an explicitly walked key set, and
against causal attention / plain decoding for chains and single nodes."""
import math
import random

import pytest
import torch
import torch.nn.functional as F

import lantern
from tree_cases import random_parents

BACKENDS = ["reference", "cpu", "triton"]  # fused backends join this list once they implement tree_attention


@pytest.fixture(params=BACKENDS)
def backend(request):
    with lantern.fused(request.param):
        yield request.param


def make_inputs(B, H, Hkv, T, Dh, cache_len, Lmax, seed, dtype=torch.float32, garbage=float("nan")):
    """q [B, H, T, Dh], caches [B, Hkv, Lmax, Dh] with `garbage` past each row's cache_len + T."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, T, Dh, generator=g).to(dtype)
    k_cache = torch.randn(B, Hkv, Lmax, Dh, generator=g)
    v_cache = torch.randn(B, Hkv, Lmax, Dh, generator=g)
    cache_len = torch.tensor(cache_len, dtype=torch.int64)
    for b in range(B):
        k_cache[b, :, int(cache_len[b]) + T:] = garbage
        v_cache[b, :, int(cache_len[b]) + T:] = garbage
    return q, k_cache.to(dtype), v_cache.to(dtype), cache_len


def brute_force(q, k_cache, v_cache, cache_len, parents):
    """Per (row, head, query): keys = the prefix + the query's tree ancestors found by walking parents;
    softmax attention in float64."""
    B, H, T, Dh = q.shape
    group = H // k_cache.shape[1]
    out = torch.zeros(B, H, T, Dh, dtype=torch.float64)
    for b in range(B):
        L = int(cache_len[b])
        for i in range(T):
            nodes, j = [i], int(parents[b, i])
            while j >= 0:
                nodes.append(j)
                j = int(parents[b, j])
            positions = list(range(L)) + [L + n for n in nodes]
            for h in range(H):
                keys = k_cache[b, h // group, positions].double()  # [n, Dh]
                vals = v_cache[b, h // group, positions].double()
                w = torch.softmax(keys @ q[b, h, i].double() / math.sqrt(Dh), dim=0)
                out[b, h, i] = w @ vals
    return out


def run(q, k_cache, v_cache, cache_len, parents):
    return lantern.ops.tree_attention(q, k_cache, v_cache, cache_len, lantern.ops.ancestor_mask(parents))


@pytest.mark.parametrize("B,H,Hkv,T,Dh,cache_len,Lmax,pad", [
    (1, 2, 2, 5, 8, [3], 10, 0.0),
    (2, 4, 2, 12, 16, [0, 7], 24, 0.2),  # empty prefix in row 0
    (3, 4, 1, 40, 8, [5, 0, 11], 60, 0.3),  # two mask words, multi-query (Hkv = 1)
    (2, 6, 3, 33, 4, [1, 2], 35, 0.0),  # cache exactly full in row 1
])
def test_random_trees_match_brute_force(backend, B, H, Hkv, T, Dh, cache_len, Lmax, pad):
    q, k_cache, v_cache, cache_len = make_inputs(B, H, Hkv, T, Dh, cache_len, Lmax, seed=T)
    parents = random_parents(random.Random(T), B, T, pad)
    got = run(q, k_cache, v_cache, cache_len, parents)
    assert got.dtype == q.dtype and got.shape == q.shape
    torch.testing.assert_close(got.double(), brute_force(q, k_cache, v_cache, cache_len, parents),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("Hkv", [1, 2, 4])
def test_chain_equals_causal_attention(backend, Hkv):
    B, H, T, Dh, L = 2, 4, 9, 16, 6
    q, k_cache, v_cache, cache_len = make_inputs(B, H, Hkv, T, Dh, [L, L], L + T + 3, seed=Hkv, garbage=0.0)
    chain = torch.arange(-1, T - 1).expand(B, T)
    got = run(q, k_cache, v_cache, cache_len, chain)
    keys = k_cache[:, :, :L + T].repeat_interleave(H // Hkv, dim=1)
    vals = v_cache[:, :, :L + T].repeat_interleave(H // Hkv, dim=1)
    causal = torch.arange(L + T)[None, :] <= L + torch.arange(T)[:, None]  # [T, L + T]
    expected = F.scaled_dot_product_attention(q, keys, vals, attn_mask=causal)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_single_node_equals_plain_decoding(backend):
    B, H, Hkv, Dh = 3, 8, 2, 32
    q, k_cache, v_cache, cache_len = make_inputs(B, H, Hkv, 1, Dh, [4, 9, 0], 16, seed=1)
    got = run(q, k_cache, v_cache, cache_len, torch.full((B, 1), -1))
    for b in range(B):
        n = int(cache_len[b]) + 1  # the prefix and the node itself
        keys = k_cache[b:b + 1, :, :n].repeat_interleave(H // Hkv, dim=1)
        vals = v_cache[b:b + 1, :, :n].repeat_interleave(H // Hkv, dim=1)
        expected = F.scaled_dot_product_attention(q[b:b + 1], keys, vals)
        torch.testing.assert_close(got[b:b + 1], expected, rtol=1e-5, atol=1e-5)


def test_padding_nodes_attend_to_prefix_and_themselves(backend):
    q, k_cache, v_cache, cache_len = make_inputs(1, 2, 2, 4, 8, [3], 8, seed=2)
    parents = torch.tensor([[-1, 0, -1, 1]])
    got = run(q, k_cache, v_cache, cache_len, parents)
    torch.testing.assert_close(got.double(), brute_force(q, k_cache, v_cache, cache_len, parents),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_give_output_in_their_dtype(backend, dtype):
    q, k_cache, v_cache, cache_len = make_inputs(2, 4, 2, 10, 16, [5, 2], 20, seed=3, dtype=dtype)
    parents = random_parents(random.Random(3), 2, 10, 0.1)
    got = run(q, k_cache, v_cache, cache_len, parents)
    assert got.dtype == dtype
    expected = brute_force(q, k_cache, v_cache, cache_len, parents)
    torch.testing.assert_close(got.double(), expected, rtol=2e-2, atol=2e-2)


# --- bad input -----------------------------------------------------------------------------------

def _good_args(T=3):
    q, k_cache, v_cache, cache_len = make_inputs(2, 4, 2, T, 8, [2, 3], 8, seed=0)
    parents = torch.arange(-1, T - 1).expand(2, T)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, cache_len=cache_len,
                tree_mask=lantern.ops.ancestor_mask(parents))


def _bad_cases():
    good = _good_args()
    no_self = good["tree_mask"].clone()
    no_self[0, 1, 0] = 0b01  # node 1 without its own bit
    past_tree = good["tree_mask"].clone()
    past_tree[1, 2, 0] |= 0b1000  # bit for node 3 of a 3-node tree
    strided_q = torch.randn(2, 4, 3, 16)[..., ::2]
    return [
        (dict(q=good["q"].numpy()), TypeError, "q"),
        (dict(q=good["q"][0]), ValueError, "q"),
        (dict(q=good["q"].long()), TypeError, "q"),
        (dict(q=good["q"][:, :, :0]), ValueError, "q"),
        (dict(q=strided_q), ValueError, "q"),
        (dict(k_cache=good["k_cache"].double()), TypeError, "k_cache"),
        (dict(k_cache=good["k_cache"][:1]), ValueError, "k_cache"),
        (dict(k_cache=good["k_cache"][..., :4]), ValueError, "k_cache"),
        (dict(k_cache=torch.randn(2, 3, 8, 8), v_cache=torch.randn(2, 3, 8, 8)), ValueError, "k_cache"),
        (dict(v_cache=good["v_cache"][:, :, :7]), ValueError, "v_cache"),
        (dict(v_cache=good["v_cache"].half()), TypeError, "v_cache"),
        (dict(cache_len=good["cache_len"].int()), TypeError, "cache_len"),
        (dict(cache_len=torch.tensor([2])), ValueError, "cache_len"),
        (dict(cache_len=torch.tensor([2, 6])), ValueError, "cache_len"),  # 6 + 3 > Lmax = 8
        (dict(cache_len=torch.tensor([-1, 0])), ValueError, "cache_len"),
        (dict(tree_mask=good["tree_mask"].long()), TypeError, "tree_mask"),
        (dict(tree_mask=good["tree_mask"][:, :2]), ValueError, "tree_mask"),
        (dict(tree_mask=torch.zeros(2, 3, 2, dtype=torch.int32)), ValueError, "tree_mask"),
        (dict(tree_mask=no_self), ValueError, "tree_mask"),
        (dict(tree_mask=past_tree), ValueError, "tree_mask"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_cases())))
def test_bad_input(backend, case):
    change, exc, name = _bad_cases()[case]
    args = {**_good_args(), **change}
    with pytest.raises(exc, match=name):
        lantern.ops.tree_attention(**args)
