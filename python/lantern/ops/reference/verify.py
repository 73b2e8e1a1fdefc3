"""§3-5: verify a batch of draft trees — the readable, row-vectorised definition.

Each row walks its tree from the root. The walk only ever moves to higher node indices (children come
after their parent and are tried in index order), so one pass over candidate nodes c = 1..T-1, with every
row testing c iff c is a child of the node that row currently stands on, walks all rows at once.
Per-row state: the node, its current (residual) distribution p [B, V], the drafter's q' [B, V] for
sampled drafts, and the node budget's moved mass M and undecided mass R (both in P_node's scale).
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .philox import ACCEPT_COUNTER, exponential_key, philox_uniform
from .process_logits import compute_dtype, guide, process_logits, row_setting

FAULTS = ("wrong_residual", "reused_uniform", "off_by_one")  # deliberate bugs for negative controls


class VerifyResult(NamedTuple):
    accept_len: torch.Tensor  # [B] int64: drafted tokens accepted
    path: torch.Tensor  # [B, T-1] int64: accepted node indices (root excluded), -1 padded
    next_token: torch.Tensor  # [B] int64: the residual / bonus / greedy token after the path
    node_status: torch.Tensor  # [B, T] int8: 1 accepted (greedy: passed), 0 rejected, -1 not tested


def _int(value) -> int:
    return int(value.item()) if isinstance(value, torch.Tensor) else int(value)


def merge_neighbours(p, x, neighbours, k, budget, faults=()) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """§3.1 for candidates x [R] under distributions p [R, V] with budgets [R].
    Returns (p~(x) [R], merged neighbour ids [R, k] with -1 past m*, merged mass c_{m*} [R])."""
    p_x = p.gather(1, x[:, None]).squeeze(1)
    if k == 0:
        return p_x, x.new_full((x.shape[0], 0), -1), torch.zeros_like(p_x)
    nbrs = neighbours[x, :k].to(torch.int64)  # [R, k]
    cum = p.gather(1, nbrs).cumsum(1)  # c_1..c_k, nondecreasing
    m_star = (cum <= budget[:, None]).sum(1)  # max m with c_m <= b (c_0 = 0 <= b always)
    if "off_by_one" in faults:
        m_star = (m_star + 1).clamp(max=k)
    mass = torch.where(m_star > 0, cum.gather(1, (m_star - 1).clamp(min=0)[:, None]).squeeze(1), 0)
    merged = torch.where(torch.arange(k, device=x.device) < m_star[:, None], nbrs, -1)
    return p_x + mass, merged, mass


def collapse_onto(p, x, merged, p_tilde) -> torch.Tensor:
    """p~_x: p with the mass of A(x) \\ {x} moved onto x."""
    # count-based mask: scatter with the -1 padding clamped to 0 must not race a real neighbour 0
    hits = torch.zeros_like(p, dtype=torch.int32).scatter_add_(1, merged.clamp(min=0), (merged >= 0).to(torch.int32))
    out = torch.where(hits > 0, 0.0, p)
    return out.scatter(1, x[:, None], p_tilde[:, None].to(out.dtype))


def _normalise(w: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    total = w.sum(1)
    return torch.where(total[:, None] > 0, w / total.clamp(min=torch.finfo(w.dtype).tiny)[:, None], 0), total


def exponential_race(weights, nodes, row_keys, seed, offset) -> torch.Tensor:
    """§5: argmin_i E_i / w_i over w_i > 0 (lower index on ties); E keyed by (token, node, row key, offset)
    with row_keys [B] the counter's row word of each row."""
    V = weights.shape[1]
    token_ids = torch.arange(V, device=weights.device)
    u = philox_uniform(seed, token_ids[None, :], nodes[:, None], row_keys[:, None], offset)
    keys = exponential_key(u).to(weights.dtype) / weights
    keys = torch.where(weights > 0, keys, float("inf"))
    return keys.argmin(1)


