"""The G-test helper itself: exact chi-square tails, and calibration on simulated multinomials."""
from __future__ import annotations

import math

import numpy as np
import pytest

from .gtest import NOMINAL_ALPHA, chi2_isf, chi2_sf, conditional_g_test, g_test, homogeneity_g_test


@pytest.mark.parametrize("x, df, sf", [
    (3.841458820694124, 1, 0.05), (23.928126976934827, 1, 1e-6), (18.307038053275146, 10, 0.05),
    (5.991464547107979, 2, 0.05), (7.814727903251178, 3, 0.05), (124.34211340400407, 100, 0.05),
])
def test_chi2_tail_matches_tables(x, df, sf):
    assert chi2_sf(x, df) == pytest.approx(sf, rel=1e-9)


@pytest.mark.parametrize("df", [1, 2, 7, 40, 301])
def test_chi2_quantile_inverts_tail(df):
    assert chi2_sf(chi2_isf(NOMINAL_ALPHA, df), df) == pytest.approx(NOMINAL_ALPHA, rel=1e-9)


def test_even_df_tail_closed_form():
    for x in (0.5, 10.0, 80.0):
        assert chi2_sf(x, 2) == pytest.approx(math.exp(-x / 2), rel=1e-12)
        assert chi2_sf(x, 4) == pytest.approx(math.exp(-x / 2) * (1 + x / 2), rel=1e-12)


def _rejection_count(probs, n, reps, alpha, rng):
    return sum(not g_test(rng.multinomial(n, probs), probs, alpha=alpha).passed for _ in range(reps))


def test_gtest_calibration_on_simulated_multinomials():
    """At alpha = 0.05 with tiny cells that must be pooled, the rejection count over 1000 simulated
    samples of 10^5 draws is Binomial(1000, 0.05) for a calibrated test: mean 50, sd 6.9. The exact
    binomial tails outside [18, 90] are 3.5e-8 and 5.1e-8, so the false-failure rate is <= 1e-7 (a
    miscalibrated df or pooling, e.g. a true rate of 0.1 or 0.02, fails it)."""
    rng = np.random.default_rng(2024)
    probs = np.concatenate([rng.dirichlet(np.ones(30)) * 0.999, np.full(20, 0.001 / 20)])
    rejected = _rejection_count(probs, 100_000, 1000, 0.05, rng)
    assert 18 <= rejected <= 90, rejected


def test_gtest_rejects_a_one_percent_shift():
    """Power (negative control for the calibration test): moving 1% of the mass between two cells is
    rejected at the 1e-6 level with 10^5 draws (expected G ~ 2 n KL ~ 130 here vs threshold ~ 60)."""
    rng = np.random.default_rng(7)
    probs = np.full(20, 0.05)
    shifted = probs.copy()
    shifted[0] += 0.01
    shifted[1] -= 0.01
    assert not g_test(rng.multinomial(100_000, shifted), probs).passed


def test_impossible_outcome_fails_outright():
    probs = np.array([0.5, 0.5, 0.0])
    result = g_test(np.array([50_000, 49_999, 1]), probs)
    assert not result.passed and result.impossible == [("2", 1)]


def test_conditional_groups_add_statistics_and_df():
    probs_a, probs_b = np.array([0.5, 0.5]), np.array([0.2, 0.3, 0.5])
    a, b = np.array([500, 500]), np.array([200, 320, 480])
    joint = conditional_g_test([(a, probs_a, None), (b, probs_b, None)])
    single_b = g_test(b, probs_b)
    assert joint.df == 1 + 2
    assert joint.statistic == pytest.approx(single_b.statistic, rel=1e-12)  # group a fits exactly: G = 0


@pytest.mark.slow
def test_homogeneity_calibration_on_simulated_pairs():
    """Two multinomial samples of one law (sizes 20000 and 30000, 40 cells, some rare), two groups: at
    alpha = 0.05 the rejection count over 1000 simulated pairs is Binomial(1000, 0.05) for a calibrated test;
    outside [18, 90] has probability <= 1e-7, as above (a wrong df or pooling fails it)."""
    rng = np.random.default_rng(11)
    probs = np.concatenate([rng.dirichlet(np.ones(30)) * 0.995, np.full(10, 0.0005)])
    rejected = sum(not homogeneity_g_test([(rng.multinomial(20_000, probs), rng.multinomial(30_000, probs)),
                                           (rng.multinomial(20_000, probs), rng.multinomial(30_000, probs))],
                                          alpha=0.05).passed for _ in range(1000))
    assert 18 <= rejected <= 90, rejected


def test_homogeneity_rejects_a_two_percent_shift():
    """Power (negative control for the calibration test): 2 % of the mass moved between two of 20 cells in
    one sample is rejected at the 1e-6 level with 20000 + 20000 draws."""
    rng = np.random.default_rng(3)
    probs = np.full(20, 0.05)
    shifted = probs.copy()
    shifted[0] += 0.02
    shifted[1] -= 0.02
    assert not homogeneity_g_test([(rng.multinomial(20_000, probs), rng.multinomial(20_000, shifted))]).passed
