"""Draft-tree helpers (SPEC §3 layout, §6 mask): the packed ancestor mask and EAGLE-2 tree selection."""
from __future__ import annotations

import torch

from .. import checks


def ancestor_matrix(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, T] int64 -> bool [B, T, T]; [b, i, j] is True iff j == i or j is an ancestor of i.

    Pointer doubling (ceil(log2 T) steps, no loop over nodes): after step s, ``is_anc[b, i]`` holds i's
    ancestors at distance < 2^s and ``jump[b, i]`` is i's 2^s-th ancestor (-1 past the root); then
    i's ancestors at distance < 2^(s+1) are those of i plus those of jump[i]. Padding nodes (parent -1)
    and the root see only themselves."""
    B, T = parents.shape
    node_ids = torch.arange(T, device=parents.device)
    is_anc = (node_ids[:, None] == node_ids[None, :]).expand(B, T, T).clone()  # [B, T, T]
    jump = parents.clone()  # [B, T]
    for _ in range(max(1, (T - 1).bit_length())):  # a fixed count: no host read of the values
        has_jump = jump >= 0  # [B, T]
        from_jump = torch.gather(is_anc, 1, jump.clamp(min=0)[:, :, None].expand(B, T, T))  # [B, T, T]
        is_anc |= has_jump[:, :, None] & from_jump
        jump = torch.where(has_jump, torch.gather(jump, 1, jump.clamp(min=0)), jump)
    return is_anc


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """bool [..., T] -> int32 [..., ceil(T/32)]: bit j % 32 of word j // 32 holds bits[..., j].

    The words are assembled as uint32 values in int64 and then wrapped to int32 (bit 31 set -> negative)."""
    T = bits.shape[-1]
    n_words = (T + 31) // 32
    padded = torch.nn.functional.pad(bits, (0, 32 * n_words - T))  # [..., 32 * W]
    weights = torch.ones(32, dtype=torch.int64, device=bits.device) << torch.arange(32, device=bits.device)
    words = (padded.reshape(*bits.shape[:-1], n_words, 32).to(torch.int64) * weights).sum(-1)  # [..., W]
    words = torch.where(words >= 2**31, words - 2**32, words)  # uint32 -> int32 two's complement
    return words.to(torch.int32)


def unpack_bits(words: torch.Tensor, T: int) -> torch.Tensor:
    """int32 [..., W] -> bool [..., T], the inverse of ``pack_bits``."""
    j = torch.arange(T, device=words.device)
    # index_select, not words[..., j // 32]: advanced indexing on the last dimension costs 3-100x more
    # (python -m bench, "checks" rows; the spread is the machine's load)
    word_of_j = words.index_select(-1, j // 32)  # [..., T]
    return ((word_of_j >> (j % 32)) & 1).bool()


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [B, T] int64 -> int32 [B, T, ceil(T/32)]: bit j of node i set iff j is i or an ancestor."""
    return pack_bits(ancestor_matrix(parents))


def select_candidates(cand_scores: torch.Tensor, n_nodes: int) -> torch.Tensor:
    """cand_scores [B, M] -> int64 [B, n_nodes]: the n_nodes best candidates by (score descending,
    index ascending), listed in increasing candidate index."""
    ranked = torch.sort(cand_scores, dim=1, descending=True, stable=True).indices  # [B, M]
    return torch.sort(ranked[:, :n_nodes], dim=1).values


def selection_is_ancestor_closed(cand_parents: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """cand_parents [B, M], chosen [B, n] -> bool [B]: every chosen candidate's parent is the root or chosen."""
    is_chosen = torch.zeros(cand_parents.shape, dtype=torch.bool, device=cand_parents.device)  # [B, M]
    is_chosen.scatter_(1, chosen, True)
    chosen_parents = torch.gather(cand_parents, 1, chosen)  # [B, n]
    parent_chosen = torch.gather(is_chosen, 1, chosen_parents.clamp(min=0))  # [B, n]
    return ((chosen_parents < 0) | parent_chosen).all(dim=1)


def build_tree(cand_tokens: torch.Tensor, cand_parents: torch.Tensor, cand_scores: torch.Tensor,
               root_token: torch.Tensor, n_nodes: int):
    """EAGLE-2 tree selection -> (tokens [B, n_nodes+1] int64, parents [B, n_nodes+1] int64).

    cand_tokens/cand_parents/cand_scores [B, M]: the expansion's candidates; cand_parents[b, m] < m is the
    candidate index of m's parent, or -1 when the parent is the root; cand_scores are cumulative draft
    log-probabilities. The n_nodes best candidates by (score descending, index ascending) become nodes
    1..n_nodes in increasing candidate index (a topological order, since parents precede children);
    node 0 is the root (token root_token, parent -1). Because a child's cumulative score never exceeds
    its parent's, and ties go to the lower (parent's) index, the chosen set contains every chosen node's
    parent; a set that does not (scores increasing along a path) is an error."""
    B, M = cand_tokens.shape
    chosen = select_candidates(cand_scores, n_nodes)  # [B, n] candidate indices, increasing
    if checks.scan_values() and not bool(selection_is_ancestor_closed(cand_parents, chosen).all()):
        raise ValueError("cand_scores: the selected candidates are not ancestor-closed "
                         "(a candidate scores higher than its parent)")
    node_of_cand = torch.full((B, M), -1, dtype=torch.int64, device=cand_tokens.device)  # [B, M]
    node_ids = torch.arange(1, n_nodes + 1, device=cand_tokens.device).expand(B, n_nodes)  # [B, n]
    node_of_cand.scatter_(1, chosen, node_ids)
    chosen_parents = torch.gather(cand_parents, 1, chosen)  # [B, n] candidate index or -1 (root)
    node_parents = torch.where(chosen_parents < 0, 0, torch.gather(node_of_cand, 1, chosen_parents.clamp(min=0)))
    root_parent = torch.full((B, 1), -1, dtype=torch.int64, device=cand_tokens.device)
    tokens = torch.cat([root_token.to(torch.int64)[:, None], torch.gather(cand_tokens, 1, chosen)], dim=1)
    parents = torch.cat([root_parent, node_parents], dim=1)
    return tokens, parents
