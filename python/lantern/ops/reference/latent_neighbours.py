"""SPEC §2: the latent neighbour table, N[x] = the K codes nearest to code x (x excluded), nearest first.

The reference never builds the V x V distance matrix. It walks the matrix in (row tile x column tile)
blocks and keeps, for each row of the current row tile, a running top-K that every column tile is merged
into. Memory is O(V * K) for the output plus O(ROW_TILE * (K + COL_TILE)) for the working set.

Exact ordering. A candidate y of row x is ranked by the pair (dist(x, y), y), lexicographically. The
reference encodes the pair as one int64 key, ``float32 bits of dist << 32 | y``: for non-negative float32
values (squared distances, +inf included) the IEEE bit pattern read as an integer increases with the value,
so integer order on the keys is exactly lexicographic order on (dist, y), and no two keys are equal.
``torch.topk`` on the keys therefore gives the same answer however it breaks ties internally.

Distances are computed as in §2, by direct differences in float32, summed over the d coordinates in
increasing j: ``acc = 0; for j: acc += (c_xj - c_yj)^2``. (The ||x||^2 + ||y||^2 - 2 x.y expansion is
faster on matrix units but cancels catastrophically for close codes — exactly the pairs that matter here.)

``normalize``: LlamaGen's VQ-16 quantizer L2-normalises both the codebook rows and the encoder output
before its nearest-code lookup, so "nearness" in that model's latent space is nearness of normalised rows;
the project's models pass ``normalize=True``. The op's default is ``normalize=False`` because that is what
the upstream LANTERN code computed (raw codebook rows) and because it is the plain, unsurprising meaning
of "distance between codebook rows"; both are available. Normalisation is ``F.normalize`` (eps 1e-12)
applied to the float32 rows.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_TILE = 256
COL_TILE = 4096
_SELF_KEY = torch.iinfo(torch.int64).max  # a code is never its own neighbour


def codebook_float32(codebook: torch.Tensor, normalize: bool) -> torch.Tensor:
    """[V, d] float32 rows, L2-normalised when asked."""
    rows = codebook.detach().to(torch.float32).contiguous()  # the norms' rounding must not depend on the layout
    return F.normalize(rows, p=2.0, dim=1, eps=1e-12) if normalize else rows


def squared_distances(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """rows [R, d], cols [C, d] float32 -> [R, C] float32, sum_j (r_j - c_j)^2 accumulated in order j."""
    dist = torch.zeros(rows.shape[0], cols.shape[0], dtype=torch.float32, device=rows.device)  # [R, C]
    for j in range(rows.shape[1]):
        diff = rows[:, j, None] - cols[None, :, j]  # [R, C]
        dist.add_(diff * diff)
    return dist


def ranking_keys(dist: torch.Tensor, col_ids: torch.Tensor) -> torch.Tensor:
    """dist [R, C] float32 >= 0, col_ids [C] int64 -> int64 keys [R, C] ordered like (dist, col_id)."""
    dist_bits = dist.view(torch.int32).to(torch.int64)  # monotone in dist for dist >= 0
    return (dist_bits << 32) | col_ids[None, :]


def tile_top_k(rows: torch.Tensor, row_ids: torch.Tensor, codes: torch.Tensor, K: int) -> torch.Tensor:
    """Neighbours of the R codes ``rows`` (ids ``row_ids`` [R]) among all ``codes`` [V, d] -> int32 [R, K]."""
    V = codes.shape[0]
    best = torch.empty(rows.shape[0], 0, dtype=torch.int64, device=rows.device)  # [R, <=K] sorted keys
    for start in range(0, V, COL_TILE):
        col_ids = torch.arange(start, min(start + COL_TILE, V), device=rows.device)  # [C]
        keys = ranking_keys(squared_distances(rows, codes[start:start + COL_TILE]), col_ids)  # [R, C]
        keys.masked_fill_(row_ids[:, None] == col_ids[None, :], _SELF_KEY)
        merged = torch.cat([best, keys], dim=1)  # [R, <=K + C]
        best = torch.topk(merged, min(K, merged.shape[1]), dim=1, largest=False, sorted=True).values
    return (best & 0xFFFFFFFF).to(torch.int32)  # low 32 bits: the neighbour id


def latent_neighbours(codebook: torch.Tensor, K: int, normalize: bool = False) -> torch.Tensor:
    """codebook [V, d] float -> int32 [V, K]: row x lists the K codes y != x with the smallest
    (squared float32 distance, y), nearest first (SPEC §2). See the module docstring for ``normalize``."""
    codes = codebook_float32(codebook, normalize)  # [V, d]
    V = codes.shape[0]
    out = torch.empty(V, K, dtype=torch.int32, device=codes.device)  # [V, K]
    for start in range(0, V, ROW_TILE):
        row_ids = torch.arange(start, min(start + ROW_TILE, V), device=codes.device)  # [R]
        out[start:start + ROW_TILE] = tile_top_k(codes[row_ids], row_ids, codes, K)
    return out
