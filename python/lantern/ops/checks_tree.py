"""Argument checks for latent_neighbours, build_tree, tree_attention and compact_kv (SPEC §9).

Each raises TypeError (wrong kind of object or dtype) or ValueError (wrong shape, device or value) with a
message that starts with the argument's name. They run before any backend, so every backend rejects the
same inputs; a kernel may therefore assume everything checked here."""
from __future__ import annotations

import numbers

import torch

from . import checks as c


def _int_arg(name: str, value, lo: int, hi: int) -> int:
    """A Python (or numpy) integer, not a bool, with lo <= value <= hi."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {int(value)}")
    return int(value)


def _last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


def check_latent_neighbours(codebook, K, normalize) -> None:
    """codebook [V, d] float, finite in float32 (and, to be normalised, with finite float32 row norms), V >= 2,
    d >= 1; K int in [1, V-1]; normalize bool."""
    c.tensor("codebook", codebook, ndim=2, dtypes=c.FLOAT_DTYPES)
    V, d = codebook.shape
    if V < 2 or d < 1:
        raise ValueError(f"codebook must have at least 2 rows and 1 column, got shape {list(codebook.shape)}")
    _int_arg("K", K, 1, V - 1)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    if not c.scan_values():
        return
    rows = codebook.detach().to(torch.float32).contiguous()  # [V, d] what every backend computes with
    if not bool(torch.isfinite(rows).all()):
        raise ValueError("codebook contains NaN or infinite values (in float32)")
    if normalize:  # a row whose float32 norm overflows would be "normalised" to zero
        norms = rows.norm(2, dim=1)  # [V]
        if not bool(torch.isfinite(norms).all()):
            row = int((~torch.isfinite(norms)).nonzero()[0])
            raise ValueError(f"codebook row {row}: its L2 norm overflows float32, so it cannot be normalised "
                             f"(normalize=True); scale the codebook down")


def check_build_tree(cand_tokens, cand_parents, cand_scores, root_token, n_nodes) -> None:
    """cand_tokens/cand_parents int64 [B, M], cand_scores float [B, M] without NaN/+inf, root_token int64 [B],
    tokens >= 0, -1 <= cand_parents[b, m] < m, n_nodes int in [0, M], and the selected set ancestor-closed."""
    c.tensor("cand_tokens", cand_tokens, ndim=2, dtypes=(torch.int64,))
    B, M = cand_tokens.shape
    dev = cand_tokens.device
    c.tensor("cand_parents", cand_parents, shape=[B, M], dtypes=(torch.int64,), device=dev)
    c.tensor("cand_scores", cand_scores, shape=[B, M], dtypes=c.FLOAT_DTYPES, device=dev)
    c.tensor("root_token", root_token, shape=[B], dtypes=(torch.int64,), device=dev)
    n_nodes = _int_arg("n_nodes", n_nodes, 0, M)
    if not c.scan_values():
        return
    for name, t in (("cand_tokens", cand_tokens), ("root_token", root_token)):
        if bool((t < 0).any()):
            raise ValueError(f"{name} must be >= 0 (token ids), got {t.min().item()}")
    cand_ids = torch.arange(M, device=dev)
    if bool(((cand_parents < -1) | (cand_parents >= cand_ids)).any()):
        raise ValueError("cand_parents must satisfy -1 <= cand_parents[b, m] < m (parents come first; -1 = root)")
    c.no_nan("cand_scores", cand_scores)
    from .reference.tree import select_candidates, selection_is_ancestor_closed

    chosen = select_candidates(cand_scores, n_nodes)
    if not bool(selection_is_ancestor_closed(cand_parents, chosen).all()):
        raise ValueError("cand_scores must not increase from a candidate to its child: the n_nodes best "
                         "candidates are not ancestor-closed")


def check_tree_attention(q, k_cache, v_cache, cache_len, tree_mask) -> None:
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
        _last_dim_contiguous(name, t)
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
        from .reference.tree import pack_bits

        own = pack_bits(torch.eye(T, dtype=torch.bool))  # [T, ceil(T/32)]
        inside = pack_bits(torch.ones(1, T, dtype=torch.bool))[0]  # [ceil(T/32)]
        outside = ~inside  # bits 32W > j >= T
        _MASK_WORDS[key] = (own.to(device), outside.to(device))
    return _MASK_WORDS[key]


def check_compact_kv(cache, cache_len, path_nodes, n_keep) -> None:
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
