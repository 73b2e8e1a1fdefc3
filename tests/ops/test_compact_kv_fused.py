"""lantern::compact_kv (csrc/cpu, csrc/cuda) against the reference (SPEC §6)."""
import pytest
import torch

import lantern
from lantern.ops.reference.compact_kv import compact_kv as compact_kv_ref

pytest.importorskip("lantern._C", reason="lantern._C is not built (pip install --no-build-isolation -e .)")
from lantern.ops import fused_cpu  # noqa: E402,F401  (registers the fake impls and backends)

op = torch.ops.lantern.compact_kv
needs_cuda = pytest.mark.skipif(not (fused_cpu.cuda_compiled() and torch.cuda.is_available()),
                                reason="needs a CUDA device and lantern._C built with CUDA kernels")


def make_case(gen, leading, B, Hkv, Lmax, Dh, P, dtype, device="cpu", shuffle=False):
    """A random valid case: row b holds a tree of T_b nodes at cache_len[b]..; it keeps the root and an
    increasing subset of the other nodes (ragged n_keep in [0, P]; with ``shuffle``, in any order and
    possibly repeated); entries past n_keep are -1."""
    cache = torch.randn(*leading, B, Hkv, Lmax, Dh, generator=gen).to(dtype)  # [..., B, Hkv, Lmax, Dh]
    cache_len = torch.zeros(B, dtype=torch.int64)
    path_nodes = torch.full((B, P), -1, dtype=torch.int64)
    n_keep = torch.zeros(B, dtype=torch.int64)
    for b in range(B):
        T = int(torch.randint(1, Lmax + 1, (1,), generator=gen))  # tree nodes of this row
        cache_len[b] = int(torch.randint(0, Lmax - T + 1, (1,), generator=gen))
        n = int(torch.randint(0, min(P, T) + 1, (1,), generator=gen))
        if n:
            rest = torch.randperm(T - 1, generator=gen)[: n - 1].sort().values + 1
            path_nodes[b, :n] = torch.cat([torch.zeros(1, dtype=torch.int64), rest])
            if shuffle:
                path_nodes[b, :n] = torch.randint(0, T, (n,), generator=gen)
        n_keep[b] = n
    return tuple(t.to(device) for t in (cache, cache_len, path_nodes, n_keep))


LAYOUTS = [(), (2,), (3, 2), (2, 1, 2)]  # leading dims: none, K/V, [layers, K/V], anything


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("leading", LAYOUTS)
def test_cpu_matches_reference(leading, dtype):
    gen = torch.Generator().manual_seed(hash((leading, str(dtype))) % 2**31)
    for P, Lmax in [(1, 6), (4, 12), (7, 9)]:
        for _ in range(5):
            B, Hkv, Dh = (int(x) for x in torch.randint(1, 5, (3,), generator=gen))
            shuffle = bool(torch.randint(0, 2, (1,), generator=gen))
            cache, cache_len, path_nodes, n_keep = make_case(gen, leading, B, Hkv, Lmax, Dh, P, dtype, shuffle=shuffle)
            want_cache = cache.clone()
            want_len = compact_kv_ref(want_cache, cache_len, path_nodes, n_keep)
            got_len = op(cache, cache_len, path_nodes, n_keep)
            assert torch.equal(got_len, want_len)
            assert torch.equal(cache, want_cache)  # bit-exact: a copy


def test_public_op_dispatches_to_cpu_kernel():
    gen = torch.Generator().manual_seed(0)
    cache, cache_len, path_nodes, n_keep = make_case(gen, (2, 2), 3, 2, 16, 8, 5, torch.bfloat16)
    want = cache.clone()
    want_len = lantern.ops.compact_kv(want, cache_len, path_nodes, n_keep)  # reference
    with lantern.fused("cpu"):
        assert lantern._backend.resolve("compact_kv", cache.device) is fused_cpu.compact_kv
        got_len = lantern.ops.compact_kv(cache, cache_len, path_nodes, n_keep)
    assert torch.equal(got_len, want_len) and torch.equal(cache, want)


def test_any_order_reads_sources_first():
    cache = torch.arange(8.0).view(1, 1, 8, 1)  # value = position
    op(cache, torch.tensor([1]), torch.tensor([[3, 2, 1, 0]]), torch.tensor([4]))
    assert cache.flatten().tolist() == [0, 4, 3, 2, 1, 5, 6, 7]


def test_pinned_case():
    # one layer, B = 2, Hkv = 1, Lmax = 8, Dh = 1: the value at a position is the position itself
    cache = torch.arange(8.0).repeat(2, 1).view(2, 1, 8, 1)
    new_len = op(cache, torch.tensor([2, 0]), torch.tensor([[0, 2, 5], [0, 1, -1]]), torch.tensor([3, 1]))
    assert new_len.tolist() == [5, 1]
    assert cache[0, 0, :, 0].tolist() == [0, 1, 2, 4, 7, 5, 6, 7]
    assert cache[1, 0, :, 0].tolist() == list(range(8))


