"""The oracle itself: exact in float64 where the SPEC says the walk is exact (§3.1: delta = 0, lambda = 1
or k = 0 reduce to speculative sampling), and within the §3.3 bounds when relaxed. No sampling here:
every assertion is an exact float64 identity or inequality."""
from __future__ import annotations

import numpy as np
import pytest

from . import oracle
from .cases import PrefixModel, make_case
from .harness import random_draft, random_neighbours
from .target64 import target_distribution

EXACT_RULES = [oracle.Relaxation(k=3), oracle.Relaxation(k=0, delta=0.3), oracle.Relaxation(k=3, lam=1.0),
               oracle.Relaxation(k=3, delta=0.0, budget="node")]
SEEDS = range(12)


def random_node(seed: int, V: int = 10):
    rng = np.random.default_rng(seed)
    P = target_distribution(rng.normal(0, 1.0, V), rng.normal(0, 1.0, V), 1.5, 1.3, V - 2, 0.97)
    n = int(rng.integers(1, 4))
    kids = rng.choice(V, size=n, replace=False).tolist()
    return rng, P, kids, random_neighbours(rng, V, 4)


@pytest.mark.parametrize("relax", EXACT_RULES, ids=str)
@pytest.mark.parametrize("seed", SEEDS)
def test_exact_rules_reproduce_the_target_deterministic(seed, relax):
    _, P, kids, nbrs = random_node(seed)
    np.testing.assert_allclose(oracle.node_output_distribution(P, kids, nbrs, relax), P, rtol=0, atol=1e-12)


@pytest.mark.parametrize("relax", EXACT_RULES, ids=str)
@pytest.mark.parametrize("seed", SEEDS)
def test_exact_rules_reproduce_the_target_sampled(seed, relax):
    rng, P, kids, nbrs = random_node(seed, V=8)
    q = random_draft(rng, 1, 8)[0]
    out = oracle.sampled_node_output_distribution(P, q, len(kids), nbrs, relax)
    np.testing.assert_allclose(out, P, rtol=0, atol=1e-12)


def test_oracle_detects_a_biased_walk():
    """Negative control for the identities above: with delta > 0 the oracle departs from the target."""
    _, P, kids, nbrs = random_node(3)
    out = oracle.node_output_distribution(P, kids, nbrs, oracle.Relaxation(k=3, delta=0.2))
    assert oracle.total_variation(out, P) > 1e-3


@pytest.mark.parametrize("shape", [[-1, 0, 1, 2], [-1, 0, 0, 1, 1, 2]], ids=["chain", "branching"])
def test_exact_rules_reproduce_the_target_over_a_static_sampled_tree(shape):
    """Marginal over fresh draws at every node: each emitted token follows target(prefix)."""
    model = PrefixModel(seed=5, V=6)
    nbrs = np.array([[(x + 1) % 6, (x + 5) % 6] for x in range(6)], dtype=np.int32)
    law = oracle.emitted_sequence_distribution(shape, model.target, model.draft, nbrs, oracle.Relaxation(k=2))
    assert abs(sum(law.values()) - 1) < 1e-12
    following: dict = {}
    for seq, prob in law.items():
        for j, y in enumerate(seq):
            following.setdefault(seq[:j], np.zeros(6))[y] += prob
    for prefix, mass in following.items():
        np.testing.assert_allclose(mass / mass.sum(), model.target(prefix), rtol=0, atol=1e-12)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("relax", [oracle.Relaxation(k=3, delta=0.2), oracle.Relaxation(k=4, delta=0.35, budget="node"),
                                   oracle.Relaxation(k=3, lam=2.5)], ids=str)
