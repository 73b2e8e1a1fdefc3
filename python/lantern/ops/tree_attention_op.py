"""tree_attention (SPEC §6): attention of T tree queries over each row's cached prefix plus their ancestors in
the tree (a packed ancestor mask)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import checks as c
from . import library
from .reference.tree import pack_bits
from .reference.tree_attention import tree_attention as reference

# q [B, H, T, Dh]; k_cache, v_cache [B, Hkv, Lmax, Dh] (q's dtype, stride-1 last dimension); cache_len int64
# [B]; tree_mask int32 [B, T, ceil(T/32)] -> o [B, H, T, Dh] in q's dtype (float32 math).
SCHEMA = "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_len, Tensor tree_mask) -> Tensor"


def fake(q, k_cache, v_cache, cache_len, tree_mask):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


OP = library.Op("tree_attention", SCHEMA, fake, backends={
    "reference": reference,                      # ops/reference/tree_attention.py
    "cpu": library.EXTENSION,                    # csrc/cpu/tree_attention.cpp
    "cuda": library.EXTENSION,                   # csrc/cuda/tree_attention.cu
    "triton": "lantern.kernels.tree_attention",
})


def tree_attention(q, k_cache, v_cache, cache_len, tree_mask, *, backend: Optional[str] = None) -> torch.Tensor:
    """§6: attention of T tree queries over each row's cached prefix plus its ancestors in the tree.
    ``backend``: which backend runs it (default: the one ``lantern.enable_fused`` / ``lantern.fused`` chose)."""
    check(q, k_cache, v_cache, cache_len, tree_mask)
    return _backend.dispatch("tree_attention", q.device, backend)(q, k_cache, v_cache, cache_len, tree_mask)


def check(q, k_cache, v_cache, cache_len, tree_mask) -> None:
    """q [B, H, T, Dh]; k_cache, v_cache [B, Hkv, Lmax, Dh] of q's dtype and device, H % Hkv == 0, last
    dimensions contiguous; cache_len int64 [B] with 0 <= cache_len and cache_len + T <= Lmax;
    tree_mask int32 [B, T, ceil(T/32)] with each node's own bit set and no bit for a node >= T."""
    c.tensor("q", q, ndim=4, dtypes=c.FLOAT_DTYPES)
    B, H, T, Dh = q.shape
    dev = q.device
    if B < 1 or H < 1 or T < 1 or Dh < 1:
        raise ValueError(f"q must have non-empty dimensions [B, H, T, Dh], got {list(q.shape)}")
    c.tensor("k_cache", k_cache, ndim=4, dtypes=(q.dtype,), device=dev)
    Hkv, Lmax = k_cache.shape[1], k_cache.shape[2]
    c.tensor("k_cache", k_cache, shape=[B, None, None, Dh])
    c.tensor("v_cache", v_cache, shape=list(k_cache.shape), dtypes=(q.dtype,), device=dev)
    if Hkv < 1 or H % Hkv != 0:
        raise ValueError(f"k_cache has {Hkv} heads; the query heads H={H} must be a multiple of it (GQA)")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        c.last_dim_contiguous(name, t)
    c.tensor("cache_len", cache_len, shape=[B], dtypes=(torch.int64,), device=dev)
    c.tensor("tree_mask", tree_mask, shape=[B, T, (T + 31) // 32], dtypes=(torch.int32,), device=dev)
    if not c.scan_values() or _ATTENTION_INPUTS.known((cache_len, tree_mask), (T, Lmax)):
        return
    bad_len = ((cache_len < 0) | (cache_len + T > Lmax)).any()
    no_self, past_tree = _tree_mask_faults(tree_mask, T)
    if bool(bad_len | no_self | past_tree):  # one host sync; then the message of the first fault
        if bool(bad_len):
            raise ValueError(f"cache_len must satisfy 0 <= cache_len and cache_len + T <= Lmax "
                             f"(T={T}, Lmax={Lmax}), got {cache_len.tolist()}")
        if bool(no_self):
            raise ValueError("tree_mask must set bit i of node i (every node attends to itself)")
        raise ValueError(f"tree_mask sets a bit for a node >= T={T} (past the tree)")
    _ATTENTION_INPUTS.remember((cache_len, tree_mask), (T, Lmax))


# the (cache_len, tree_mask) pairs scanned last: a forward passes every layer the same pair
_ATTENTION_INPUTS = c.RecentlyValid()


def _tree_mask_faults(tree_mask: torch.Tensor, T: int):
    """(some node lacks its own bit, some bit names a node >= T) as 0-d bool tensors (no host sync), tested
    on the packed words against two constant word tables."""
    own, outside = _mask_words(T, tree_mask.device)
    return ((tree_mask & own) != own).any(), (tree_mask & outside).any()


_MASK_WORDS: dict = {}  # (T, device) -> (own [T, W], outside [W]) int32 words


def _mask_words(T: int, device: torch.device):
    """own[i] = node i's own bit in its packed row, outside = the bits of nodes >= T (per word)."""
    key = (T, device)
    if key not in _MASK_WORDS:
        own = pack_bits(torch.eye(T, dtype=torch.bool))  # [T, ceil(T/32)]
        inside = pack_bits(torch.ones(1, T, dtype=torch.bool))[0]  # [ceil(T/32)]
        outside = ~inside  # bits 32W > j >= T
        _MASK_WORDS[key] = (own.to(device), outside.to(device))
    return _MASK_WORDS[key]
