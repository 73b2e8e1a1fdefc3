"""Draft trees grown by a drafter from each row's root: chain, static (fixed shape, sampled drafts) and
dynamic (EAGLE-2: top-k per node, a beam of the best nodes per depth, the best N nodes overall).

A tree is (tokens [B, T], parents [B, T], depth [B, T], draft_probs [B, T, V] or None); node 0 is the
root (the last committed token). Builders allocate on the device of the root's tokens. Each grows depth by
depth; at each depth the drafter scores the whole
partial tree below the root (``Drafter.expand``), so its cache holds only committed tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from .. import ops
from ..guidance import guide
from ..ops.reference.philox import exponential_key
from ..ops.reference.tree import unpack_bits
from ..ops.tree_attention_op import _mask_words

DRAFT_SEED_SALT = 0x5DEECE66D  # the drafter's sampling stream: another Philox key than verify's


@dataclass
class Tree:
    tokens: torch.Tensor  # [B, T] int64
    parents: torch.Tensor  # [B, T] int64
    depth: Optional[torch.Tensor]  # [B, T] int64 (root 0); None: counted from the ancestor mask (``tree_inputs``)
    draft_probs: Optional[torch.Tensor]  # [B, T, V] (sampled drafts) or None (deterministic)
    draft_forwards: int
    layout: Optional[Tuple[int, ...]] = None  # the parents of every row, when the shape is fixed (chain, static)


def unguided_past_interval(cond: torch.Tensor, uncond: torch.Tensor, predicts: torch.Tensor,
                           cfg_interval: int) -> torch.Tensor:
    """LlamaGen's cfg_interval inside a tree: the unconditional logits, replaced by the conditional ones
    where the predicted token index is past cfg_interval. Guidance u + s (c - u) with u = c is exactly c,
    so those nodes are unguided while one verify call still covers the whole tree.
    cond / uncond [B, ..., V]; predicts [B, ...] int64."""
    if cfg_interval < 0:
        return uncond
    return torch.where((predicts > cfg_interval)[..., None], cond, uncond)


def guided_logits(logits: torch.Tensor, B: int, guided: bool, cfg_scale, predicts: torch.Tensor,
                  cfg_interval: int) -> torch.Tensor:
    """Classifier-free guidance (``guidance.guide``) of a model's rows: logits [rows, ..., V] ([cond; uncond]
    halves when guided, rows = 2B; else rows = B), predicts [B, ...] the token index each row of logits
    predicts (LlamaGen's cfg_interval) -> [B, ..., V]."""
    if not guided:
        return logits
    return guide(logits[:B], unguided_past_interval(logits[:B], logits[B:], predicts, cfg_interval), cfg_scale)


class DraftScorer:
    """Runs the drafter on partial trees and turns its logits into guided draft distributions.
    rows = 2B with guidance ([cond; uncond] halves), else B. With cfg_interval >= 0, logits that predict a
    token index past cfg_interval are not guided (LlamaGen's cfg_interval)."""

    def __init__(self, drafter, B: int, guided: bool, cfg_scale, positions_base: torch.Tensor, max_pos: int,
                 cfg_interval: int = -1):
        self.drafter, self.B, self.guided, self.cfg_scale = drafter, B, guided, cfg_scale
        self.positions_base, self.max_pos = positions_base, max_pos  # [B] raster index of the root
        self.cfg_interval = cfg_interval
        self.forwards = 0

    def guide(self, logits: torch.Tensor, predicts: torch.Tensor) -> torch.Tensor:
        """logits [rows, ..., V]; predicts [B, ...] the token index each row of logits predicts -> [B, ..., V]"""
        return guided_logits(logits, self.B, self.guided, self.cfg_scale, predicts, self.cfg_interval)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x, x]) if self.guided else x

    def score(self, tokens, parents, depth, parent_state, layout: Optional[Tuple[int, ...]] = None,
              tree_mask: Optional[torch.Tensor] = None):
        """Partial tree below the root: tokens/parents/depth [B, T] (parents -1 = root) and the drafter
        state of each node's parent [rows, T, S] -> guided logits [B, T, V], node states [rows, T, S].
        layout: the parents as a tuple when every row's tree has that shape (known on the host), so that its
        mask is made once per run; else tree_mask [B, T, W], the partial tree's mask if the caller has it."""
        positions = (self.positions_base[:, None] + depth).clamp(max=self.max_pos)
        mask = {}
        if getattr(self.drafter, "accepts_tree_mask", False):
            if layout is not None:
                mask = dict(tree_mask=partial_mask(layout, parent_state.shape[0], parents.device))
            elif tree_mask is not None:
                mask = dict(tree_mask=self.rows(tree_mask))
        logits, state = self.drafter.expand(self.rows(tokens), self.rows(parents), parent_state,
                                            self.rows(positions), **mask)
        self.forwards += 1
        return self.guide(logits, self.positions_base[:, None] + depth + 1), state