def _sampling_walk(probs, tokens, parents, neighbours, draft_probs, k, delta, lam, budget, seed, offset, row_keys,
                   faults):
    B, T, V = probs.shape
    rows = torch.arange(B, device=probs.device)
    node = torch.zeros(B, dtype=torch.int64, device=probs.device)
    p = probs[:, 0].clone()  # [B, V] the current distribution at `node` (residual after rejections)
    q = _normalise(draft_probs[:, 0].to(p.dtype))[0] if draft_probs is not None else None  # [B, V] q'
    moved = torch.zeros(B, dtype=p.dtype, device=p.device)  # M
    undecided = torch.ones(B, dtype=p.dtype, device=p.device)  # R
    status = torch.full((B, T), -1, dtype=torch.int8, device=p.device)
    path = torch.full((B, max(T - 1, 0)), -1, dtype=torch.int64, device=p.device)
    accept_len = torch.zeros(B, dtype=torch.int64, device=p.device)
    for c in range(1, T):
        tested = parents[:, c] == node  # [B]
        if not bool(tested.any()):
            continue
        x = tokens[:, c].clamp(min=0)
        if lam is not None:
            b = (lam - 1.0) * p.gather(1, x[:, None]).squeeze(1)
        elif budget == "node":
            b = torch.where(undecided > 0, (delta - moved) / undecided.clamp(min=torch.finfo(p.dtype).tiny), 0)
            b = b.clamp(min=0)
        else:
            b = torch.full((B,), float(delta), dtype=p.dtype, device=p.device)
        p_tilde, merged, mass = merge_neighbours(p, x, neighbours, k, b, faults)
        u_node = 0 if "reused_uniform" in faults else c
        u = philox_uniform(seed, ACCEPT_COUNTER, u_node, row_keys, offset).to(p.dtype)  # [B]
        if q is None:
            accept = u < p_tilde
        else:
            accept = u * q.gather(1, x[:, None]).squeeze(1) < p_tilde
        accept &= tested
        reject = tested & ~accept
        status[:, c] = torch.where(tested, accept.to(torch.int8), status[:, c])

        # rejected rows: the §3.2 residual
        p_tilde_x = collapse_onto(p, x, merged, p_tilde)
        if q is None:
            residual = p_tilde_x.scatter(1, x[:, None], 0.0)  # zero exactly A(x)
        else:
            residual = (p_tilde_x - q).clamp(min=0)
        if "wrong_residual" in faults:
            residual = p
        residual, residual_mass = _normalise(residual)
        moved = torch.where(reject, moved + undecided * mass, moved)
        undecided = torch.where(reject, undecided * residual_mass, undecided)
        p = torch.where(reject[:, None], residual, p)
        if q is not None:
            q_without_x = _normalise(q.scatter(1, x[:, None], 0.0))[0]
            q = torch.where(reject[:, None], q_without_x, q)

        # accepted rows: move to c
        if bool(accept.any()):
            path[rows[accept], accept_len[accept]] = c
            accept_len += accept.to(torch.int64)
            node = torch.where(accept, c, node)
            p = torch.where(accept[:, None], probs[:, c], p)
            moved = torch.where(accept, 0, moved)
            undecided = torch.where(accept, 1, undecided)
            if q is not None:
                q = torch.where(accept[:, None], _normalise(draft_probs[:, c].to(p.dtype))[0], q)

    # residual (or bonus at a leaf); a residual with no mass left (rounding) falls back to P_node
    at_node = probs[rows, node]
    weights = torch.where((p.sum(1) > 0)[:, None], p, at_node)
    next_token = exponential_race(weights, node, row_keys, seed, offset)
    return VerifyResult(accept_len, path, next_token, status)


