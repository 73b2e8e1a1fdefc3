"""SPEC §6: after acceptance, move the kept tree nodes' K/V to consecutive cache positions, in place."""
from __future__ import annotations

import torch


def compact_kv(cache: torch.Tensor, cache_len: torch.Tensor, path_nodes: torch.Tensor,
               n_keep: torch.Tensor) -> torch.Tensor:
    """cache [..., B, Hkv, Lmax, Dh] (e.g. [n_layers, 2, B, Hkv, Lmax, Dh]: every layer's K and V) is
    modified in place; cache_len [B] int64; path_nodes [B, P] int64, the tree nodes to keep in order
    (root 0 first, then the accepted path), -1 padded; n_keep [B] int64 <= P.

    Tree node j of row b sits at position cache_len[b] + j. For i < n_keep[b]:
    position cache_len[b] + i <- position cache_len[b] + path_nodes[b, i], for every leading index and
    head. All sources are read before anything is written, so overlapping moves are safe.
    Returns the new lengths cache_len + n_keep (a new tensor)."""
    P = path_nodes.shape[1]
    slot = torch.arange(P, device=cache.device)  # [P]
    keep = slot[None, :] < n_keep[:, None]  # [B, P]
    rows, slots = keep.nonzero(as_tuple=True)  # [n] each: the (row, slot) pairs to move
    src = cache_len[rows] + path_nodes[rows, slots]  # [n] source positions
    dst = cache_len[rows] + slots  # [n] destination positions
    moved = cache[..., rows, :, src, :]  # [n, *leading, Hkv, Dh]; advanced indexing copies (gather first)
    cache[..., rows, :, dst, :] = moved
    return cache_len + n_keep
