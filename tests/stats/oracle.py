"""Exact float64 oracle for the verification walk (SPEC §3), written from the SPEC alone.

Uniforms are treated as exact continuous U[0, 1): a deterministic draft x is accepted with probability
p~(x); a sampled draft with probability min(1, p~(x) / q'(x)); the residual / bonus token is drawn with
probability proportional to its weight (the exponential race's exact law). Every rejection updates the
state deterministically, so one node's walk is a single chain of states with reach probabilities, and a
tree's outcome law is the product of independent per-node laws (each node has its own uniforms).

The relaxation (§3.1/§3.3 plus the lead's documented choices):
- delta mode, budget "candidate": bound b = delta for every candidate (current residual's scale);
- delta mode, budget "node": b = (delta - M) / R with M the mass moved so far at this node and R the
  probability of still being undecided there (both in P_node's scale); after rejecting x with merged mass
  c: M += R * c, R *= sum_y max(0, p~_x(y) - q'(y))  (q' = one-hot(x) for deterministic drafts);
- lambda mode: b = (lam - 1) * p(x), candidate budget only.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np


@dataclass(frozen=True)
class Relaxation:
    """The LANTERN relaxation's settings; the defaults are exact speculative sampling."""

    k: int = 0
    delta: float = 0.0
    lam: Optional[float] = None
    budget: str = "candidate"


EXACT = Relaxation()


def normalised(w: np.ndarray) -> np.ndarray:
    total = w.sum()
    return w / total if total > 0 else np.zeros_like(w)


def candidate_bound(relax: Relaxation, p: np.ndarray, x: int, moved: float, undecided: float) -> float:
    """The budget b a candidate x may merge, in the current residual's scale."""
    if relax.lam is not None:
        return (relax.lam - 1.0) * p[x]
    if relax.budget == "node":
        return max(0.0, (relax.delta - moved) / undecided) if undecided > 0 else 0.0
    return relax.delta


def merged_neighbours(p: np.ndarray, x: int, neighbours, k: int, bound: float) -> Tuple[List[int], float]:
    """The neighbours n_1..n_{m*} merged into A(x) and their mass c_{m*} = max{c_m <= bound}."""
    merged, mass = [], 0.0
    for m in range(k):
        n = int(neighbours[x][m])
        if mass + p[n] > bound:
            break  # c_m is nondecreasing, so the first excess ends the prefix
        mass += p[n]
        merged.append(n)
    return merged, mass


def accept_probability(p_tilde: float, q_x: Optional[float]) -> float:
    """P(u < p~) for deterministic drafts, P(u q' < p~) for sampled ones, u ~ U[0, 1)."""
    if q_x is None:
        return min(1.0, p_tilde)
    if q_x <= 0:
        return 1.0 if p_tilde > 0 else 0.0
    return min(1.0, p_tilde / q_x)


def node_walk(P_node, child_tokens: Sequence[int], neighbours, relax: Relaxation = EXACT, q=None):
    """One node's walk over its children (tokens in child order).
    Returns (accept[j] = P(the walk accepts child j), stop[V] = P(no child accepted, next token = y))."""
    P_node = np.asarray(P_node, dtype=np.float64)
    p = P_node.copy()
    q_now = None if q is None else normalised(np.asarray(q, dtype=np.float64).copy())
    moved, undecided, reach = 0.0, 1.0, 1.0
    accept = []
    for x in child_tokens:
        bound = candidate_bound(relax, p, x, moved, undecided)
        merged, mass = merged_neighbours(p, x, neighbours, relax.k, bound)
        p_tilde = p[x] + mass
        a = accept_probability(p_tilde, None if q_now is None else q_now[x])
        accept.append(reach * a)
        reach *= 1.0 - a
        collapsed = p.copy()
        collapsed[merged] = 0.0
        collapsed[x] = p_tilde
        if q_now is None:
            residual = collapsed.copy()
            residual[x] = 0.0  # zero exactly A(x)
        else:
            residual = np.maximum(0.0, collapsed - q_now)
            q_now[x] = 0.0
            q_now = normalised(q_now)
        moved += undecided * mass
        undecided *= residual.sum()
        p = normalised(residual)
    stop = reach * (p if p.sum() > 0 else P_node)
    return np.array(accept), stop


def node_output_distribution(P_node, child_tokens, neighbours, relax: Relaxation = EXACT, q=None) -> np.ndarray:
    """Law of the token emitted right after the walk reaches the node: an accepted child's token, or the
    residual / bonus sample."""
    accept, stop = node_walk(P_node, child_tokens, neighbours, relax, q)
    out = stop.copy()
    for x, a in zip(child_tokens, accept):
        out[x] += a
    return out


def ordered_draws_without_replacement(q, n: int):
    """Every ordered n-tuple of distinct tokens with its probability under sequential draws from q."""
    q = np.asarray(q, dtype=np.float64)
    q = q / q.sum()
    for tup in itertools.permutations(np.flatnonzero(q > 0).tolist(), n):
        prob, left = 1.0, 1.0
        for t in tup:
            prob *= q[t] / left
            left -= q[t]
        yield tup, prob


def sampled_node_output_distribution(P_node, q, n_children: int, neighbours, relax: Relaxation = EXACT) -> np.ndarray:
    """node_output_distribution averaged over the children's tokens drawn from q without replacement."""
    out = np.zeros(len(P_node))
    for tup, prob in ordered_draws_without_replacement(q, n_children):
        out += prob * node_output_distribution(P_node, tup, neighbours, relax, q)
    return out


