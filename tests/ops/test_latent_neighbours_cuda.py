"""The CUDA kernel of latent_neighbours (csrc/cuda/latent_neighbours.cu) on each path of its design:
distances cached in shared memory or recomputed every pass (V too large to cache), one output segment or
several (K > 4096), every dtype read in place, normalisation by ATen ops on the device. The kernel uses
the reference's float32 arithmetic (no FMA) and the same (distance, index) keys, so its table must equal
the reference's bit for bit, ties included (torch.equal). Needs a GPU and lantern._C built with CUDA."""
from __future__ import annotations

import pytest
import torch

from backends import cuda_kernel_marks
from lantern.ops.reference import latent_neighbours as reference

pytestmark = cuda_kernel_marks("latent_neighbours")

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def gaussian(V, d, seed, dtype=torch.float32):
    """[V, d] codebook on the GPU."""
    return torch.randn(V, d, generator=torch.Generator().manual_seed(seed)).to(dtype).cuda()


def integer_codes(V, d, seed, spread):
    """[V, d] integer-valued float32 codes in [-spread, spread]: exact distances, ties everywhere."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-spread, spread + 1, (V, d), generator=g).float().cuda()


def kernel(codebook, K, normalize=False):
    return torch.ops.lantern.latent_neighbours(codebook, K, normalize)


def reference_rows(codebook, K, normalize, rows):
    """The reference's table restricted to ``rows`` [R] (its own tile routine, on the same device)."""
    codes = reference.codebook_float32(codebook, normalize)  # [V, d]
    ids = torch.as_tensor(rows, device=codebook.device)
    return reference.tile_top_k(codes[ids], ids, codes, K)  # [R, K]


def sample_rows(V, n=96, seed=0):
    """The first and last 16 rows and n - 32 others."""
    g = torch.Generator().manual_seed(seed)
    middle = torch.randperm(V - 32, generator=g)[: n - 32] + 16
    return torch.cat([torch.arange(16), middle.sort().values, torch.arange(V - 16, V)])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("V,d,K", [(2, 1, 1), (3, 1, 2), (513, 1, 512), (1000, 8, 999), (1000, 8, 1),
                                   (777, 5, 33)])
def test_equals_reference(V, d, K, normalize, dtype):
    """V = 2, d = 1, K = V - 1, V not a multiple of the 512-thread CTA; every dtype read in place."""
    codebook = gaussian(V, d, seed=V + d + K, dtype=dtype)
    got = kernel(codebook, K, normalize)
    assert got.dtype == torch.int32 and tuple(got.shape) == (V, K) and got.device == codebook.device
    assert torch.equal(got, reference.latent_neighbours(codebook, K, normalize))


@pytest.mark.parametrize("V,d,K,spread", [(3000, 3, 1500, 2), (600, 4, 599, 0), (2000, 1, 100, 5)])
def test_ties_break_by_lower_index(V, d, K, spread):
    """Integer codes (spread 0: all codes equal, so every row is plain index order)."""
    codebook = integer_codes(V, d, seed=V + K, spread=spread)
    assert torch.equal(kernel(codebook, K), reference.latent_neighbours(codebook, K))


@pytest.mark.parametrize("V,d,K", [(9000, 4, 4097), (9000, 4, 8999), (6000, 2, 5000)])
def test_several_segments(V, d, K):
    """K > 4096: the outputs are selected and sorted in segments of 4096."""
    codebook = gaussian(V, d, seed=K)
    assert torch.equal(kernel(codebook, K), reference.latent_neighbours(codebook, K))
    ties = integer_codes(V, d, seed=K, spread=3)  # segment boundaries inside tie groups
    assert torch.equal(kernel(ties, K), reference.latent_neighbours(ties, K))


@pytest.mark.parametrize("K", [40, 1100, 5000])
def test_recomputed_distances_when_v_is_too_large_to_cache(K):
    """60000 distances (240 KB) exceed a CTA's shared memory: every pass recomputes them."""
    V, d = 60000, 3
    assert 4 * V > torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    rows = sample_rows(V)
    for codebook in (gaussian(V, d, seed=K), integer_codes(V, d, seed=K, spread=4)):
        got = kernel(codebook, K)
        assert torch.equal(got[rows.cuda()], reference_rows(codebook, K, False, rows))


def test_llamagen_shape():
    """V = 16384, d = 8, K = 1000, normalised: sampled rows against the reference, every row valid."""
    V, d, K = 16384, 8, 1000
    codebook = gaussian(V, d, seed=16384)
    got = kernel(codebook, K, True)
    rows = sample_rows(V, n=256)
    assert torch.equal(got[rows.cuda()], reference_rows(codebook, K, True, rows))
    sorted_ids = got.sort(dim=1).values
    assert bool((sorted_ids[:, 1:] != sorted_ids[:, :-1]).all())  # no repeats
    assert not bool((got == torch.arange(V, device=got.device)[:, None]).any())  # never itself


def test_overflowing_distances_rank_by_index():
    """Squared distances that overflow float32 to +inf still rank, by index, as in the reference."""
    codebook = gaussian(40, 2, seed=11) * 3e19
    assert torch.equal(kernel(codebook, 12), reference.latent_neighbours(codebook, 12))


def test_non_contiguous_codebook():
    codebook = gaussian(8, 300, seed=12).t()  # [300, 8], strides (1, 300)
    assert torch.equal(kernel(codebook, 20, True), reference.latent_neighbours(codebook, 20, True))


def test_no_host_sync():
    codebook = gaussian(700, 8, seed=13)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for normalize in (False, True):
            kernel(codebook, 50, normalize)
            kernel(codebook.half(), 50, normalize)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_bad_input_names_the_argument():
    codebook = gaussian(5, 2, seed=14)
    for K in (0, 5, -1):
        with pytest.raises(ValueError, match="K must be"):
            kernel(codebook, K)
    with pytest.raises(ValueError, match="codebook must have shape"):
        kernel(codebook[None], 2)
    with pytest.raises(ValueError, match="codebook must have shape"):
        kernel(codebook[:1], 1)
    with pytest.raises(TypeError, match="codebook must be floating"):
        kernel(codebook.int(), 2)
