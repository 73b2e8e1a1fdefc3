"""compact_kv (SPEC §6): after a verification, move each row's kept tree nodes' K/V, every layer in one call,
to consecutive positions after its prefix, in place."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import checks as c
from . import library
from .reference.compact_kv import compact_kv as reference

# cache [..., B, Hkv, Lmax, Dh] (any float dtype, contiguous) is modified in place: for i < n_keep[b], position
# cache_len[b] + i <- cache_len[b] + path_nodes[b, i], every source read before anything is written (so any
# order is safe). cache_len, n_keep int64 [B]; path_nodes int64 [B, P], -1 padded. Returns cache_len + n_keep.
SCHEMA = "(Tensor(a!) cache, Tensor cache_len, Tensor path_nodes, Tensor n_keep) -> Tensor"


def fake(cache, cache_len, path_nodes, n_keep):
    return torch.empty_like(cache_len)


OP = library.Op("compact_kv", SCHEMA, fake, mutates=("cache",), backends={
    "reference": reference,                      # ops/reference/compact_kv.py
    "cpu": library.EXTENSION,                    # csrc/cpu/compact_kv.cpp
    "cuda": library.EXTENSION,                   # csrc/cuda/compact_kv.cu
    "triton": "lantern.kernels.compact_kv",
})


def compact_kv(cache, cache_len, path_nodes, n_keep, *, backend: Optional[str] = None) -> torch.Tensor:
    """§6: in place, move the kept tree nodes' K/V (all layers) to consecutive positions from
    ``cache_len``; returns the new lengths ``cache_len + n_keep``. ``backend``: which backend runs it
    (default: the one ``lantern.enable_fused`` / ``lantern.fused`` chose)."""
    check(cache, cache_len, path_nodes, n_keep)
    return _backend.dispatch("compact_kv", cache.device, backend)(cache, cache_len, path_nodes, n_keep)


def check(cache, cache_len, path_nodes, n_keep) -> None:
    """cache contiguous float [..., B, Hkv, Lmax, Dh], not requiring grad and sharing no memory with the
    other arguments; cache_len int64 [B] in [0, Lmax]; path_nodes int64
    [B, P]; n_keep int64 [B] in [0, P] with cache_len + n_keep <= Lmax; every path_nodes entry is -1 or
    a tree node whose position fits (cache_len + node < Lmax), and entries i < n_keep are not -1."""
    c.tensor("cache", cache, dtypes=c.FLOAT_DTYPES)
    if cache.dim() < 4:
        raise ValueError(f"cache must have shape [..., B, Hkv, Lmax, Dh], got {list(cache.shape)}")
    if not cache.is_contiguous():
        raise ValueError("cache must be contiguous (it is compacted in place)")
    B, Lmax = cache.shape[-4], cache.shape[-2]
    dev = cache.device
    c.tensor("cache_len", cache_len, shape=[B], dtypes=(torch.int64,), device=dev)
    c.tensor("path_nodes", path_nodes, ndim=2, dtypes=(torch.int64,), device=dev)
    c.tensor("path_nodes", path_nodes, shape=[B, None])
    c.tensor("n_keep", n_keep, shape=[B], dtypes=(torch.int64,), device=dev)
    if cache.requires_grad:
        raise ValueError("cache must not require grad: compact_kv modifies it in place (pass cache.detach())")
    c.not_overlapping("cache", cache, cache_len=cache_len, path_nodes=path_nodes, n_keep=n_keep)
    P = path_nodes.shape[1]
    if not c.scan_values():
        return
    bad_len = ((cache_len < 0) | (cache_len > Lmax)).any()
    bad_keep = ((n_keep < 0) | (n_keep > P) | (cache_len + n_keep > Lmax)).any()
    fits = (Lmax - cache_len)[:, None]  # [B, 1] tree positions that fit in the cache
    bad_nodes = ((path_nodes < -1) | (path_nodes >= fits)).any()
    kept = torch.arange(P, device=dev)[None, :] < n_keep[:, None]  # [B, P]
    missing = (kept & (path_nodes < 0)).any()
    if not bool(bad_len | bad_keep | bad_nodes | missing):  # one host sync; then the first fault's message
        return
    if bool(bad_len):
        raise ValueError(f"cache_len must be in [0, Lmax={Lmax}], got {cache_len.tolist()}")
    if bool(bad_keep):
        raise ValueError(f"n_keep must be in [0, P={P}] with cache_len + n_keep <= Lmax={Lmax}, "
                         f"got {n_keep.tolist()}")
    if bool(bad_nodes):
        raise ValueError("path_nodes entries must be -1 or tree nodes j with cache_len + j < Lmax")
    raise ValueError("path_nodes must not be -1 within the first n_keep entries of a row")