def _bad_cases():
    cache = torch.zeros(2, 2, 1, 8, 4)  # [K/V, B, Hkv, Lmax, Dh]
    ok = dict(cache=cache, cache_len=torch.tensor([2, 3]), path_nodes=torch.tensor([[0, 1, 3], [0, 2, -1]]),
              n_keep=torch.tensor([3, 2]))
    yield "cache", dict(ok, cache=torch.zeros(2, 8, 4))
    yield "cache", dict(ok, cache=torch.zeros(2, 2, 1, 8, 4, dtype=torch.int32))
    yield "cache", dict(ok, cache=torch.zeros(2, 2, 1, 4, 8).transpose(-1, -2))
    yield "cache_len", dict(ok, cache_len=torch.tensor([2, 3], dtype=torch.int32))
    yield "cache_len", dict(ok, cache_len=torch.tensor([2, 3, 4]))
    yield "path_nodes", dict(ok, path_nodes=torch.tensor([0, 1, 3]))
    yield "path_nodes", dict(ok, path_nodes=torch.tensor([[0, 1, 3]]))
    yield "n_keep", dict(ok, n_keep=torch.tensor([3]))
    yield "n_keep", dict(ok, n_keep=torch.tensor([4, 2]))  # > P
    yield "n_keep", dict(ok, n_keep=torch.tensor([-1, 2]))
    yield "path_nodes", dict(ok, n_keep=torch.tensor([3, 3]))  # kept entry is -1
    yield "path_nodes", dict(ok, path_nodes=torch.tensor([[0, 1, 6], [0, 2, -1]]))  # source 2 + 6 >= Lmax
    yield "path_nodes", dict(ok, path_nodes=torch.tensor([[0, -2, 3], [0, 2, -1]]))
    yield "cache_len", dict(ok, cache_len=torch.tensor([-1, 3]))
    yield "cache_len", dict(ok, cache_len=torch.tensor([8, 3]))  # destination outside [0, Lmax)
    yield "cache_len", dict(ok, cache_len=torch.tensor([6, 3]))  # destination 6 + 2 = Lmax


@pytest.mark.parametrize("name,kwargs", list(_bad_cases()))
def test_bad_input_raises_naming_the_argument(name, kwargs):
    before = kwargs["cache"].clone()
    with pytest.raises((RuntimeError, ValueError, TypeError), match=name):
        op(**kwargs)
    assert torch.equal(kwargs["cache"], before)  # validated before anything moves


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("leading", LAYOUTS)
def test_cuda_matches_cpu(leading, dtype):
    gen = torch.Generator().manual_seed(1)
    # odd Dh: narrow copy units; P = 200: fewer threads and narrower units to fit P slots in shared memory
    for P, Lmax, Dh in [(1, 6, 64), (4, 12, 3), (7, 9, 5), (6, 40, 128), (200, 300, 64)]:
        for shuffle in (False, True):
            B, Hkv = (int(x) for x in torch.randint(1, 5, (2,), generator=gen))
            args = make_case(gen, leading, B, Hkv, Lmax, Dh, P, dtype, shuffle=shuffle)
            cuda_args = tuple(t.cuda() for t in args)
            want_len = op(*args)
            got_len = op(*cuda_args)
            assert torch.equal(got_len.cpu(), want_len) and torch.equal(cuda_args[0].cpu(), args[0])


@pytest.mark.gpu
@needs_cuda
def test_cuda_matches_reference_and_skips_invalid_rows():
    gen = torch.Generator().manual_seed(2)
    cache, cache_len, path_nodes, n_keep = make_case(gen, (3, 2), 4, 2, 20, 16, 5, torch.bfloat16, "cuda")
    want = cache.clone()
    want_len = compact_kv_ref(want, cache_len, path_nodes, n_keep)
    assert torch.equal(op(cache, cache_len, path_nodes, n_keep), want_len) and torch.equal(cache, want)
    # invalid indices never touch memory outside the cache: the row is left as it is
    before = cache.clone()
    op(cache, cache_len, torch.full_like(path_nodes, 10**9), torch.full_like(n_keep, 3))
    torch.cuda.synchronize()
    assert torch.equal(cache, before)


@pytest.mark.gpu
@needs_cuda
def test_cuda_too_many_kept_nodes_raises():
    cache = torch.zeros(1, 1, 4, 2, device="cuda")
    path_nodes = torch.full((1, 2000), -1, device="cuda")
    with pytest.raises(ValueError, match="path_nodes"):
        op(cache, torch.tensor([0], device="cuda"), path_nodes, torch.tensor([0], device="cuda"))


@pytest.mark.gpu
@needs_cuda
def test_cuda_device_mismatch_raises():
    cache = torch.zeros(1, 1, 4, 2, device="cuda")
    with pytest.raises(ValueError, match="cache_len"):
        op(cache, torch.tensor([0]), torch.tensor([[0]], device="cuda"), torch.tensor([1], device="cuda"))
