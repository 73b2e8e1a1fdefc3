"""The fused cpu kernels give the same bits at any thread count (docs/sampling.md "Numerics"): every op of
lantern._C's cpu backend run at 1 and at 2 threads, with shapes that make at::parallel_for split the work
(verify at B = 1 splits each node's vocabulary passes; the others split over rows, heads, tokens or blocks),
must agree bit for bit. Each test first checks that the op is routed to the extension (the kernel under test
runs), then compares every output with torch.equal (NaN-free inputs, so equal means identical bits)."""
from __future__ import annotations

import random

import pytest
import torch

import backends
import lantern
from lantern import ops
from op_cases import attention_case, compact_case, continuous_block, random_case, random_codebook

pytest.importorskip("lantern._C", reason="lantern._C is not built (pip install --no-build-isolation -e .)")

THREADS = (1, 2)


@pytest.fixture(autouse=True)
def cpu_backend():
    before = torch.get_num_threads()
    with lantern.fused("cpu"):
        yield
    torch.set_num_threads(before)


def at_threads(n, fn):
    torch.set_num_threads(n)
    assert torch.get_num_threads() == n
    return fn()


def assert_same_bits(runs):
    first, *others = runs
    first = first if isinstance(first, tuple) else (first,)
    for other in others:
        other = other if isinstance(other, tuple) else (other,)
        assert len(first) == len(other)
        for a, b in zip(first, other):
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b)


def routed(op: str) -> None:
    assert lantern._backend.resolve(op, torch.device("cpu")) is backends.kernel("cpu", op), op


def test_the_kernels_parallel_loops_run_on_the_threads_torch_is_given():
    """at::parallel_for is a header template: compiled without OpenMP it runs every chunk on the calling thread,
    and every comparison below would compare a serial run with itself. lantern._C's own parallel_for over 64
    items runs on both threads at 2 threads, and on one at 1."""
    from lantern import _C

    assert at_threads(2, lambda: _C.parallel_threads(64)) == 2
    assert at_threads(1, lambda: _C.parallel_threads(64)) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("seed", range(3))
def test_verify_single_row_vocabulary_split(dtype, seed):
    """B = 1 and V = 3 * 4096 + 5: with 2 threads the row's guidance, temperature and candidate passes run in
    4096-token chunks on both threads (csrc/cpu/verify.cpp); the outputs equal the one-thread run's."""
    routed("verify")
    args, kwargs = random_case(300 + seed, V=3 * 4096 + 5, T=9, B=1, dtype=dtype)
    assert_same_bits([at_threads(n, lambda: ops.verify(*args, **kwargs)) for n in THREADS])


@pytest.mark.parametrize("seed", range(3))
def test_verify_rows_over_threads(seed):
    routed("verify")
    args, kwargs = random_case(400 + seed, V=4096, T=17, B=5)
    assert_same_bits([at_threads(n, lambda: ops.verify(*args, **kwargs)) for n in THREADS])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_attention(dtype):
    """Work items (batch row, kv head, 64-query block) spread over the threads; each item's online softmax
    runs on one thread in key-tile order, so the split cannot change a sum."""
    routed("tree_attention")
    case = attention_case(B=3, H=4, Hkv=2, T=40, Dh=64, cache_len=[0, 130, 257], Lmax=400, dtype=dtype, seed=5)
    assert_same_bits([at_threads(n, lambda: ops.tree_attention(*case)) for n in THREADS])


def test_latent_neighbours():
    routed("latent_neighbours")
    codebook = random_codebook(5000, 8, seed=2)
    assert_same_bits([at_threads(n, lambda: ops.latent_neighbours(codebook, 16)) for n in THREADS])


def test_continuous_verify():
    """Tokens spread over the threads (grain 64); each token's test and residual sampler on one thread."""
    routed("continuous_verify")
    block = continuous_block(7, B=6, N=64, C=16, gap=1.5)
    rows, positions = torch.arange(6) * 7, torch.arange(64).repeat(6, 1)
    runs = [at_threads(n, lambda: tuple(ops.continuous_verify(**block, seed=3, offset=9, rows=rows,
                                                              positions=positions))) for n in THREADS]
    assert not bool(runs[0][1].all())  # some drafts are rejected: the residual sampler runs too
    assert_same_bits(runs)


def test_philox_uniform():
    routed("philox_uniform")
    c = torch.arange(3 * (1 << 14) + 7, dtype=torch.int64)
    assert_same_bits([at_threads(n, lambda: ops.philox_uniform(11, c, c * 3, c // 5, c % 7)) for n in THREADS])


def test_compact_kv():
    routed("compact_kv")
    cache, cache_len, path_nodes, n_keep = compact_case(random.Random(3), (2,), B=4, Hkv=4, Lmax=64, Dh=32, P=8)
    runs = []
    for n in THREADS:
        moved = cache.clone()
        new_len = at_threads(n, lambda: ops.compact_kv(moved, cache_len, path_nodes, n_keep))
        runs.append((moved, new_len))
    assert_same_bits(runs)


def test_draft_sample():
    """Nodes spread over the threads (grain 1); each node's q and draws on one thread."""
    routed("draft_sample")
    g = torch.Generator().manual_seed(8)
    logits = 3 * torch.randn(6, 3, 2000, generator=g)
    kwargs = dict(temperature=torch.tensor([1.0, 0.0, 0.7, 1.3, 1.0, 0.9]), top_k=torch.tensor([0, 0, 50, 0, 3, 0]),
                  top_p=torch.tensor([1.0, 1.0, 0.9, 0.8, 1.0, 1.0]), draws=4, seed=12,
                  node_ids=torch.arange(3).expand(6, 3), offset=5, rows=torch.arange(6) * 3)
    assert_same_bits([at_threads(n, lambda: tuple(ops.draft_sample(logits, **kwargs))) for n in THREADS])