def test_deterministic_output_is_the_collapsed_target(seed, relax):
    """§3.3: deterministic drafts output P_node with each A(x_i)'s mass collapsed onto x_i."""
    _, P, kids, nbrs = random_node(seed)
    out = oracle.node_output_distribution(P, kids, nbrs, relax)
    collapsed, _ = oracle.collapsed_target(P, kids, nbrs, relax)
    np.testing.assert_allclose(out, collapsed, rtol=0, atol=1e-12)
    assert abs(out.sum() - 1) < 1e-12


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("delta", [0.05, 0.2, 0.5])
def test_node_budget_tv_at_most_delta(seed, delta):
    """§3.3 node budget, deterministic drafts: TV(output, P_node) <= delta."""
    _, P, kids, nbrs = random_node(seed)
    out = oracle.node_output_distribution(P, kids, nbrs, oracle.Relaxation(k=4, delta=delta, budget="node"))
    assert oracle.total_variation(out, P) <= delta + 1e-12


def test_node_budget_bound_is_attained_and_candidate_budget_exceeds_it():
    """Sharpness: a case where the node budget moves exactly delta while the candidate budget moves more
    (so the node-budget check above is not vacuous)."""
    V = 8
    P = np.full(V, 1.0 / V)
    nbrs = np.array([[(x + d) % V for d in (1, 2, 3)] for x in range(V)], dtype=np.int32)
    kids = [0, 4]
    delta = 0.25
    node = oracle.node_output_distribution(P, kids, nbrs, oracle.Relaxation(k=3, delta=delta, budget="node"))
    cand = oracle.node_output_distribution(P, kids, nbrs, oracle.Relaxation(k=3, delta=delta))
    assert oracle.total_variation(node, P) == pytest.approx(delta, abs=1e-12)
    assert oracle.total_variation(cand, P) > delta + 0.05


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("delta", [0.05, 0.2, 0.5])
def test_candidate_budget_tv_equals_the_collapsed_figure(seed, delta):
    """§3.3 candidate budget: TV = sum_i P_node(A(x_i) \\ {x_i}) when the merged sets are disjoint from
    each other and from the other candidates (the report's figure); never more in any case."""
    _, P, kids, nbrs = random_node(seed)
    relax = oracle.Relaxation(k=4, delta=delta)
    out = oracle.node_output_distribution(P, kids, nbrs, relax)
    _, figure = oracle.collapsed_target(P, kids, nbrs, relax)
    tv = oracle.total_variation(out, P)
    assert tv <= figure + 1e-12
    if _merged_sets_disjoint(P, kids, nbrs, relax):
        assert tv == pytest.approx(figure, abs=1e-12)


def _merged_sets_disjoint(P, kids, nbrs, relax) -> bool:
    seen = set()
    unassigned = P.copy()
    for x in kids:
        p = unassigned / unassigned.sum()
        merged, _ = oracle.merged_neighbours(p, x, nbrs, relax.k, relax.delta)
        claim = {x, *merged}
        if claim & seen or set(merged) & set(kids):
            return False
        seen |= claim
        unassigned[list(claim)] = 0
    return True


@pytest.mark.parametrize("seed", range(40))
def test_lambda_mode_tv_bound(seed):
    """Lambda mode moves at most (lam - 1) p(x_i) per candidate: TV <= (lam - 1) sum_i P_node(x_i)."""
    _, P, kids, nbrs = random_node(seed)
    lam = 1.0 + seed / 10
    out = oracle.node_output_distribution(P, kids, nbrs, oracle.Relaxation(k=4, lam=lam))
    assert oracle.total_variation(out, P) <= (lam - 1) * P[kids].sum() + 1e-12


def test_whole_tree_law_sums_to_one_and_matches_node_laws():
    case = make_case(1, [-1, 0, 0, 0, 1, 1, 4], oracle.Relaxation(k=3, delta=0.1))
    law = case.outcome_law()
    assert law.sum() == pytest.approx(1.0, abs=1e-12)
    P = case.targets()
    first = law[0].copy()  # the first emitted token: next_token at the root, or a root child's token
    for c in oracle.children_of(case.parents, 0):
        first[case.tokens[c]] += law[[n for n in range(case.T) if c in oracle.path_to(case.parents, n)]].sum()
    np.testing.assert_allclose(
        first, oracle.node_output_distribution(P[0], [case.tokens[c] for c in (1, 2, 3)], case.neighbours,
                                               case.relax), rtol=0, atol=1e-12)
