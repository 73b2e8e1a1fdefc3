"""SPEC §8 negative controls: the statistical checks of test_walk_statistics.py, run on the reference with
one deliberate bug, must reject it by a wide margin (G above twice the 1e-6 threshold, or an outcome of
probability 0). Each run is deterministic (fixed Philox seed), so these tests cannot flake; the margins
seen are far beyond 2x (typically 10x-1000x), so they also hold for other seeds."""
from __future__ import annotations

import pytest

from lantern.ops.reference.verify import verify as reference_verify

from . import oracle
from .cases import BRANCHING, PrefixModel, make_case
from .gtest import assert_fails_widely
from .harness import FAULTS, REPLAY_DRAWS, REPLAY_ROWS, ReplayMismatch, faulty_verify, replayed_verify
from .walk_checks import exact_fixed_tree, exact_random_drafts, outcome_vs_oracle


def assert_some_check_fails_widely(tests, what):
    assert any(t.fails_widely for t in tests), "\n".join(
        [f"{what}: the broken walk passed every check"] + [t.report() for t in tests])
    assert_fails_widely(next(t for t in tests if t.fails_widely), what)


def check_deterministic_exact(verify):
    """test_exact_deterministic_drafts[branching]."""
    return exact_fixed_tree(verify, make_case(11, BRANCHING, oracle.Relaxation(k=3)), seed=101)


def check_sampled_fixed(verify):
    """test_exact_sampled_drafts_fixed_tree."""
    return outcome_vs_oracle(verify, make_case(12, BRANCHING, oracle.Relaxation(k=3), sampled=True), seed=102)


def check_sampled_fresh(verify):
    """test_exact_sampled_drafts_fresh_draws[branching]."""
    return exact_random_drafts(verify, PrefixModel(seed=7, V=8), [-1, 0, 0, 1, 1, 2], oracle.Relaxation(k=2),
                               seed=103)


def check_relaxed_deterministic(verify):
    """test_relaxed_walk_matches_oracle[deterministic-delta-candidate]."""
    case = make_case(13, BRANCHING, oracle.Relaxation(k=3, delta=0.15))
    return outcome_vs_oracle(verify, case, seed=104)


def check_relaxed_node_budget(verify):
    """test_relaxed_walk_matches_oracle[deterministic-delta-node]."""
    case = make_case(13, BRANCHING, oracle.Relaxation(k=4, delta=0.2, budget="node"))
    return outcome_vs_oracle(verify, case, seed=104)


def check_relaxed_lambda_sampled(verify):
    """test_relaxed_walk_matches_oracle[sampled-lambda]."""
    case = make_case(12, BRANCHING, oracle.Relaxation(k=3, lam=3.0), sampled=True)
    return outcome_vs_oracle(verify, case, seed=104)


def budget_ignored():
    """A broken backend that applies the candidate budget when asked for the node budget."""
    def run(*args, **kw):
        return reference_verify(*args, **{**kw, "budget": "candidate"})
    return run


CONTROLS = [
    ("wrong_residual", check_deterministic_exact),
    ("wrong_residual", check_sampled_fresh),
    ("reused_uniform", check_deterministic_exact),
    ("reused_uniform", check_sampled_fixed),
    ("off_by_one", check_deterministic_exact),
    ("off_by_one", check_sampled_fixed),
    ("off_by_one", check_relaxed_deterministic),
    ("off_by_one", check_relaxed_node_budget),
    ("reused_uniform", check_relaxed_lambda_sampled),
    ("budget_ignored", check_relaxed_node_budget),
]


@pytest.mark.parametrize("fault, check", CONTROLS, ids=[f"{f}-{c.__name__}" for f, c in CONTROLS])
def test_broken_walk_is_rejected(fault, check):
    broken = budget_ignored() if fault == "budget_ignored" else faulty_verify(fault)
    assert_some_check_fails_widely(check(broken), f"{fault} under {check.__name__}")


@pytest.mark.parametrize("fault, check", CONTROLS, ids=[f"{f}-{c.__name__}" for f, c in CONTROLS])
def test_replay_catches_broken_walk(fault, check):
    """The replay that checks a backend under Triton's interpreter (harness.replayed_verify) catches each
    deliberate bug within the first REPLAY_ROWS rows of the same check's call."""
    broken = budget_ignored() if fault == "budget_ignored" else faulty_verify(fault)
    replayed = replayed_verify(broken, REPLAY_ROWS)
    replayed.draws = REPLAY_DRAWS
    with pytest.raises(ReplayMismatch):
        check(replayed)


def test_every_fault_has_a_control():
    assert {fault for fault, _ in CONTROLS} >= set(FAULTS)
