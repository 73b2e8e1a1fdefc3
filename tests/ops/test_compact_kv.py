"""compact_kv (SPEC §6) on every backend, against explicit per-position copies from an untouched clone and
against the reference: every layer in one call, in place, bit-exact for every dtype (a copy). GPT-XL's
cache runs on a GPU."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
import lantern
from lantern.ops.reference.compact_kv import compact_kv as reference_compact_kv
from op_cases import compact_case


def brute_force(cache, cache_len, path_nodes, n_keep):
    """Copy position by position, reading every source from the untouched original (on the CPU)."""
    cache, cache_len, path_nodes, n_keep = (t.cpu() for t in (cache, cache_len, path_nodes, n_keep))
    original = cache.clone()
    expected = cache.clone()
    for b in range(path_nodes.shape[0]):
        L = int(cache_len[b])
        for i in range(int(n_keep[b])):
            expected[..., b, :, L + i, :] = original[..., b, :, L + int(path_nodes[b, i]), :]
    return expected


def check(cache, cache_len, path_nodes, n_keep):
    expected = brute_force(cache, cache_len, path_nodes, n_keep)
    storage = cache.data_ptr()
    new_len = lantern.ops.compact_kv(cache, cache_len, path_nodes, n_keep)
    assert cache.data_ptr() == storage  # in place
    assert torch.equal(cache.cpu(), expected)
    assert new_len.dtype == torch.int64 and torch.equal(new_len, cache_len + n_keep)
    assert new_len.data_ptr() != cache_len.data_ptr()


def check_against_reference(cache, cache_len, path_nodes, n_keep):
    """The active backend equals the reference bit for bit (every layer, K and V), in place."""
    want = cache.clone()
    want_len = reference_compact_kv(want, cache_len, path_nodes, n_keep)
    storage = cache.data_ptr()
    got_len = lantern.ops.compact_kv(cache, cache_len, path_nodes, n_keep)
    assert cache.data_ptr() == storage
    assert torch.equal(cache, want)
    assert got_len.dtype == torch.int64 and torch.equal(got_len, want_len)


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def test_by_hand(backend, device):
    cache, *args = on(device, torch.arange(10, dtype=torch.float32).reshape(1, 1, 10, 1),  # value = position
                      torch.tensor([3]), torch.tensor([[0, 2, 5, -1]]), torch.tensor([3]))
    new_len = lantern.ops.compact_kv(cache, *args)
    assert cache.flatten().tolist() == [0, 1, 2, 3, 5, 8, 6, 7, 8, 9]
    assert new_len.tolist() == [6]


def test_overlapping_moves_read_sources_first(backend, device):
    cache, *args = on(device, torch.arange(8, dtype=torch.float32).reshape(1, 1, 8, 1), torch.tensor([1]),
                      torch.tensor([[3, 2, 1, 0]]), torch.tensor([4]))
    new_len = lantern.ops.compact_kv(cache, *args)
    assert cache.flatten().tolist() == [0, 4, 3, 2, 1, 5, 6, 7]  # reversed: not a sequential copy
    assert new_len.tolist() == [5]


def test_pinned_case_and_strided_path(backend, device):
    cache = torch.arange(8.0, device=device).repeat(2, 1).view(2, 1, 8, 1)
    path = torch.tensor([[0, 0], [2, 1], [5, -1]], device=device).t()  # [B=2, P=3], not contiguous
    new_len = lantern.ops.compact_kv(cache, torch.tensor([2, 0], device=device), path,
                                     torch.tensor([3, 1], device=device))
    assert new_len.tolist() == [5, 1]
    assert cache[0, 0, :, 0].tolist() == [0, 1, 2, 4, 7, 5, 6, 7]
    assert cache[1, 0, :, 0].tolist() == list(range(8))


@pytest.mark.parametrize("lead", [(), (3,), (4, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_paths_all_layers(backend, device, lead, dtype):
    rng = random.Random(len(lead))
    check(*compact_case(rng, lead, B=4, Hkv=2, Lmax=24, Dh=4, P=6, dtype=dtype, device=device))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("lead", [(), (2,), (3, 2), (2, 1, 2)], ids=["none", "kv", "layers-kv", "any"])
def test_matches_reference(backend, device, lead, dtype):
    """Ragged rows, P and Lmax from 1 to 12, Dh from 1 to 20; kept nodes in walk order or in any order."""
    rng = random.Random(f"{lead}{dtype}")
    for P, Lmax in [(1, 6), (4, 12), (9, 11), (7, 9)]:
        for any_order in (False, True):
            B, Hkv, Dh = rng.randint(1, 3), rng.randint(1, 3), rng.choice([1, 3, 8, 20])
            check_against_reference(*compact_case(rng, lead, B, Hkv, Lmax, Dh, P, dtype, any_order, device=device))


def test_wide_rows_and_paths(backend, device):
    """Dh = 160 (two column chunks when P is wide), P = 70 (the kept block spans many slots)."""
    rng = random.Random(1)
    check_against_reference(*compact_case(rng, (2,), 2, 2, 90, 160, 70, torch.float32, device=device))


def test_nothing_kept_returns_the_lengths(backend, device):
    rng = random.Random(2)
    cache, cache_len, path_nodes, _ = compact_case(rng, (2,), 3, 2, 10, 4, 3, torch.float32, device=device)
    before = cache.clone()
    got = lantern.ops.compact_kv(cache, cache_len, path_nodes, torch.zeros_like(cache_len))
    assert torch.equal(got, cache_len) and got.data_ptr() != cache_len.data_ptr() and torch.equal(cache, before)


def test_zero_and_full_keep(backend, device):
    cache, *args = on(device, torch.randn(2, 2, 3, 2, 10, 4),  # [layers, K/V, B, Hkv, Lmax, Dh]
                      torch.tensor([0, 4, 7]), torch.tensor([[0, 1, 2], [-1, -1, -1], [0, 2, 1]]),
                      torch.tensor([3, 0, 3]))
    check(cache, *args)  # row 2 ends exactly at Lmax


def test_rows_in_place_beside_rows_that_move(backend, device):
    """Rows whose kept nodes are already in place (a chain's accepted prefix: path_nodes[b, i] == i for
    i < n_keep[b]) beside rows that move only past their first node, or only at their last kept one."""
    cache = torch.randn(2, 2, 5, 2, 12, 4, device=device)  # [layers, K/V, B, Hkv, Lmax, Dh]
    path = torch.tensor([[0, 1, 2], [0, 2, -1], [0, 1, 3], [0, 1, 3], [1, 2, 3]], device=device)
    keep = torch.tensor([3, 2, 3, 2, 1], device=device)
    check(cache, torch.tensor([0, 3, 5, 7, 2], device=device), path, keep)
    in_place = path[:1].clone()
    check(cache, torch.tensor([4], device=device).expand(5).contiguous(), in_place.expand(5, -1).contiguous(), keep)


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10**9), B=st.integers(1, 4), P=st.integers(1, 6), n_lead=st.integers(0, 2))
def test_property_matches_brute_force(seed, B, P, n_lead):
    rng = random.Random(seed)
    lead = tuple(rng.randint(1, 3) for _ in range(n_lead))
    case = compact_case(rng, lead, B=B, Hkv=rng.randint(1, 3), Lmax=rng.randint(1, 12), Dh=rng.randint(1, 4), P=P)
    for name in backends.usable(backends.NAMES):
        with lantern.fused(name):
            check(*[t.clone().to(backends.device_for(name)) for t in case])


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
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_bad_input(backend, device, change, exc, name):
    args = {key: value.to(device) if isinstance(value, torch.Tensor) else value
            for key, value in {**_good_args(), **change}.items()}
    before = args["cache"].clone() if isinstance(args["cache"], torch.Tensor) else None
    with pytest.raises(exc, match=f"^{name} "):
        lantern.ops.compact_kv(**args)
    if before is not None:
        assert torch.equal(args["cache"], before)  # rejected before anything moves


# --- GPT-XL's cache (GPU) ------------------------------------------------------------------------

@pytest.mark.parametrize("backend", backends.params(["cuda", "triton"]), indirect=True)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_gpu_gpt_xl_cache(backend, device, dtype):
    """GPT-XL's cache: 36 layers x K/V, B = 2 (with CFG: 4 rows), 20 kv heads, Lmax = 256 + 1 + 65, Dh = 64."""
    rng = random.Random(3)
    check_against_reference(*compact_case(rng, (36, 2), 4, 20, 322, 64, 8, dtype, device=device))


