"""compact_kv (SPEC §6) against explicit per-position copies from an untouched clone."""
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import lantern

BACKENDS = ["reference", "cpu", "triton"]  # fused backends join this list once they implement compact_kv


@pytest.fixture(params=BACKENDS)
def backend(request):
    with lantern.fused(request.param):
        yield request.param


def brute_force(cache, cache_len, path_nodes, n_keep):
    """Copy position by position, reading every source from the untouched original."""
    original = cache.clone()
    expected = cache.clone()
    for b in range(path_nodes.shape[0]):
        L = int(cache_len[b])
        for i in range(int(n_keep[b])):
            expected[..., b, :, L + i, :] = original[..., b, :, L + int(path_nodes[b, i]), :]
    return expected


def random_case(rng: random.Random, lead, B, Hkv, Lmax, Dh, P, dtype=torch.float32):
    """A cache with distinct values everywhere, and per row: a cache_len, a tree of T nodes that fits,
    a kept path of root + accepted nodes (increasing node ids, as from a tree walk), -1 padded."""
    cache = torch.arange(int(torch.tensor([*lead, B, Hkv, Lmax, Dh]).prod()), dtype=torch.float64)
    cache = cache.reshape(*lead, B, Hkv, Lmax, Dh).to(dtype)
    cache_len, path_nodes, n_keep = [], [], []
    for _ in range(B):
        T = rng.randint(1, Lmax)
        L = rng.randint(0, Lmax - T)
        keep = rng.randint(0, min(P, T))
        nodes = [0] + sorted(rng.sample(range(1, T), keep - 1)) if keep else []
        cache_len.append(L)
        n_keep.append(keep)
        path_nodes.append(nodes + [-1] * (P - keep))
    as_long = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    return cache, as_long(cache_len), as_long(path_nodes).reshape(B, P), as_long(n_keep)


def check(cache, cache_len, path_nodes, n_keep):
    expected = brute_force(cache, cache_len, path_nodes, n_keep)
    storage = cache.data_ptr()
    new_len = lantern.ops.compact_kv(cache, cache_len, path_nodes, n_keep)
    assert cache.data_ptr() == storage  # in place
    assert torch.equal(cache, expected)
    assert new_len.dtype == torch.int64 and torch.equal(new_len, cache_len + n_keep)
    assert new_len.data_ptr() != cache_len.data_ptr()


def test_by_hand(backend):
    cache = torch.arange(10, dtype=torch.float32).reshape(1, 1, 10, 1)  # value = position
    new_len = lantern.ops.compact_kv(cache, torch.tensor([3]), torch.tensor([[0, 2, 5, -1]]), torch.tensor([3]))
    assert cache.flatten().tolist() == [0, 1, 2, 3, 5, 8, 6, 7, 8, 9]
    assert new_len.tolist() == [6]


def test_overlapping_moves_read_sources_first(backend):
    cache = torch.arange(8, dtype=torch.float32).reshape(1, 1, 8, 1)
    lantern.ops.compact_kv(cache, torch.tensor([1]), torch.tensor([[3, 2, 1, 0]]), torch.tensor([4]))
    assert cache.flatten().tolist() == [0, 4, 3, 2, 1, 5, 6, 7]  # reversed: not a sequential copy


@pytest.mark.parametrize("lead", [(), (3,), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_paths_all_layers(backend, lead, dtype):
    rng = random.Random(len(lead))
    check(*random_case(rng, lead, B=4, Hkv=2, Lmax=24, Dh=4, P=6, dtype=dtype))


def test_zero_and_full_keep(backend):
    cache = torch.randn(2, 2, 3, 2, 10, 4)  # [layers, K/V, B, Hkv, Lmax, Dh]
    cache_len = torch.tensor([0, 4, 7])
    path_nodes = torch.tensor([[0, 1, 2], [-1, -1, -1], [0, 2, 1]])
    check(cache, cache_len, path_nodes, torch.tensor([3, 0, 3]))  # row 2 ends exactly at Lmax


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**9), B=st.integers(1, 4), P=st.integers(1, 6), n_lead=st.integers(0, 2))
def test_property_matches_brute_force(seed, B, P, n_lead):
    rng = random.Random(seed)
    lead = tuple(rng.randint(1, 3) for _ in range(n_lead))
    case = random_case(rng, lead, B=B, Hkv=rng.randint(1, 3), Lmax=rng.randint(1, 12), Dh=rng.randint(1, 4), P=P)
    for backend in BACKENDS:
        with lantern.fused(backend):
            check(*[t.clone() for t in case])


# --- bad input -----------------------------------------------------------------------------------

def _good_args():
    return dict(cache=torch.zeros(2, 2, 2, 10, 4), cache_len=torch.tensor([3, 5]),
                path_nodes=torch.tensor([[0, 2, -1], [0, 1, 4]]), n_keep=torch.tensor([2, 3]))


@pytest.mark.parametrize("change,exc,name", [
    (dict(cache=[[0.0]]), TypeError, "cache"),
    (dict(cache=torch.zeros(2, 10, 4)), ValueError, "cache"),
    (dict(cache=torch.zeros(2, 2, 2, 10, 4, dtype=torch.int32)), TypeError, "cache"),
    (dict(cache=torch.zeros(2, 2, 2, 4, 10).transpose(-1, -2)), ValueError, "cache"),
    (dict(cache_len=torch.tensor([3, 5], dtype=torch.int32)), TypeError, "cache_len"),
    (dict(cache_len=torch.tensor([3])), ValueError, "cache_len"),
    (dict(cache_len=torch.tensor([-1, 5])), ValueError, "cache_len"),
    (dict(cache_len=torch.tensor([3, 11])), ValueError, "cache_len"),
    (dict(path_nodes=torch.tensor([0, 2, -1])), ValueError, "path_nodes"),
    (dict(path_nodes=torch.tensor([[0, 2, -1]])), ValueError, "path_nodes"),
    (dict(path_nodes=torch.tensor([[0.0, 2.0], [0.0, 1.0]])), TypeError, "path_nodes"),
    (dict(path_nodes=torch.tensor([[0, -1, -1], [0, 1, 4]])), ValueError, "path_nodes"),  # -1 inside n_keep
    (dict(path_nodes=torch.tensor([[0, 2, -1], [0, 1, 5]])), ValueError, "path_nodes"),  # 5 + 5 >= Lmax
    (dict(path_nodes=torch.tensor([[0, 2, -2], [0, 1, 4]])), ValueError, "path_nodes"),
    (dict(n_keep=torch.tensor([2, 3], dtype=torch.int32)), TypeError, "n_keep"),
    (dict(n_keep=torch.tensor([[2, 3]])), ValueError, "n_keep"),
    (dict(n_keep=torch.tensor([-1, 3])), ValueError, "n_keep"),
    (dict(n_keep=torch.tensor([2, 4])), ValueError, "n_keep"),  # > P
    (dict(cache_len=torch.tensor([3, 8]), path_nodes=torch.tensor([[0, 2, -1], [0, 1, -1]])),
     ValueError, "n_keep"),  # 8 + 3 > Lmax
])
def test_bad_input(backend, change, exc, name):
    args = {**_good_args(), **change}
    with pytest.raises(exc, match=name):
        lantern.ops.compact_kv(**args)
