"""A tie-aware checker for latent neighbour tables (SPEC §2), usable on any backend's output.

Backends may differ from the reference only where two distances are equal within float32 rounding
(different summation order, FMA, a different normalisation formula). The checker therefore judges a table
by float64 distances with a rounding tolerance, not by exact equality:

1. every entry is a valid code id, no row repeats an id, and no row lists its own code;
2. along each row, distances are nondecreasing (up to tolerance);
3. the row's set is the true K nearest up to swaps among near-equal distances: with t the K-th smallest
   true distance of the row, every listed code has distance <= t + tol, and every code with distance
   < t - tol is listed.

Memory is O(ROW_BLOCK * V), so it can check a full 16384-code table.

``exact_table`` is the other oracle: the exact table of the reference's float32 arithmetic (for small V).
"""
from __future__ import annotations

import numpy as np
import torch

ROW_BLOCK = 256
EPS32 = float(torch.finfo(torch.float32).eps)


def reference_rows(codebook: torch.Tensor, normalize: bool) -> torch.Tensor:
    """[V, d] float64 rows as §2 defines them (float32 values, optionally L2-normalised in float64)."""
    rows = codebook.detach().cpu().to(torch.float32).to(torch.float64)
    if normalize:
        rows = rows / rows.norm(dim=1, keepdim=True).clamp(min=1e-12)
    return rows


def distance_tolerance(dist: torch.Tensor, d: int, scale: float) -> torch.Tensor:
    """Rounding slack for float32 squared distances [*]: relative error of a d-term float32 sum (any order,
    with or without FMA), plus, when rows are normalised (``scale`` = their largest norm, else 0), the
    effect of ~eps relative error in the normalised rows themselves (|delta dist| ~ 4 eps |x - y| |x|).
    Without normalisation the slack is relative, so the ||x||^2 + ||y||^2 - 2 x.y expansion, which
    cancels for close codes far from the origin, is caught."""
    return 4 * (d + 2) * EPS32 * dist + 16 * EPS32 * scale * dist.sqrt() + 1e-30


def exact_table(codebook: torch.Tensor, K: int, normalize: bool) -> np.ndarray:
    """[V, K] int64: each row's other codes by (float32 squared distance summed over j in order, index), the
    order the reference and the cpu kernel produce exactly; the full V x V matrix, vectorised (V <= ~4096).
    Squared distances are >= +0, so their float32 bit patterns sort like their values: the (distance, index)
    order is the order of the uint64 keys (bits << 32) | index."""
    rows = codebook.detach().to(torch.float32)
    if normalize:
        rows = torch.nn.functional.normalize(rows, p=2.0, dim=1, eps=1e-12)
    c = rows.cpu().numpy()
    V, d = c.shape
    dist = np.zeros((V, V), dtype=np.float32)
    for j in range(d):
        diff = c[:, None, j] - c[None, :, j]
        dist += diff * diff
    keys = (dist.view(np.uint32).astype(np.uint64) << np.uint64(32)) | np.arange(V, dtype=np.uint64)[None, :]
    keys[np.arange(V), np.arange(V)] = np.iinfo(np.uint64).max  # not its own neighbour
    keys.sort(axis=1)
    return (keys[:, :K] & np.uint64(0xFFFFFFFF)).astype(np.int64)


def assert_neighbours_valid(codebook: torch.Tensor, K: int, normalize: bool, got: torch.Tensor) -> None:
    """Raise AssertionError unless ``got`` [V, K] is a valid §2 neighbour table for ``codebook``."""
    rows = reference_rows(codebook, normalize)  # [V, d]
    V, d = rows.shape
    assert tuple(got.shape) == (V, K), f"table shape {tuple(got.shape)}, expected {(V, K)}"
    assert got.dtype == torch.int32, f"table dtype {got.dtype}, expected int32"
    table = got.detach().cpu().to(torch.int64)  # [V, K]
    assert bool(((table >= 0) & (table < V)).all()), "table holds ids outside [0, V)"
    scale = float(rows.norm(dim=1).max()) if normalize else 0.0
    for start in range(0, V, ROW_BLOCK):
        _check_block(rows, table[start:start + ROW_BLOCK], start, scale)


def _check_block(rows: torch.Tensor, table: torch.Tensor, start: int, scale: float) -> None:
    """rows [V, d] float64; table [R, K] int64 listing the neighbours of codes start .. start + R - 1."""
    R, K = table.shape
    V, d = rows.shape
    row_ids = torch.arange(start, start + R)  # [R]
    dist = ((rows[row_ids, None, :] - rows[None, :, :]) ** 2).sum(-1)  # [R, V] float64
    dist[torch.arange(R), row_ids] = float("inf")  # a code is not its own neighbour
    listed = torch.gather(dist, 1, table)  # [R, K]
    tol = distance_tolerance(listed, d, scale)  # [R, K]

    sorted_ids = torch.sort(table, dim=1).values
    dup = (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(1)
    assert not bool(dup.any()), f"code {start + int(dup.nonzero()[0])} lists a neighbour twice"
    is_self = table == row_ids[:, None]
    assert not bool(is_self.any()), f"code {start + int(is_self.any(1).nonzero()[0])} lists itself"

    order_bad = listed[:, 1:] < listed[:, :-1] - torch.maximum(tol[:, 1:], tol[:, :-1])  # [R, K-1]
    assert not bool(order_bad.any()), (
        f"code {start + int(order_bad.any(1).nonzero()[0])}: neighbours not in nondecreasing distance")

    kth = torch.kthvalue(dist, K, dim=1).values[:, None]  # [R, 1] the true K-th smallest distance
    kth_tol = distance_tolerance(kth, d, scale)
    too_far = listed > kth + kth_tol  # [R, K]
    assert not bool(too_far.any()), (
        f"code {start + int(too_far.any(1).nonzero()[0])} lists a code farther than its K-th nearest")
    must_list = dist < kth - kth_tol  # [R, V]
    is_listed = torch.zeros(R, V, dtype=torch.bool).scatter_(1, table, True)
    missing = must_list & ~is_listed
    assert not bool(missing.any()), (
        f"code {start + int(missing.any(1).nonzero()[0])} misses a code nearer than its K-th nearest")
