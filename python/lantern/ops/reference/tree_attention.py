"""SPEC §6: attention of a batch of draft trees over each row's KV cache (the verification forward).

The readable definition: build the dense boolean mask [B, T, Lmax] (prefix positions, plus the tree
positions of each query's ancestors), then masked softmax attention in float32."""
from __future__ import annotations

import math

import torch

from .tree import unpack_bits


def attention_mask(cache_len: torch.Tensor, tree_mask: torch.Tensor, T: int, Lmax: int) -> torch.Tensor:
    """cache_len [B] int64, tree_mask [B, T, W] int32 -> bool [B, T, Lmax]: may query i of row b read
    cache position pos? Yes iff pos < cache_len[b], or pos = cache_len[b] + j with bit j of node i set."""
    positions = torch.arange(Lmax, device=cache_len.device)  # [Lmax]
    in_prefix = positions[None, :] < cache_len[:, None]  # [B, Lmax]
    tree_index = positions[None, :] - cache_len[:, None]  # [B, Lmax]; node j for tree positions
    in_tree = (tree_index >= 0) & (tree_index < T)  # [B, Lmax]
    tree_bits = unpack_bits(tree_mask, T)  # [B, T(query), T(key node)]
    node_of_pos = tree_index.clamp(0, T - 1)[:, None, :].expand(-1, T, -1)  # [B, T, Lmax]
    bit_at_pos = torch.gather(tree_bits, 2, node_of_pos)  # [B, T, Lmax]
    return in_prefix[:, None, :] | (in_tree[:, None, :] & bit_at_pos)


def poisoned_queries(scores: torch.Tensor, vals: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """scores [B, H, T, Lmax], vals [B, H, Lmax, Dh], allowed [B, T, Lmax] -> bool [B, H, T]: the queries
    with a non-finite score (q or a key holds NaN / inf) or a non-finite value at a position they attend to."""
    bad_score = (~torch.isfinite(scores) & allowed[:, None]).any(-1)  # [B, H, T]
    bad_value = ~torch.isfinite(vals).all(-1)  # [B, H, Lmax]
    return bad_score | (allowed[:, None] & bad_value[:, :, None, :]).any(-1)


def tree_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor,
                   tree_mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, Dh], k_cache/v_cache [B, Hkv, Lmax, Dh], cache_len [B] int64, tree_mask [B, T, W] int32
    -> o [B, H, T, Dh] in q's dtype. Query head h reads kv head h // (H / Hkv) (GQA); scale 1/sqrt(Dh);
    float32 math. The tree's own keys/values are already in the cache at cache_len[b] + (0..T-1).
    Non-finite values are never hidden: a query whose scores or attended values hold NaN or inf (corrupt
    q, K or V) gets NaN in every element of its output. Values a query does not attend to cannot reach its
    output, whatever they hold (positions >= cache_len[b] + T, and tree nodes that are not its ancestors)."""
    B, H, T, Dh = q.shape
    Hkv, Lmax = k_cache.shape[1], k_cache.shape[2]
    group = H // Hkv
    keys = k_cache.to(torch.float32).repeat_interleave(group, dim=1)  # [B, H, Lmax, Dh]
    vals = v_cache.to(torch.float32).repeat_interleave(group, dim=1)  # [B, H, Lmax, Dh]
    scores = torch.matmul(q.to(torch.float32), keys.transpose(-1, -2)) / math.sqrt(Dh)  # [B, H, T, Lmax]
    allowed = attention_mask(cache_len, tree_mask, T, Lmax)  # [B, T, Lmax]
    poisoned = poisoned_queries(scores, vals, allowed)  # [B, H, T]
    vals = torch.where(torch.isfinite(vals), vals, 0.0)  # so 0 weight x garbage stays 0
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [B, H, T, Lmax]
    out = torch.matmul(weights, vals).masked_fill(poisoned[..., None], float("nan"))
    return out.to(q.dtype)
