"""SPEC §4 (temperature 0) against an independent brute force (oracle.greedy_outcome): every node's
pass/fail, the accepted path (deepest all-pass chain, lowest index on ties) and next_token (argmax of the
guided logits at the last accepted node). Deterministic: exact equality, no statistics."""
from __future__ import annotations

import numpy as np
import pytest

from . import oracle
from .random_trees import random_batch

RULES = {
    "exact-k0": oracle.Relaxation(k=0),
    "delta0-k4": oracle.Relaxation(k=4),
    "delta-small": oracle.Relaxation(k=2, delta=0.05),
    "delta-large": oracle.Relaxation(k=4, delta=0.3),
    "delta-node-budget": oracle.Relaxation(k=4, delta=0.3, budget="node"),  # same as candidate in greedy
    "lambda": oracle.Relaxation(k=3, lam=3.0),
}


def assert_matches_brute_force(batch, result):
    B, T, _ = batch.shape
    for b in range(B):
        path, next_token, status = oracle.greedy_outcome(batch.tokens[b].tolist(), batch.parents[b].tolist(),
                                                         batch.guided(b), batch.neighbours, batch.relax)
        got_path = [n for n in result.path[b].tolist() if n >= 0]
        assert got_path == path, (b, got_path, path)
        assert int(result.accept_len[b]) == len(path), b
        assert int(result.next_token[b]) == next_token, b
        assert result.node_status[b].tolist() == status, (b, result.node_status[b].tolist(), status)


@pytest.mark.parametrize("rule", sorted(RULES))
@pytest.mark.parametrize("grid", [None, 0.5], ids=["continuous", "tied-logits"])
def test_greedy_matches_brute_force(verify_backend, rule, grid):
    """300 random trees (padding nodes, guidance) per rule; grid=0.5 rounds logits so ties are common."""
    batch = random_batch(2 * sorted(RULES).index(rule) + (grid is not None), B=300, T=9, V=10, K=4, relax=RULES[rule],
                         greedy_rate=1.0, grid=grid)
    result = verify_backend(*batch.tensors(), **batch.kwargs())
    assert_matches_brute_force(batch, result)


def test_greedy_paths_are_deep_enough_to_matter():
    """The generator makes greedy paths of every depth (so the test above checks real walks)."""
    batch = random_batch(1, B=300, T=9, V=10, K=4, relax=RULES["delta0-k4"], greedy_rate=1.0)
    depths = [len(oracle.greedy_outcome(batch.tokens[b].tolist(), batch.parents[b].tolist(), batch.guided(b),
                                        batch.neighbours, batch.relax)[0]) for b in range(300)]
    assert {0, 1, 2, 3} <= set(depths)


def test_greedy_at_delta_zero_follows_argmax(verify_backend):
    """delta = 0: every accepted token is its parent's argmax (lowest index on ties)."""
    batch = random_batch(5, B=300, T=9, V=10, K=4, relax=RULES["delta0-k4"], greedy_rate=1.0, grid=0.5)
    result = verify_backend(*batch.tensors(), **batch.kwargs())
    accepted = 0
    for b in range(300):
        parent = 0
        for node in [n for n in result.path[b].tolist() if n >= 0]:
            l = batch.guided(b)[parent]
            assert batch.tokens[b, node] == int(np.flatnonzero(l == l.max())[0])
            parent, accepted = node, accepted + 1
    assert accepted > 100


def test_relaxation_accepts_more_in_greedy(verify_backend):
    """delta > 0 accepts at least what delta = 0 accepts, and strictly more somewhere."""
    exact = random_batch(9, B=300, T=9, V=10, K=4, relax=RULES["delta0-k4"], greedy_rate=1.0)
    relaxed = random_batch(9, B=300, T=9, V=10, K=4, relax=RULES["delta-large"], greedy_rate=1.0)
    n_exact = verify_backend(*exact.tensors(), **exact.kwargs()).accept_len
    n_relaxed = verify_backend(*relaxed.tensors(), **relaxed.kwargs()).accept_len
    assert bool((n_relaxed >= n_exact).all()) and int((n_relaxed - n_exact).sum()) > 0
