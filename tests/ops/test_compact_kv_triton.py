"""The Triton kernel of compact_kv (lantern_kernels/compact_kv.py) against the reference (SPEC §6): every
layer in one launch, in place, bit-exact for every dtype (a copy). Without a GPU it runs under Triton's
interpreter on CPU tensors (tests/conftest.py sets TRITON_INTERPRET=1); the GPT-XL-shape test is gpu-marked."""
from __future__ import annotations

import random

import pytest
import torch

import lantern
from lantern import _backend
from lantern.ops import fused_triton
from lantern.ops.reference.compact_kv import compact_kv as reference_compact_kv

pytest.importorskip("triton")
if not (torch.cuda.is_available() or fused_triton.interpreting()):
    pytest.skip("the triton backend needs a GPU or TRITON_INTERPRET=1", allow_module_level=True)

from lantern_kernels import compact_kv as triton_module  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def triton_compact(cache, cache_len, path_nodes, n_keep):
    with lantern.fused("triton"):
        return lantern.ops.compact_kv(cache, cache_len, path_nodes, n_keep)


def random_case(rng: random.Random, lead, B, Hkv, Lmax, Dh, P, dtype, any_order=False):
    """A random cache; per row a cache_len, a tree of T nodes that fits, and a kept list of n_keep <= P nodes:
    root first then increasing ids (a tree walk), or with ``any_order`` arbitrary, repeated nodes; -1 after."""
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    cache = torch.randn(*lead, B, Hkv, Lmax, Dh, generator=g).to(dtype)
    cache_len, path_nodes, n_keep = [], [], []
    for _ in range(B):
        T = rng.randint(1, Lmax)
        keep = rng.randint(0, min(P, T))
        if any_order:
            nodes = [rng.randrange(T) for _ in range(keep)]
        else:
            nodes = [0] + sorted(rng.sample(range(1, T), keep - 1)) if keep else []
        cache_len.append(rng.randint(0, Lmax - T))
        n_keep.append(keep)
        path_nodes.append(nodes + [-1] * (P - keep))
    as_long = lambda x: torch.tensor(x, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return cache.to(DEVICE), as_long(cache_len), as_long(path_nodes).reshape(B, P), as_long(n_keep)


def check_against_reference(cache, cache_len, path_nodes, n_keep):
    want = cache.clone()
    want_len = reference_compact_kv(want, cache_len, path_nodes, n_keep)
    storage = cache.data_ptr()
    got_len = triton_compact(cache, cache_len, path_nodes, n_keep)
    assert cache.data_ptr() == storage  # in place
    assert torch.equal(cache, want)  # bit-exact, every layer, K and V
    assert got_len.dtype == torch.int64 and torch.equal(got_len, want_len)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("lead", [(), (2,), (3, 2)], ids=["none", "kv", "layers-kv"])
def test_matches_reference(lead, dtype):
    rng = random.Random(f"{lead}{dtype}")
    for P, Lmax in [(1, 6), (4, 12), (9, 11)]:
        for any_order in (False, True):
            B, Hkv, Dh = rng.randint(1, 3), rng.randint(1, 3), rng.choice([1, 3, 8, 20])
            check_against_reference(*random_case(rng, lead, B, Hkv, Lmax, Dh, P, dtype, any_order))


def test_wide_rows_and_paths():
    """Dh = 160 (two column chunks when P is wide), P = 70 (the kept block spans many slots)."""
    rng = random.Random(1)
    check_against_reference(*random_case(rng, (2,), 2, 2, 90, 160, 70, torch.float32))


def test_reads_every_source_before_writing():
    cache = torch.arange(8.0, device=DEVICE).view(1, 1, 8, 1)  # value = position
    new_len = triton_compact(cache, torch.tensor([1], device=DEVICE), torch.tensor([[3, 2, 1, 0]], device=DEVICE),
                             torch.tensor([4], device=DEVICE))
    assert new_len.tolist() == [5]
    assert cache.flatten().tolist() == [0, 4, 3, 2, 1, 5, 6, 7]


def test_pinned_case_and_strided_path():
    cache = torch.arange(8.0, device=DEVICE).repeat(2, 1).view(2, 1, 8, 1)
    path = torch.tensor([[0, 0], [2, 1], [5, -1]], device=DEVICE).t()  # [B=2, P=3], not contiguous
    new_len = triton_compact(cache, torch.tensor([2, 0], device=DEVICE), path, torch.tensor([3, 1], device=DEVICE))
    assert new_len.tolist() == [5, 1]
    assert cache[0, 0, :, 0].tolist() == [0, 1, 2, 4, 7, 5, 6, 7]
    assert cache[1, 0, :, 0].tolist() == list(range(8))


def test_nothing_kept_returns_the_lengths():
    rng = random.Random(2)
    cache, cache_len, path_nodes, _ = random_case(rng, (2,), 3, 2, 10, 4, 3, torch.float32)
    before = cache.clone()
    got = triton_compact(cache, cache_len, path_nodes, torch.zeros_like(cache_len))
    assert torch.equal(got, cache_len) and got.data_ptr() != cache_len.data_ptr() and torch.equal(cache, before)


def _bad_cases():
    cache = torch.zeros(2, 2, 1, 8, 4)  # [K/V, B, Hkv, Lmax, Dh]
    ok = dict(cache=cache, cache_len=torch.tensor([2, 3]), path_nodes=torch.tensor([[0, 1, 3], [0, 2, -1]]),
              n_keep=torch.tensor([3, 2]))
    yield "cache", dict(ok, cache=torch.zeros(2, 8, 4))
    yield "cache", dict(ok, cache=torch.zeros(2, 2, 1, 4, 8).transpose(-1, -2))
    yield "cache_len", dict(ok, cache_len=torch.tensor([2, 3], dtype=torch.int32))
    yield "cache_len", dict(ok, cache_len=torch.tensor([-1, 3]))
    yield "n_keep", dict(ok, n_keep=torch.tensor([4, 2]))
    yield "path_nodes", dict(ok, n_keep=torch.tensor([3, 3]))  # a kept entry is -1
    yield "path_nodes", dict(ok, path_nodes=torch.tensor([[0, 1, 6], [0, 2, -1]]))  # source 2 + 6 >= Lmax


@pytest.mark.parametrize("name,kwargs", list(_bad_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_input_raises_naming_the_argument(name, kwargs):
    kwargs = {key: value.to(DEVICE) for key, value in kwargs.items()}
    before = kwargs["cache"].clone()
    with pytest.raises((ValueError, TypeError), match=f"^{name} "):
        triton_compact(**kwargs)
    assert torch.equal(kwargs["cache"], before)  # rejected before anything moves


def test_routes_to_the_triton_kernel():
    with lantern.fused("triton"):
        assert _backend.resolve("compact_kv", torch.device(DEVICE)) is triton_module.compact_kv


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_gpt_xl_cache(dtype):
    """GPT-XL's cache: 36 layers x K/V, B = 2 (with CFG: 4 rows), 20 kv heads, Lmax = 256 + 1 + 65, Dh = 64."""
    rng = random.Random(3)
    check_against_reference(*random_case(rng, (36, 2), 4, 20, 322, 64, 8, dtype))
