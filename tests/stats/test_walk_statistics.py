"""SPEC §8 on every backend: the empirical law of verify's outcomes, from DRAWS = 10^5 independent rows
in one call, against the exact oracle (and, at delta = 0, against the target itself).

Every assertion here is a calibrated G-test (gtest.py) with false-failure rate <= 1e-6; the negative
controls (test_negative_controls.py) run the same checks on deliberately broken walks and must fail."""
from __future__ import annotations

import pytest
import torch

from . import oracle
from .cases import BRANCHING, SHAPES, PrefixModel, make_case
from .gtest import assert_fits
from .walk_checks import exact_fixed_tree, exact_random_drafts, outcome_vs_oracle

RELAXED = {
    "delta-candidate": oracle.Relaxation(k=3, delta=0.15),
    "delta-node": oracle.Relaxation(k=4, delta=0.2, budget="node"),
    "lambda": oracle.Relaxation(k=3, lam=3.0),
}
CASE_SEED = {"deterministic": 13, "sampled": 12
}


def assert_node_tv_within_bound(case):
    """§3.3 at every node of the case (exact oracle): node budget TV <= delta; candidate budget TV <=
    sum_i P_node(A(x_i) \\ {x_i}); lambda mode TV <= (lam - 1) sum_i P_node(x_i)."""
    P, relax = case.targets(), case.relax
    for node in range(case.T):
        kids = [case.tokens[c] for c in oracle.children_of(case.parents, node)]
        tv = oracle.total_variation(oracle.node_output_distribution(P[node], kids, case.neighbours, relax), P[node])
        if relax.lam is not None:
            bound = (relax.lam - 1) * P[node][kids].sum()
        elif relax.budget == "node":
            bound = relax.delta
        else:
            bound = oracle.collapsed_target(P[node], kids, case.neighbours, relax)[1]
        assert tv <= bound + 1e-12, (node, tv, bound)


def assert_all_fit(tests, what):
    for i, t in enumerate(tests):
        assert_fits(t, f"{what} [check {i}]")


@pytest.mark.parametrize("shape, dtype", [("chain", torch.float64), ("branching", torch.float64),
                                          ("branching", torch.float32)])
def test_exact_deterministic_drafts(verify_backend, shape, dtype):
    """delta = 0 with k = 3 neighbours available (must reduce to speculative sampling): outcomes match the
    oracle; the token after every reached node follows P_node. Guidance, temperature, top-k, top-p on."""
    case = make_case(11, SHAPES[shape], oracle.Relaxation(k=3))
    assert_all_fit(exact_fixed_tree(verify_backend, case, seed=101, dtype=dtype), f"deterministic {shape}")


def test_exact_sampled_drafts_fixed_tree(verify_backend):
    """Sampled drafts, delta = 0, one fixed draw of the tree: outcomes match the oracle's exact law."""
    case = make_case(12, BRANCHING, oracle.Relaxation(k=3), sampled=True)
    assert_all_fit(outcome_vs_oracle(verify_backend, case, seed=102), "sampled fixed tree")


@pytest.mark.parametrize("shape", [[-1, 0, 1, 2], [-1, 0, 0, 1, 1, 2]], ids=["chain", "branching"])
def test_exact_sampled_drafts_fresh_draws(verify_backend, shape):
    """Sampled drafts drawn afresh per row from the drafter, delta = 0: emitted sequences match the
    oracle, and each emitted token follows the target given the tokens before it."""
    model = PrefixModel(seed=7, V=8)
    assert_all_fit(exact_random_drafts(verify_backend, model, shape, oracle.Relaxation(k=2), seed=103),
                   "sampled fresh draws")


@pytest.mark.parametrize("rule", sorted(RELAXED))
@pytest.mark.parametrize("drafts", ["deterministic", "sampled"])
def test_relaxed_walk_matches_oracle(verify_backend, rule, drafts):
    """delta > 0 (candidate and node budgets) and lambda mode: outcomes match the oracle's exact law.
    (The oracle's TV bounds are proven in test_oracle.py.)"""
    case = make_case(CASE_SEED[drafts], BRANCHING, RELAXED[rule], sampled=drafts == "sampled")
    exact = make_case(CASE_SEED[drafts], BRANCHING, oracle.Relaxation(k=3), sampled=drafts == "sampled")
    assert oracle.total_variation(case.outcome_law(), exact.outcome_law()) > 0.02  # the relaxation matters
    if drafts == "deterministic":
        assert_node_tv_within_bound(case)
    assert_all_fit(outcome_vs_oracle(verify_backend, case, seed=104), f"{rule} {drafts}")