_PARTIAL_MASKS: dict = {}  # (parents, rows, device) -> the partial tree's packed mask [rows, T, W]


def partial_mask(parents: Tuple[int, ...], rows: int, device: torch.device) -> torch.Tensor:
    """``partial_tree_mask`` of a partial tree whose rows all have the parents ``parents`` (-1: the cached
    root), made once per shape."""
    key = (parents, rows, device)
    mask = _PARTIAL_MASKS.get(key)
    if mask is None:
        from ..models.drafter import partial_tree_mask

        mask = partial_tree_mask(torch.tensor(parents, device=device).expand(rows, -1))
        _PARTIAL_MASKS[key] = mask
    return mask


def _own_bits(T: int, device: torch.device) -> torch.Tensor:
    """[T, ceil(T/32)] int32: node i's own bit in its packed row (tree_attention's cache of them)."""
    return _mask_words(T, device)[0]


def grow_partial_mask(mask: torch.Tensor, new_parents: torch.Tensor) -> torch.Tensor:
    """``partial_tree_mask`` of a partial tree grown by a level: mask [B, T, W] the tree's so far, new_parents
    [B, n] the new nodes' parents (indices < T) -> [B, T + n, ceil((T + n)/32)]. A new node sees itself and
    what its parent sees: a few ops a level, where the closure over the whole tree takes dozens."""
    B, T, W = mask.shape
    T_new = T + new_parents.shape[1]
    W_new = (T_new + 31) // 32
    if W_new > W:
        mask = F.pad(mask, (0, W_new - W))
    seen = mask.gather(1, new_parents[..., None].expand(B, -1, W_new))  # [B, n, W_new]
    return torch.cat([mask, seen | _own_bits(T_new, mask.device)[T:]], 1)


def _gather_state(root_state, node_state, parents):
    """state of each node's parent: the root's for parents == -1, else node_state[parent]."""
    R, T = parents.shape[0], parents.shape[1]
    root = root_state[:, None].expand(R, T, root_state.shape[-1])
    if node_state is None:
        return root
    idx = parents.clamp(min=0)[..., None].expand(R, T, node_state.shape[-1])
    return torch.where((parents >= 0)[..., None], node_state.gather(1, idx), root)


def depths_from_mask(mask: torch.Tensor, T: int) -> torch.Tensor:
    """mask [B, T, W] packed ancestor bits (``ops.ancestor_mask``) -> [B, T] int64 each node's depth (root 0,
    padding 0): its ancestors, the bits of its row but its own."""
    return unpack_bits(mask, T).sum(-1) - 1


