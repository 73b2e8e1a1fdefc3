"""latent_neighbours (SPEC §2) against the exact table of a full float32 distance matrix (tests/neighbour_check.py)."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings, strategies as st

import lantern
from lantern.ops.reference import latent_neighbours as reference_module
from neighbour_check import assert_neighbours_valid, exact_table

BACKENDS = ["reference", "cpu", "triton"]  # fused backends join this list once they implement latent_neighbours


@pytest.fixture(params=BACKENDS)
def backend(request):
    with lantern.fused(request.param):
        yield request.param


def random_codebook(V, d, seed, dtype=torch.float32):
    return torch.randn(V, d, generator=torch.Generator().manual_seed(seed)).to(dtype)


def integer_codebook(V, d, seed, spread=2):
    """Small integer coordinates: every distance is exact in float32 and ties are everywhere."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-spread, spread + 1, (V, d), generator=g).to(torch.float32)


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("V,d,K", [(2, 1, 1), (50, 8, 49), (300, 8, 20), (257, 3, 64)])
def test_random_codebook_matches_exact_table(backend, V, d, K, normalize):
    codebook = random_codebook(V, d, seed=V + d + K)
    got = lantern.ops.latent_neighbours(codebook, K, normalize=normalize)
    assert got.dtype == torch.int32 and tuple(got.shape) == (V, K)
    assert_neighbours_valid(codebook, K, normalize, got)
    if backend == "reference":  # same float32 arithmetic as exact_table: exactly equal
        np.testing.assert_array_equal(got.numpy(), exact_table(codebook, K, normalize))


@pytest.mark.parametrize("V,d,K", [(200, 2, 30), (120, 8, 119), (64, 1, 10)])
def test_exact_ties_break_by_lower_index(backend, V, d, K):
    """Integer codes (with duplicates) make every distance exact, so every backend must match exactly."""
    codebook = integer_codebook(V, d, seed=V * d)
    got = lantern.ops.latent_neighbours(codebook, K)
    np.testing.assert_array_equal(got.numpy(), exact_table(codebook, K, False))


def test_duplicate_codes_are_each_others_nearest(backend):
    codebook = torch.tensor([[0.0, 0.0], [5.0, 5.0], [0.0, 0.0], [1.0, 0.0], [5.0, 5.0]])
    got = lantern.ops.latent_neighbours(codebook, 4)
    expected = [[2, 3, 1, 4], [4, 3, 0, 2], [0, 3, 1, 4], [0, 2, 1, 4], [1, 3, 0, 2]]
    assert got.tolist() == expected


def test_normalize_compares_directions(backend):
    # raw: code 1 is nearest to code 0; normalised: code 2 (same direction, longer) is at distance 0
    codebook = torch.tensor([[1.0, 0.0], [0.8, 0.6], [10.0, 0.0], [0.0, 3.0]])
    assert lantern.ops.latent_neighbours(codebook, 1, normalize=False)[0].tolist() == [1]
    assert lantern.ops.latent_neighbours(codebook, 1, normalize=True)[0].tolist() == [2]


def test_default_is_raw_rows(backend):
    codebook = random_codebook(40, 4, seed=3)
    assert torch.equal(lantern.ops.latent_neighbours(codebook, 5),
                       lantern.ops.latent_neighbours(codebook, 5, normalize=False))


def test_normalize_equals_prenormalised_rows(backend):
    codebook = random_codebook(100, 8, seed=4) * 7.0
    unit = F.normalize(codebook, p=2.0, dim=1, eps=1e-12)
    got = lantern.ops.latent_neighbours(codebook, 12, normalize=True)
    assert_neighbours_valid(unit, 12, False, got)


def test_close_codes_far_from_origin_use_direct_differences(backend):
    """Codes clustered at ~100 with ~1e-2 spread: ||x||^2 + ||y||^2 - 2 x.y loses every digit of the
    distances in float32; direct differences keep them."""
    codebook = 100.0 + 0.01 * random_codebook(200, 8, seed=10)
    got = lantern.ops.latent_neighbours(codebook, 10)
    assert_neighbours_valid(codebook, 10, False, got)
    if backend == "reference":
        np.testing.assert_array_equal(got.numpy(), exact_table(codebook, 10, False))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_use_float32_distances(backend, dtype):
    codebook = random_codebook(90, 8, seed=5, dtype=dtype)
    got = lantern.ops.latent_neighbours(codebook, 16)
    assert_neighbours_valid(codebook, 16, False, got)
    if backend == "reference":
        np.testing.assert_array_equal(got.numpy(), exact_table(codebook, 16, False))


