"""SPEC §6 compact_kv in Triton: one launch moves the kept tree nodes' K/V of every layer, in place.

The cache is one contiguous tensor [..., B, Hkv, Lmax, Dh] (e.g. [n_layer, 2, B, Hkv, Lmax, Dh]); a
program owns one (leading index, row b, kv head) slab of Lmax x Dh and moves its row's kept nodes:
position cache_len[b] + i <- position cache_len[b] + path_nodes[b, i] for i < n_keep[b]. Only the program
that owns a slab touches it, and it loads every kept source (a [BLOCK_P, BLOCK_D] tile) before a barrier
and stores after it, so overlapping, reordered or repeated moves read the old values, as the reference's
gather-then-scatter does. The programs of leading index 0, head 0 also write the new lengths, so the op is
a single launch. A copy: the result is bit-exact for every dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantern.ops import checks

from ._common import launcher, next_power_of_2

TILE_ELEMENTS = 8192  # BLOCK_P * BLOCK_D: the register tile of one load/store round


@triton.jit
def _compact_kv_kernel(cache, cache_len, path_nodes, n_keep, new_len, B, Hkv, Lmax, Dh, s_path_b, s_path_p,
                       BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr):
    slab = tl.program_id(0)  # (leading index, b, kv head), row-major
    b = (slab // Hkv) % B
    base = cache + slab.to(tl.int64) * Lmax * Dh
    length = tl.load(cache_len + b)
    kept = tl.load(n_keep + b)
    slot = tl.arange(0, BLOCK_P)
    keep = slot < kept
    node = tl.load(path_nodes + b.to(tl.int64) * s_path_b + slot * s_path_p, mask=keep, other=0)
    src = (length + node)[:, None] * Dh  # [P, 1] element offsets inside the slab
    dst = (length + slot)[:, None] * Dh
    for d0 in range(0, Dh, BLOCK_D):  # column chunks are disjoint, so each is read-all-then-write-all
        d = d0 + tl.arange(0, BLOCK_D)
        ok = keep[:, None] & (d < Dh)[None, :]
        moved = tl.load(base + src + d[None, :], mask=ok)  # [P, D]
        tl.debug_barrier()  # every source of this chunk is read before any destination is written
        tl.store(base + dst + d[None, :], moved, mask=ok)
    if (slab < B * Hkv) & (slab % Hkv == 0):  # leading index 0, kv head 0
        tl.store(new_len + b, length + kept)


def launch(cache: torch.Tensor, cache_len: torch.Tensor, path_nodes: torch.Tensor,
           n_keep: torch.Tensor) -> torch.Tensor:
    """cache [..., B, Hkv, Lmax, Dh] contiguous (modified in place), cache_len [B] int64, path_nodes [B, P]
    int64 (any strides), n_keep [B] int64 -> new lengths [B] (checks already ran)."""
    # programs read cache_len, n_keep and path_nodes while others write the cache: they must not share memory
    checks.not_overlapping("cache", cache, cache_len=cache_len, path_nodes=path_nodes, n_keep=n_keep)
    B, Hkv, Lmax, Dh = cache.shape[-4:]
    P = path_nodes.shape[1]
    new_len = torch.empty_like(cache_len)
    if cache.numel() == 0 or B == 0:
        return cache_len + n_keep
    block_p = next_power_of_2(P)
    block_d = max(1, min(next_power_of_2(Dh), TILE_ELEMENTS // block_p))
    n_slabs = cache.numel() // (Lmax * Dh)
    launcher(_compact_kv_kernel)[(n_slabs,)](cache, cache_len, path_nodes, n_keep, new_len, B, Hkv, Lmax, Dh,
                                                path_nodes.stride(0), path_nodes.stride(1), BLOCK_P=block_p,
                                                BLOCK_D=block_d)
    return new_len