def children_of(parents: Sequence[int], node: int) -> List[int]:
    return [c for c in range(1, len(parents)) if parents[c] == node]


def walk_outcome_distribution(tokens, parents, P, neighbours, relax: Relaxation = EXACT, Q=None) -> np.ndarray:
    """Exact law of (last accepted node, next_token) for one fixed tree: array [T, V].
    P[n] is node n's target distribution; Q[n] (sampled drafts) the law node n's children were drawn from.
    The accepted path is the chain of parents from the last accepted node up to the root."""
    T, V = len(tokens), np.asarray(P).shape[1]
    out = np.zeros((T, V))

    def visit(node: int, reach: float) -> None:
        kids = children_of(parents, node)
        accept, stop = node_walk(P[node], [tokens[c] for c in kids], neighbours, relax,
                                 None if Q is None else Q[node])
        out[node] += reach * stop
        for c, a in zip(kids, accept):
            if reach * a > 0:
                visit(c, reach * a)

    visit(0, 1.0)
    return out


def path_to(parents, node: int) -> List[int]:
    """Accepted node indices from the root's child down to ``node`` (empty for the root)."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def emitted_sequence_distribution(shape_parents, target: Callable, draft: Callable, neighbours,
                                  relax: Relaxation = EXACT) -> Dict[tuple, float]:
    """Law of the emitted token sequence (accepted tokens, then next_token) for a static tree shape whose
    children at every node are drawn afresh from ``draft(prefix)`` without replacement, with
    ``target(prefix)`` the target distribution after ``prefix`` (tokens emitted since the root)."""

    @lru_cache(maxsize=None)
    def subtree(node: int, prefix: tuple) -> Tuple[Tuple[tuple, float], ...]:
        kids = children_of(shape_parents, node)
        P, q = target(prefix), draft(prefix)
        law: Dict[tuple, float] = {}
        draws = ordered_draws_without_replacement(q, len(kids)) if kids else [((), 1.0)]
        for tup, prob in draws:
            accept, stop = node_walk(P, tup, neighbours, relax, q if kids else None)
            for y in np.flatnonzero(stop > 0):
                law[(int(y),)] = law.get((int(y),), 0.0) + prob * stop[y]
            for c, x, a in zip(kids, tup, accept):
                if a <= 0:
                    continue
                for rest, r in subtree(c, prefix + (x,)):
                    law[(x,) + rest] = law.get((x,) + rest, 0.0) + prob * a * r
        return tuple(law.items())

    return dict(subtree(0, ()))


# ---- §3.3: what the relaxation may cost ------------------------------------------------------------

def total_variation(p, r) -> float:
    return 0.5 * float(np.abs(np.asarray(p) - np.asarray(r)).sum())


def collapsed_target(P_node, child_tokens, neighbours, relax: Relaxation) -> Tuple[np.ndarray, float]:
    """Deterministic drafts: P_node with each A(x_i)'s remaining mass collapsed onto x_i (A(x_i) taken in
    the residual candidate i sees), and the figure sum_i P_node(A(x_i) \\ {x_i}).
    Computed as a mass-moving process, without accept/reject probabilities."""
    P_node = np.asarray(P_node, dtype=np.float64)
    unassigned = P_node.copy()  # P_node-scale mass no candidate has claimed yet
    out = np.zeros_like(P_node)
    moved, figure = 0.0, 0.0
    for x in child_tokens:
        left = unassigned.sum()
        p = unassigned / left if left > 0 else unassigned
        bound = candidate_bound(relax, p, x, moved, left)
        merged, _ = merged_neighbours(p, x, neighbours, relax.k, bound)
        claim = [x] + merged
        moved += unassigned[merged].sum()
        figure += P_node[merged].sum()
        out[x] += unassigned[claim].sum()
        unassigned[claim] = 0.0
    return out + unassigned, figure


# ---- §4: greedy brute force --------------------------------------------------------------------------

def softmax(l) -> np.ndarray:
    l = np.asarray(l, dtype=np.float64)
    w = np.exp(l - l.max())
    return w / w.sum()


def greedy_passes(p: np.ndarray, x: int, neighbours, relax: Relaxation) -> bool:
    """argmax(p with p[x] replaced by p~(x)) == x, lowest index winning ties."""
    bound = (relax.lam - 1.0) * p[x] if relax.lam is not None else relax.delta
    _, mass = merged_neighbours(p, x, neighbours, relax.k, bound)
    boosted = p.copy()
    boosted[x] = p[x] + mass
    best = max(range(len(p)), key=lambda y: (boosted[y], -y))
    return best == x


def greedy_outcome(tokens, parents, guided, neighbours, relax: Relaxation = EXACT):
    """(path, next_token, node_status) of §4 by brute force over every node; padding has parent -1."""
    T = len(tokens)
    status = [-1] * T
    for c in range(1, T):
        if parents[c] >= 0:
            status[c] = int(greedy_passes(softmax(guided[parents[c]]), tokens[c], neighbours, relax))
    candidates = [0] + [c for c in range(1, T)
                        if parents[c] >= 0 and all(status[n] == 1 for n in path_to(parents, c))]
    last = max(candidates, key=lambda c: (len(path_to(parents, c)), -c))
    l = np.asarray(guided[last], dtype=np.float64)
    next_token = int(np.flatnonzero(l == l.max())[0])
    return path_to(parents, last), next_token, status
