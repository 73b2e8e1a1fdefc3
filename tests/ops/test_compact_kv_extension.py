"""lantern._C's compact_kv op (torch.ops.lantern.compact_kv: csrc/cpu, csrc/cuda) called directly: the
kernel's own argument checks (cpu, cuda), and the CUDA kernel against the CPU kernel and on invalid rows.
Agreement with the reference on every backend is tests/ops/test_compact_kv.py."""
import random

import pytest
import torch

import backends
from lantern.ops.reference.compact_kv import compact_kv as compact_kv_ref
from op_cases import compact_case

pytest.importorskip("lantern._C", reason="lantern._C is not built (pip install --no-build-isolation -e .)")
import lantern.ops  # noqa: E402,F401  (defines the ops)

op = torch.ops.lantern.compact_kv
EXTENSION = backends.params(["cpu", "cuda"])
CUDA = pytest.mark.parametrize("backend", backends.params(["cuda"]), indirect=True)
LAYOUTS = [(), (2,), (3, 2), (2, 1, 2)]  # leading dims: none, K/V, [layers, K/V], anything


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


@pytest.mark.parametrize("backend", EXTENSION, indirect=True)
@pytest.mark.parametrize("name,kwargs", list(_bad_cases()))
@pytest.mark.no_kernel_check("bad input: the kernel's own checks reject it before any work")
def test_kernel_rejects_bad_input_naming_the_argument(backend, device, name, kwargs):
    kwargs = {key: value.to(device) for key, value in kwargs.items()}
    before = kwargs["cache"].clone()
    with pytest.raises((RuntimeError, ValueError, TypeError), match=name):
        op(**kwargs)
    assert torch.equal(kwargs["cache"], before)  # validated before anything moves


@CUDA
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("leading", LAYOUTS)
def test_cuda_matches_cpu(backend, leading, dtype):
    rng = random.Random(1)
    # odd Dh: narrow copy units; P = 200: fewer threads and narrower units to fit P slots in shared memory
    for P, Lmax, Dh in [(1, 6, 64), (4, 12, 3), (7, 9, 5), (6, 40, 128), (200, 300, 64)]:
        for shuffle in (False, True):
            B, Hkv = rng.randint(1, 4), rng.randint(1, 4)
            args = compact_case(rng, leading, B, Hkv, Lmax, Dh, P, dtype, any_order=shuffle)
            cuda_args = tuple(t.cuda() for t in args)
            want_len = op(*args)
            got_len = op(*cuda_args)
            assert torch.equal(got_len.cpu(), want_len) and torch.equal(cuda_args[0].cpu(), args[0])


@CUDA
def test_cuda_matches_reference_and_skips_invalid_rows(backend):
    cache, cache_len, path_nodes, n_keep = compact_case(random.Random(2), (3, 2), 4, 2, 20, 16, 5, torch.bfloat16,
                                                        device="cuda")
    want = cache.clone()
    want_len = compact_kv_ref(want, cache_len, path_nodes, n_keep)
    assert torch.equal(op(cache, cache_len, path_nodes, n_keep), want_len) and torch.equal(cache, want)
    # invalid indices never touch memory outside the cache: the row is left as it is
    before = cache.clone()
    op(cache, cache_len, torch.full_like(path_nodes, 10**9), torch.full_like(n_keep, 3))
    torch.cuda.synchronize()
    assert torch.equal(cache, before)


@CUDA
def test_cuda_too_many_kept_nodes_raises(backend):
    cache = torch.zeros(1, 1, 4, 2, device="cuda")
    path_nodes = torch.full((1, 2000), -1, device="cuda")
    with pytest.raises(ValueError, match="path_nodes"):
        op(cache, torch.tensor([0], device="cuda"), path_nodes, torch.tensor([0], device="cuda"))


@CUDA
def test_cuda_device_mismatch_raises(backend):
    cache = torch.zeros(1, 1, 4, 2, device="cuda")
    with pytest.raises(ValueError, match="cache_len"):
        op(cache, torch.tensor([0]), torch.tensor([[0]], device="cuda"), torch.tensor([1], device="cuda"))