ALL_BACKENDS = backends.params(backends.NAMES)  # reference, cpu, cuda, triton (skipped, with the reason, if unusable)


# ---- inputs in the memory it writes, grad ----------------------------------------------------------------

def _aliased_inputs(which):
    """A float64 cache whose first element is read as ``which`` (cache_len, n_keep or
    path_nodes), int64 views of the cache's own memory; the copy would overwrite them mid-way."""
    cache = torch.zeros(4, 1, 1, 8, 1, dtype=torch.float64)
    cache[0, 0, 0, 1, 0] = 1e300
    alias = cache.view(-1)[:2].view(torch.int64)  # [2] int64 in the cache's first 16 bytes
    args = dict(cache_len=torch.tensor([1]), path_nodes=torch.tensor([[1, 0]]), n_keep=torch.tensor([1]))
    if which == "cache_len":
        args["cache_len"] = alias[:1]  # holds 0 (the cache's first element)
    elif which == "n_keep":
        alias[:1] = 1
        args["n_keep"] = alias[:1]
    else:
        alias[0], alias[1] = 1, 0
        args["path_nodes"] = alias.view(1, 2)
    return cache, args


@pytest.mark.parametrize("which", ["cache_len", "n_keep", "path_nodes"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on non-finite inputs
def test_rejects_inputs_in_the_cache_memory(backend, which):
    import lantern
    from lantern import ops

    cache, args = _aliased_inputs(which)
    before = cache.clone()
    with lantern.fused(backend), pytest.raises(ValueError, match=f"{which} overlaps the memory of cache"):
        ops.compact_kv(cache, **args)
    assert torch.equal(cache, before)  # untouched


@pytest.mark.parametrize("which", ["cache_len", "n_keep", "path_nodes"])
@pytest.mark.parametrize("kernel", ["lantern", "lantern_triton"])
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on non-finite inputs
def test_kernels_called_directly_reject_inputs_in_the_cache_memory(kernel, which):
    """The kernels behind the checks (torch.ops.lantern.compact_kv: cpu, cuda; lantern_triton: triton) refuse
    the overlap themselves (a kernel that re-read cache_len after overwriting it would crash)."""
    name = {"lantern": "cpu", "lantern_triton": "triton"}[kernel]
    if backends.why_unavailable(name) is not None:
        pytest.skip(f"backend {name!r} is unavailable: {backends.why_unavailable(name)}")
    import lantern

    lantern.enable_fused("reference")  # loads the fused ops without using them
    cache, args = _aliased_inputs(which)
    before = cache.clone()
    with pytest.raises(ValueError, match=f"{which} overlaps the memory of cache"):
        getattr(torch.ops, kernel).compact_kv(cache, args["cache_len"], args["path_nodes"], args["n_keep"])
    assert torch.equal(cache, before)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on non-finite inputs
def test_neighbouring_memory_is_accepted_and_a_cache_requiring_grad_refused(backend):
    """Neighbouring (not overlapping) memory is accepted and moves what it should; a cache that requires grad
    is refused on every backend (it is modified in place)."""
    import lantern
    from lantern import ops

    buffer = torch.arange(10, dtype=torch.float64)
    cache = buffer[:8].view(1, 1, 8, 1)  # B = 1, Hkv = 1, Lmax = 8, Dh = 1
    lengths = buffer[8:].view(torch.int64)[:1]  # int64 view of the next 8 bytes: outside the cache's span
    lengths.fill_(2)
    with lantern.fused(backend):
        new_len = ops.compact_kv(cache, lengths, torch.tensor([[0, 3]]), torch.tensor([2]))
        assert new_len.tolist() == [4] and cache.flatten()[:6].tolist() == [0, 1, 2, 5, 4, 5]
        leaf = torch.zeros(1, 1, 8, 1, requires_grad=True)
        with pytest.raises(ValueError, match="cache must not require grad"):
            ops.compact_kv(leaf, torch.tensor([0]), torch.tensor([[0]]), torch.tensor([1]))