def draft_exponentials(seed: int, V: int, node_ids: torch.Tensor, offset: int,
                       rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float32 [B, N, V]: the Exp(1) variate of each (row, node, token) on the drafter's own Philox stream,
    counter (token, node id, row key, offset) with row keys ``rows`` [B] (default b) and node ids
    ``node_ids`` [B, N]. A tree's draws take them all at once, before its levels are drafted."""
    B, dev = node_ids.shape[0], node_ids.device
    row_keys = torch.arange(B, device=dev) if rows is None else rows
    u = ops.philox_uniform(seed ^ DRAFT_SEED_SALT, torch.arange(V, device=dev)[None, None, :],
                           node_ids[..., None], row_keys[:, None, None], offset)
    return exponential_key(u)


def draw_without_replacement(probs: torch.Tensor, m: int, exponentials: torch.Tensor) -> torch.Tensor:
    """m draws without replacement from probs [B, N, V] by the exponential keys ``exponentials`` [B, N, V]
    (``draft_exponentials``): the m smallest E_i / q_i, the lower token on ties (+inf keys, q_i = 0, in token
    order; SPEC §5 "Sampled drafts") -> tokens [B, N, m]."""
    keys = torch.where(probs > 0, exponentials / probs, float("inf"))
    if m == 1:
        return keys.argmin(-1, keepdim=True)  # the first of equal minima
    return keys.sort(dim=-1, stable=True).indices[..., :m]


def sample_without_replacement(probs: torch.Tensor, m: int, seed: int, node_ids: torch.Tensor, offset: int,
                               rows: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``draw_without_replacement`` of probs [B, N, V] (rows of node_ids [B, N]) by their own exponential keys
    (``draft_exponentials``) -> tokens [B, N, m]."""
    return draw_without_replacement(probs, m, draft_exponentials(seed, probs.shape[-1], node_ids, offset, rows))


def grow_chain(scorer: DraftScorer, root_tok, root_logits, root_state, depth: int, draft: Optional[Callable],
               offset: int) -> Tree:
    """A chain of `depth` drafts: top-1 (``draft`` None: deterministic), or one draw from each node's draft
    distribution (``draft``: ``DecodeState.draft``; draft d's Philox node id is d)."""
    B, dev = root_tok.shape[0], root_tok.device
    probs = []  # node d's draft distribution (its child was drawn from it)
    logits, node_state = root_logits, None  # [B, V] guided
    drafts = []  # [B] each
    all_parents = torch.arange(-1, depth - 1, device=dev).expand(B, -1)  # [B, depth] the drafts' partial tree
    all_depths = torch.arange(1, depth + 1, device=dev).expand(B, -1)
    node_ids = all_depths - 1 if draft is not None else None  # draft d's Philox node id is d
    for d in range(depth):
        if draft is not None:
            q, tok = draft(logits[:, None], 1, node_ids[:, d: d + 1], offset)  # [B, 1, V], [B, 1, 1]
            probs.append(q[:, 0])
            tok = tok[:, 0, 0]
        else:
            tok = logits.argmax(-1)
        drafts.append(tok)
        if d + 1 < depth:
            chain_tokens, chain_parents = torch.stack(drafts, 1), all_parents[:, : d + 1]  # [B, d + 1]
            # node i's parent is node i - 1 (the root for node 0): the root's state, then the chain's so far
            root = root_state[:, None]  # [rows, 1, S]
            parent_state = root if node_state is None else torch.cat([root, node_state], 1)  # [rows, d + 1, S]
            all_logits, node_state = scorer.score(chain_tokens, chain_parents, all_depths[:, : d + 1], parent_state,
                                                  layout=tuple(range(-1, d)))
            logits = all_logits[:, -1]
    T = depth + 1
    tree_tokens = torch.stack([root_tok, *drafts], 1)
    tree_parents = torch.arange(-1, T - 1, device=dev).expand(B, T).contiguous()
    draft_probs = None
    if draft is not None:
        draft_probs = torch.stack(probs + [torch.zeros_like(probs[0])], 1)  # node d's children drawn from probs[d]
    return Tree(tree_tokens, tree_parents, torch.arange(T, device=dev).expand(B, T).contiguous(), draft_probs,
                scorer.forwards, tuple(range(-1, T - 1)))


@dataclass(frozen=True)
class StaticLayout:
    """Host-side bookkeeping of a fixed static shape (BFS order), computed once per shape: no tensor work
    and no device reads inside the decoding loop."""
    parents: Tuple[int, ...]  # [T]
    depth: Tuple[int, ...]  # [T] (root 0)
    levels: Tuple[Tuple[int, ...], ...]  # node ids per depth 0..max
    draws: Tuple[int, ...]  # per depth d: children drawn per node of depth d (the most any node there has)
    kid_slot: Tuple[Tuple[int, ...], ...]  # per depth d: for each node of depth d + 1, its parent's index in level d
    kid_rank: Tuple[Tuple[int, ...], ...]  # per depth d: for each node of depth d + 1, its rank among its siblings


_LAYOUTS: dict = {}  # parents -> StaticLayout (a plain dict: torch.compile traces through it, not lru_cache)


def static_layout(parents: Tuple[int, ...]) -> StaticLayout:
    layout = _LAYOUTS.get(parents)
    if layout is None:
        layout = _LAYOUTS[parents] = _layout(parents)
    return layout


def _layout(parents: Tuple[int, ...]) -> StaticLayout:
    T = len(parents)
    depth = [0] * T
    for c in range(1, T):
        depth[c] = depth[parents[c]] + 1
    levels = tuple(tuple(i for i in range(T) if depth[i] == d) for d in range(max(depth) + 1))
    rank = [0] * T
    for c in range(1, T):
        rank[c] = sum(1 for s in parents[1:c] if s == parents[c])
    draws, slots, ranks = [], [], []
    for d in range(len(levels) - 1):
        kids = levels[d + 1]
        draws.append(max(rank[c] for c in kids) + 1)
        slots.append(tuple(levels[d].index(parents[c]) for c in kids))
        ranks.append(tuple(rank[c] for c in kids))
    return StaticLayout(tuple(parents), tuple(depth), levels, tuple(draws), tuple(slots), tuple(ranks))


def grow_static(scorer: DraftScorer, root_tok, root_logits, root_state, shape: List[int], draft: Callable,
                offset: int) -> Tree:
    """The fixed shape, children of each node drawn without replacement from the node's draft distribution
    (sampled drafts, EAGLE-1 / LANTERN++ style; ``draft``: ``DecodeState.draft``, a node's Philox node id its
    index). One drafter call and one draw per depth."""
    B, T, V, dev = root_tok.shape[0], len(shape), root_logits.shape[-1], root_tok.device
    layout = static_layout(tuple(shape))
    parents = torch.tensor(layout.parents, device=dev).expand(B, T).contiguous()
    depth = torch.tensor(layout.depth, device=dev)  # [T]
    tokens = torch.zeros(B, T, dtype=torch.int64, device=dev)
    tokens[:, 0] = root_tok
    draft_probs = torch.zeros(B, T, V, device=dev)
    level_logits = root_logits[:, None]  # [B, n, V] logits of the nodes of the current depth
    node_state = None
    n_levels = len(layout.levels)
    n_inner = layout.levels[-2][-1] + 1  # the nodes with children: every level's but the last (BFS order)
    node_ids = torch.arange(n_inner, device=dev).expand(B, -1)  # a node's Philox node id is its index
    for d in range(n_levels - 1):
        level, kids = layout.levels[d], layout.levels[d + 1]
        here = slice(level[0], level[-1] + 1)  # a level's nodes are contiguous (BFS order)
        q, draws = draft(level_logits, layout.draws[d], node_ids[:, here], offset)  # [B, n, V], [B, n, m]
        draft_probs[:, here] = q
        tokens[:, kids[0]: kids[-1] + 1] = draws[:, torch.tensor(layout.kid_slot[d], device=dev),
                                                 torch.tensor(layout.kid_rank[d], device=dev)]
        if d + 2 < n_levels:
            upto = kids[-1] + 1  # nodes 1..upto-1 form the partial tree (BFS order)
            sub_parents = parents[:, 1:upto] - 1  # partial-tree indices; the root becomes -1
            parent_state = _gather_state(root_state, node_state, scorer.rows(sub_parents))
            logits, node_state = scorer.score(tokens[:, 1:upto], sub_parents, depth[1:upto].expand(B, -1),
                                              parent_state, layout=tuple(p - 1 for p in layout.parents[1:upto]))
            level_logits = logits[:, kids[0] - 1: kids[-1]]
    return Tree(tokens, parents, depth.expand(B, T).contiguous(), draft_probs, scorer.forwards, layout.parents)


def grow_dynamic(scorer: DraftScorer, root_tok, root_logits, root_state, depth: int, top_per_node: int,
                 n_nodes: int) -> Tree:
    """EAGLE-2: expand the beam (the best `top_per_node` nodes of the last depth by cumulative draft
    log-probability) by each node's top `top_per_node` tokens; after `depth` levels keep the best
    `n_nodes` of all candidates (lantern.ops.build_tree). Deterministic drafts."""
    B, k, dev = root_tok.shape[0], top_per_node, root_tok.device
    logp = torch.log_softmax(root_logits, -1)  # [B, V]
    scores, toks = logp.topk(k, dim=-1)  # [B, k]
    cand_tokens, cand_parents, cand_scores = [toks], [torch.full((B, k), -1, device=dev)], [scores]
    beam_cand = torch.arange(k, device=dev).expand(B, k)  # candidate index of each beam node
    beam_scores = scores
    # the partial tree = the beams of all depths so far; partial index of each beam node
    tree_tokens, tree_parents, tree_depth = toks, torch.full((B, k), -1, device=dev), \
        torch.ones(B, k, dtype=torch.int64, device=dev)
    tree_mask = _own_bits(k, dev).expand(B, k, -1).contiguous()  # [B, T, W] the partial tree's mask
    node_state = None
    n_cand = k
    for d in range(1, depth):
        parent_state = _gather_state(root_state, node_state, scorer.rows(tree_parents))
        logits, node_state = scorer.score(tree_tokens, tree_parents, tree_depth, parent_state, tree_mask=tree_mask)
        beam_logp = torch.log_softmax(logits[:, -k:], -1)  # [B, k, V] the newest beam level
        child_scores, child_toks = (beam_scores[..., None] + beam_logp).topk(k, dim=-1)  # [B, k, k]
        flat_scores, flat_toks = child_scores.reshape(B, k * k), child_toks.reshape(B, k * k)
        flat_parent_cand = beam_cand[:, :, None].expand(B, k, k).reshape(B, k * k)
        cand_tokens.append(flat_toks)
        cand_parents.append(flat_parent_cand)
        cand_scores.append(flat_scores)
        # next beam: the best k of these k*k candidates
        beam_scores, pick = flat_scores.topk(k, dim=-1)  # [B, k]
        beam_cand = n_cand + pick
        n_cand += k * k
        beam_parent_partial = (d - 1) * k + pick // k  # the picked child's parent is beam node pick // k
        tree_tokens = torch.cat([tree_tokens, flat_toks.gather(1, pick)], 1)
        tree_parents = torch.cat([tree_parents, beam_parent_partial], 1)
        tree_depth = torch.cat([tree_depth, torch.full((B, k), d + 1, device=dev)], 1)
        if d + 1 < depth:  # the last level is not scored
            tree_mask = grow_partial_mask(tree_mask, beam_parent_partial)
    tokens, parents = ops.build_tree(torch.cat(cand_tokens, 1), torch.cat(cand_parents, 1),
                                     torch.cat(cand_scores, 1), root_tok, min(n_nodes, n_cand))
    return Tree(tokens, parents, None, None, scorer.forwards)  # depth: the mask's bit counts, a few ops