def _greedy_walk(logits_guided, probs, tokens, parents, neighbours, k, delta, lam):
    """§4: every candidate is tested independently against its parent's unfiltered softmax."""
    B, T, V = probs.shape
    rows = torch.arange(B, device=probs.device)
    real = parents >= 0  # [B, T]; the root has parent -1 but is handled apart
    parent_p = probs.gather(1, parents.clamp(min=0)[:, :, None].expand(B, T, V)).reshape(B * T, V)
    x = tokens.clamp(min=0).reshape(B * T)
    if lam is not None:
        b = (lam - 1.0) * parent_p.gather(1, x[:, None]).squeeze(1)
    else:
        b = torch.full((B * T,), float(delta), dtype=probs.dtype, device=probs.device)
    p_tilde, _, _ = merge_neighbours(parent_p, x, neighbours, k, b)
    boosted = parent_p.scatter(1, x[:, None], p_tilde[:, None])
    passes = (boosted.argmax(1) == x).reshape(B, T) & real

    ok = torch.zeros(B, T, dtype=torch.bool, device=probs.device)  # the node and its ancestors pass
    depth = torch.zeros(B, T, dtype=torch.int64, device=probs.device)
    for c in range(1, T):
        par = parents[:, c].clamp(min=0)
        parent_ok = (par == 0) | ok[rows, par]
        ok[:, c] = passes[:, c] & parent_ok
        depth[:, c] = depth[rows, par] + 1
    score = torch.where(ok, depth, 0)
    score[:, 0] = 0
    best = score.argmax(1)  # deepest, lowest index on ties; 0 (root) when nothing passes
    accept_len = score[rows, best]

    path = torch.full((B, max(T - 1, 0)), -1, dtype=torch.int64, device=probs.device)
    cursor = best.clone()
    for _ in range(T - 1):
        inside = cursor > 0
        slot = (depth[rows, cursor] - 1).clamp(min=0)
        if T > 1:
            path[rows[inside], slot[inside]] = cursor[inside]
        cursor = torch.where(inside, parents[rows, cursor].clamp(min=0), cursor)
    next_token = logits_guided[rows, best].argmax(1)
    status = torch.where(real, passes.to(torch.int8), torch.full_like(passes, -1, dtype=torch.int8))
    return VerifyResult(accept_len, path, next_token, status)


def _empty_result(T: int, device) -> VerifyResult:
    """The result of a batch of no rows (B = 0): every field empty, with the usual dtypes and trailing sizes."""
    empty = torch.empty(0, dtype=torch.int64, device=device)
    return VerifyResult(empty, torch.empty(0, T - 1, dtype=torch.int64, device=device), empty.clone(),
                        torch.empty(0, T, dtype=torch.int8, device=device))


def verify(logits, tokens, parents, neighbours=None, *, uncond_logits=None, cfg_scale=1.0, temperature=1.0,
           top_k=0, top_p=1.0, draft_probs=None, k=0, delta=0.0, lam: Optional[float] = None,
           budget="candidate", seed=0, offset=0, rows=None, faults=()) -> VerifyResult:
    """logits/uncond_logits [B, T, V]; tokens/parents [B, T] int64; neighbours int32 [V, K];
    draft_probs [B, T, V] (sampled drafts) or None (deterministic drafts); rows [B] integer: the Philox
    counter's row word of each row (default b), so a row's draws follow its key, not its place in the batch.
    See SPEC §3-5."""
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"faults must be names from {FAULTS}, got {sorted(unknown)}")
    seed, offset = _int(seed), _int(offset)
    if tokens.shape[0] == 0:
        return _empty_result(tokens.shape[1], tokens.device)
    probs = process_logits(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)  # [B, T, V]
    greedy = row_setting(temperature, logits[:, 0, 0], compute_dtype(logits)).expand(logits.shape[0]) == 0
    result = None
    if not bool(greedy.all()):
        row_keys = (torch.arange(tokens.shape[0], device=tokens.device) if rows is None
                    else rows.to(device=tokens.device, dtype=torch.int64))
        result = _sampling_walk(probs, tokens, parents, neighbours, draft_probs, k, delta, lam, budget,
                                seed, offset, row_keys, faults)
    if bool(greedy.any()):
        guided = guide(logits, uncond_logits, cfg_scale)
        greedy_result = _greedy_walk(guided, probs, tokens, parents, neighbours, k, delta, lam)
        if result is None:
            return greedy_result
        result = VerifyResult(*(torch.where(greedy.reshape(-1, *([1] * (a.dim() - 1))), g, a)
                                for g, a in zip(greedy_result, result)))
    return result
