"""latent_neighbours (SPEC §2) on every backend, against the exact table of a full float32 distance matrix
(tests/neighbour_check.py) and the tie-aware checker.

Exactness. The reference, the cpu kernel and the Triton kernel use the same float32 arithmetic (no FMA), so
their tables equal ``exact_table``; another backend (cuda) may differ only where two distances are equal
within float32 rounding, so it is held to the tie-aware checker, and to the exact table wherever distances
are exact (integer codebooks). Under Triton's interpreter the codebooks are small; the V >= 4096 shapes (the
cpu kernel's sampled threshold and its fallback) run on compiled backends, LlamaGen's V = 16384 on a GPU."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import backends
import lantern
from lantern.ops.reference import latent_neighbours as reference_module
from neighbour_check import assert_neighbours_valid, exact_table
from op_cases import integer_codebook, random_codebook

EXACT = ("reference", "cpu", "triton")  # backends whose tables equal exact_table (module docstring)


def table(codebook, K, **kwargs):
    """The active backend's table, on the CPU."""
    return lantern.ops.latent_neighbours(codebook, K, **kwargs).cpu()


def reference_table(codebook, K, normalize=False):
    with lantern.fused("reference"):
        return table(codebook, K, normalize=normalize)


def assert_table(backend, codebook, K, normalize, got):
    """Valid (tie-aware) on every backend; equal to the exact table on the exact ones."""
    assert_neighbours_valid(codebook.cpu(), K, normalize, got)
    if backend in EXACT:
        np.testing.assert_array_equal(got.numpy(), exact_table(codebook.cpu(), K, normalize))


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("V,d,K", [(2, 1, 1), (50, 8, 49), (300, 8, 20), (257, 3, 64), (70, 5, 33)])
def test_random_codebook_matches_exact_table(backend, device, V, d, K, normalize):
    """300 codes: several row programs and two column tiles under the interpreter's tiling; K = V - 1;
    K not a power of two (padded lanes in the ordering step)."""
    codebook = random_codebook(V, d, seed=V + d + K, device=device)
    got = lantern.ops.latent_neighbours(codebook, K, normalize=normalize)
    assert got.dtype == torch.int32 and tuple(got.shape) == (V, K) and got.device == codebook.device
    assert_table(backend, codebook, K, normalize, got.cpu())


COMPILED = backends.params(backends.compiled())


@pytest.mark.slow
@pytest.mark.parametrize("backend", COMPILED, indirect=True)
@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("V,d,K", [(4096, 8, 1000), (4096, 3, 64), (5000, 8, 1), (300, 8, 299)])
def test_large_codebooks(backend, device, V, d, K, normalize):
    """V >= 4096: the cpu kernel's sampled threshold; K = V - 1 at V = 300."""
    codebook = random_codebook(V, d, seed=V + K, device=device)
    assert_table(backend, codebook, K, normalize, table(codebook, K, normalize=normalize))


@pytest.mark.parametrize("backend", COMPILED, indirect=True)
def test_ties_at_scale(backend, device):
    """Integer codes: exact distances, ties everywhere (a sampled threshold sits inside a tie group)."""
    codebook = torch.randint(-2, 3, (4096, 4), generator=torch.Generator().manual_seed(1)).float()
    got = table(codebook.to(device), 700)
    np.testing.assert_array_equal(got.numpy(), exact_table(codebook, 700, False))


@pytest.mark.slow
@pytest.mark.parametrize("backend", COMPILED, indirect=True)
def test_fallback_when_the_sample_misleads(backend, device):
    """Every 4th code (the sampled ones at V = 4096) sits at one point: the sampled threshold admits only
    those 1024 codes, fewer than K = 1100, so the kernel must redo those rows without it."""
    g = torch.Generator().manual_seed(2)
    codebook = torch.randn(4096, 8, generator=g) * 10
    codebook[::4] = 0.5
    assert_table(backend, codebook, 1100, False, table(codebook.to(device), 1100))


@pytest.mark.parametrize("V,d,K,spread,seed", [
    (200, 2, 30, 2, 400), (120, 8, 119, 2, 960), (64, 1, 10, 2, 64),
    (200, 2, 30, 2, 202), (120, 8, 119, 1, 128), (64, 1, 10, 3, 65),
    (90, 3, 45, 0, 93),  # spread 0: every code is the same point, all distances 0: plain index order
])
def test_exact_ties_break_by_lower_index(backend, device, V, d, K, spread, seed):
    """Integer codes (with duplicates) make every distance exact, so every backend must match exactly."""
    codebook = integer_codebook(V, d, seed=seed, spread=spread)
    got = table(codebook.to(device), K)
    np.testing.assert_array_equal(got.numpy(), exact_table(codebook, K, False))