@pytest.mark.parametrize("row_tile,col_tile", [(1, 200), (5, 3), (7, 13), (64, 5), (300, 300)])
def test_reference_tiling_does_not_change_the_table(monkeypatch, row_tile, col_tile):
    """The running top-K merge across column tiles and the row tiles give the untiled answer, including
    when K exceeds a column tile and when tiles do not divide V."""
    monkeypatch.setattr(reference_module, "ROW_TILE", row_tile)
    monkeypatch.setattr(reference_module, "COL_TILE", col_tile)
    for codebook, K in [(random_codebook(150, 4, seed=6), 40), (integer_codebook(150, 2, seed=7), 33)]:
        got = reference_module.latent_neighbours(codebook, K)
        np.testing.assert_array_equal(got.numpy(), exact_table(codebook, K, False))


def test_larger_table_is_valid(backend):
    codebook = random_codebook(1024, 8, seed=8)
    got = lantern.ops.latent_neighbours(codebook, 64, normalize=True)
    assert_neighbours_valid(codebook, 64, True, got)


@settings(max_examples=40, deadline=None)
@given(V=st.integers(2, 40), d=st.integers(1, 4), seed=st.integers(0, 2**31), data=st.data())
def test_property_integer_codebooks_exact(V, d, seed, data):
    K = data.draw(st.integers(1, V - 1))
    codebook = integer_codebook(V, d, seed, spread=data.draw(st.integers(0, 3)))
    for backend in BACKENDS:
        with lantern.fused(backend):
            got = lantern.ops.latent_neighbours(codebook, K)
        np.testing.assert_array_equal(got.numpy(), exact_table(codebook, K, False))


# --- the checker itself has power ----------------------------------------------------------------

def test_checker_rejects_wrong_tables():
    codebook = random_codebook(64, 3, seed=9)
    good = torch.from_numpy(exact_table(codebook, 10, False)).to(torch.int32)
    assert_neighbours_valid(codebook, 10, False, good)
    swapped = good.clone()
    swapped[5, [0, 9]] = swapped[5, [9, 0]]  # out of order
    shifted = good.clone()
    shifted[5, 9] = int(exact_table(codebook, 20, False)[5, 15])  # a farther code
    with_self = good.clone()
    with_self[5, 3] = 5
    repeated = good.clone()
    repeated[5, 4] = repeated[5, 3]
    for bad, why in [(swapped, "nondecreasing"), (shifted, "farther"), (with_self, "itself"),
                     (repeated, "twice")]:
        with pytest.raises(AssertionError, match=why):
            assert_neighbours_valid(codebook, 10, False, bad)


def test_checker_accepts_swaps_of_tied_codes():
    codebook = torch.tensor([[0.0], [1.0], [-1.0], [2.0]])  # codes 1 and 2 tie around code 0
    assert_neighbours_valid(codebook, 2, False, torch.tensor([[2, 1], [0, 3], [0, 1], [1, 0]],
                                                             dtype=torch.int32))


# --- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("codebook,K,normalize,exc,name", [
    ([[0.0, 1.0], [1.0, 0.0]], 1, False, TypeError, "codebook"),
    (torch.zeros(4), 1, False, ValueError, "codebook"),
    (torch.zeros(4, 2, dtype=torch.int64), 1, False, TypeError, "codebook"),
    (torch.zeros(1, 2), 1, False, ValueError, "codebook"),
    (torch.zeros(4, 0), 1, False, ValueError, "codebook"),
    (torch.tensor([[0.0], [float("nan")], [1.0]]), 1, False, ValueError, "codebook"),
    (torch.tensor([[0.0], [float("inf")], [1.0]]), 1, False, ValueError, "codebook"),
    (torch.tensor([[0.0], [1e300], [1.0]], dtype=torch.float64), 1, False, ValueError, "codebook"),
    (torch.zeros(4, 2), 0, False, ValueError, "K"),
    (torch.zeros(4, 2), 4, False, ValueError, "K"),
    (torch.zeros(4, 2), -1, False, ValueError, "K"),
    (torch.zeros(4, 2), 2.0, False, TypeError, "K"),
    (torch.zeros(4, 2), True, False, TypeError, "K"),
    (torch.zeros(4, 2), 2, 1, TypeError, "normalize"),
])
def test_bad_input(backend, codebook, K, normalize, exc, name):
    with pytest.raises(exc, match=name):
        lantern.ops.latent_neighbours(codebook, K, normalize=normalize)