def test_duplicate_codes_are_each_others_nearest(backend, device):
    codebook = torch.tensor([[0.0, 0.0], [5.0, 5.0], [0.0, 0.0], [1.0, 0.0], [5.0, 5.0]], device=device)
    got = table(codebook, 4)
    expected = [[2, 3, 1, 4], [4, 3, 0, 2], [0, 3, 1, 4], [0, 2, 1, 4], [1, 3, 0, 2]]
    assert got.tolist() == expected


def test_normalize_compares_directions(backend, device):
    # raw: code 1 is nearest to code 0; normalised: code 2 (same direction, longer) is at distance 0
    codebook = torch.tensor([[1.0, 0.0], [0.8, 0.6], [10.0, 0.0], [0.0, 3.0]], device=device)
    assert table(codebook, 1, normalize=False)[0].tolist() == [1]
    assert table(codebook, 1, normalize=True)[0].tolist() == [2]


def test_default_is_raw_rows(backend, device):
    codebook = random_codebook(40, 4, seed=3, device=device)
    assert torch.equal(table(codebook, 5), table(codebook, 5, normalize=False))


def test_normalize_equals_prenormalised_rows(backend, device):
    codebook = random_codebook(100, 8, seed=4) * 7.0
    unit = F.normalize(codebook, p=2.0, dim=1, eps=1e-12)
    got = table(codebook.to(device), 12, normalize=True)
    assert_neighbours_valid(unit, 12, False, got)


def test_close_codes_far_from_origin_use_direct_differences(backend, device):
    """Codes clustered at ~100 with ~1e-2 spread: ||x||^2 + ||y||^2 - 2 x.y loses every digit of the
    distances in float32; direct differences keep them."""
    codebook = 100.0 + 0.01 * random_codebook(200, 8, seed=10)
    assert_table(backend, codebook, 10, False, table(codebook.to(device), 10))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # the interpreter's numpy, on purpose
def test_huge_distances_saturate_like_the_reference(backend, device):
    """Squared distances that overflow float32 to +inf (bits 0x7f800000) are still ranked, by index."""
    codebook = random_codebook(40, 2, seed=11) * 3e19
    assert torch.equal(table(codebook.to(device), 12), reference_table(codebook, 12))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_other_dtypes_use_float32_distances(backend, device, dtype):
    """Valid on every backend; the exact backends equal the reference, raw and normalised."""
    codebook = random_codebook(90, 8, seed=5, dtype=dtype)
    got = table(codebook.to(device), 16)
    assert_neighbours_valid(codebook, 16, False, got)
    if backend == "reference":
        np.testing.assert_array_equal(got.numpy(), exact_table(codebook, 16, False))
    if backend in EXACT:
        for normalize in (False, True):
            want = reference_table(codebook, 16, normalize)
            assert torch.equal(table(codebook.to(device), 16, normalize=normalize), want)


@pytest.mark.parametrize("backend", COMPILED, indirect=True)
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_other_dtypes_at_600_codes(backend, device, dtype):
    codebook = random_codebook(600, 8, seed=3, dtype=dtype)
    got = table(codebook.to(device), 40, normalize=True)
    if backend in EXACT:
        assert torch.equal(got, reference_table(codebook, 40, normalize=True))
    else:
        assert_neighbours_valid(codebook, 40, True, got)


@pytest.mark.parametrize("row_tile,col_tile", [(1, 200), (5, 3), (7, 13), (64, 5), (300, 300)])
def test_reference_tiling_does_not_change_the_table(monkeypatch, row_tile, col_tile):
    """The running top-K merge across column tiles and the row tiles give the untiled answer, including
    when K exceeds a column tile and when tiles do not divide V."""
    monkeypatch.setattr(reference_module, "ROW_TILE", row_tile)
    monkeypatch.setattr(reference_module, "COL_TILE", col_tile)
    for codebook, K in [(random_codebook(150, 4, seed=6), 40), (integer_codebook(150, 2, seed=7), 33)]:
        got = reference_module.latent_neighbours(codebook, K)
        np.testing.assert_array_equal(got.numpy(), exact_table(codebook, K, False))


def test_larger_table_is_valid(backend, device):
    codebook = random_codebook(1024, 8, seed=8)
    got = table(codebook.to(device), 64, normalize=True)
    assert_neighbours_valid(codebook, 64, True, got)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(V=st.integers(2, 40), d=st.integers(1, 4), seed=st.integers(0, 2**31), data=st.data())
def test_property_integer_codebooks_exact(V, d, seed, data):
    K = data.draw(st.integers(1, V - 1))
    codebook = integer_codebook(V, d, seed, spread=data.draw(st.integers(0, 3)))
    for name in backends.usable(backends.NAMES):
        with lantern.fused(name):
            got = table(codebook.to(backends.device_for(name)), K)
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
    (torch.randn(5), 2, False, ValueError, "codebook"),
    (torch.zeros(4, 2, dtype=torch.int64), 1, False, TypeError, "codebook"),
    (torch.zeros(1, 2), 1, False, ValueError, "codebook"),
    (torch.zeros(4, 0), 1, False, ValueError, "codebook"),
    (torch.tensor([[0.0], [float("nan")], [1.0]]), 1, False, ValueError, "codebook"),
    (torch.tensor([[0.0, float("nan")], [1.0, 1.0]]), 1, False, ValueError, "codebook"),
    (torch.tensor([[0.0], [float("inf")], [1.0]]), 1, False, ValueError, "codebook"),
    (torch.tensor([[0.0], [1e300], [1.0]], dtype=torch.float64), 1, False, ValueError, "codebook"),
    (torch.zeros(4, 2), 0, False, ValueError, "K"),
    (torch.zeros(4, 2), 4, False, ValueError, "K"),
    (torch.zeros(4, 2), -1, False, ValueError, "K"),
    (torch.zeros(4, 2), 2.0, False, TypeError, "K"),
    (torch.zeros(4, 2), True, False, TypeError, "K"),
    (torch.zeros(4, 2), 2, 1, TypeError, "normalize"),
])
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_bad_input(backend, device, codebook, K, normalize, exc, name):
    codebook = codebook.to(device) if isinstance(codebook, torch.Tensor) else codebook
    with pytest.raises(exc, match=f"^{name} "):
        lantern.ops.latent_neighbours(codebook, K, normalize=normalize)


# --- LlamaGen's shape (GPU) ----------------------------------------------------------------------

@pytest.mark.parametrize("backend", backends.params(["cuda", "triton"]), indirect=True)
@pytest.mark.gpu
@pytest.mark.parametrize("normalize", [False, True])
def test_gpu_llamagen_shape(backend, device, normalize):
    """V = 16384, d = 8, K = 1000 (LlamaGen's VQ-16 codebook): the whole table is valid, and equals the
    reference's on the exact backends."""
    codebook = random_codebook(16384, 8, seed=0, device=device)
    got = table(codebook, 1000, normalize=normalize)
    assert_neighbours_valid(codebook.cpu(), 1000, normalize, got)
    if backend in EXACT:
        assert torch.equal(got, reference_table(codebook, 1000, normalize))


ALL_BACKENDS = backends.params(backends.NAMES)  # reference, cpu, cuda, triton (skipped, with the reason, if unusable)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on non-finite inputs
def test_table_does_not_depend_on_the_codebook_layout(backend):
    """A non-contiguous codebook is normalised with the rounding of a contiguous one, so near-tied neighbours
    (here: both at squared distance ~1 from the zero row) do not swap with the layout: every backend gives one
    table for both layouts."""
    import lantern
    from lantern import ops

    codebook = torch.tensor([[0.0, 0.0, 0.0], [0.5684312582, -1.0845223665, -1.3985954523],
                             [0.4033468366, 0.8380263448, -0.7192575932]])
    transposed = codebook.t().contiguous().t()
    with lantern.fused("reference"):
        want = ops.latent_neighbours(codebook, 1, normalize=True)
    with lantern.fused(backend):
        assert torch.equal(ops.latent_neighbours(codebook, 1, normalize=True), want)
        assert torch.equal(ops.latent_neighbours(transposed, 1, normalize=True), want)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter on non-finite inputs
def test_row_whose_norm_overflows_raises(backend):
    """A row whose float32 L2 norm overflows (3.3e38 in one coordinate) would be 'normalised' to the zero row
    (x / inf), silently: with normalize=True it is refused. Without normalisation it is an ordinary (far
    away) code."""
    import lantern
    from lantern import ops

    codebook = torch.tensor([[3.3e38, -0.2, -0.3], [0.5, -1.0, -1.4], [0.4, 0.8, -0.7]])
    with lantern.fused(backend):
        with pytest.raises(ValueError, match="codebook row 0: its L2 norm overflows float32"):
            ops.latent_neighbours(codebook, 1, normalize=True)
        assert ops.latent_neighbours(codebook, 1, normalize=False).flatten().tolist() == [1, 2, 1]
