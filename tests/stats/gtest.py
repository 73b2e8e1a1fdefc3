"""A calibrated G-test (likelihood-ratio goodness of fit) of observed counts against exact probabilities.

Calibration (per assertion):
- Cells whose exact probability is 0 are structural zeros: any count there is an impossible outcome and
  fails the test outright (an exact check, no false failures).
- The remaining cells are pooled, smallest expectation first, until every pooled cell expects at least
  ``MIN_EXPECTED`` = 20 counts, so that the chi-square approximation of G holds.
- G (with Williams' correction, G / (1 + (K + 1) / (6 N)), K cells) is compared with the exact upper
  1e-7 quantile of chi-square with K - 1 degrees of freedom (computed below from the closed-form
  chi-square survival function for integer df, inverted by bisection; no scipy). The nominal rate is
  1e-7; the factor 10 below the 1e-6 we claim is the safety margin for the asymptotic approximation
  in the far tail. So every assertion made with ``assert_fits`` has a false-failure rate <= 1e-6.
- ``test_gtest_calibration`` checks the machinery (pooling, df, statistic) empirically on multinomial
  samples at a level where the rejection rate is measurable.
A conditional test (several groups, each conditioned on its own total) adds the groups' G and df.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple

import numpy as np

FALSE_FAILURE_RATE = 1e-6
NOMINAL_ALPHA = 1e-7  # threshold quantile: 10x below the claimed rate, as a safety margin
MIN_EXPECTED = 20.0
WIDE_MARGIN = 2.0  # a negative control must exceed the threshold by this factor (or hit an impossible cell)


def chi2_sf(x: float, df: int) -> float:
    """P(X > x) for X ~ chi-square(df), df a positive integer: exact closed forms of Q(df/2, x/2)."""
    if x <= 0:
        return 1.0
    half = x / 2.0
    if df % 2 == 0:
        return sum(math.exp(-half + i * math.log(half) - math.lgamma(i + 1)) for i in range(df // 2))
    tail = math.erfc(math.sqrt(half))
    return tail + sum(math.exp(-half + (i + 0.5) * math.log(half) - math.lgamma(i + 1.5))
                      for i in range(df // 2))


def chi2_isf(alpha: float, df: int) -> float:
    """The x with chi2_sf(x, df) = alpha, by bisection (sf is decreasing)."""
    lo, hi = 0.0, max(10.0, 4.0 * df)
    while chi2_sf(hi, df) > alpha:
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if chi2_sf(mid, df) > alpha else (lo, mid)
    return hi


@dataclass
class GTest:
    statistic: float
    df: int
    threshold: float
    impossible: List[Tuple[str, int]] = field(default_factory=list)  # (label, count) at probability 0
    worst: List[Tuple[str, float, float]] = field(default_factory=list)  # (label, observed, expected)

    @property
    def passed(self) -> bool:
        return not self.impossible and self.statistic <= self.threshold

    @property
    def fails_widely(self) -> bool:
        return bool(self.impossible) or self.statistic > WIDE_MARGIN * self.threshold

    def report(self) -> str:
        lines = [f"G = {self.statistic:.1f} on {self.df} df, threshold {self.threshold:.1f} "
                 f"(false-failure rate <= {FALSE_FAILURE_RATE:g})"]
        lines += [f"  impossible outcome {lab}: {n} draws" for lab, n in self.impossible[:10]]
        lines += [f"  {lab}: observed {o:.0f}, expected {e:.1f}" for lab, o, e in self.worst[:8]]
        return "\n".join(lines)


def _pool(observed: np.ndarray, expected: np.ndarray, labels: Sequence[str]):
    """Merge the smallest cells until each pooled cell expects >= MIN_EXPECTED counts."""
    order = np.argsort(expected, kind="stable")
    cells = [(float(observed[i]), float(expected[i]), labels[i]) for i in order]
    pooled: List[Tuple[float, float, str]] = []
    acc_o, acc_e, acc_l = 0.0, 0.0, []
    for o, e, lab in cells:
        acc_o, acc_e = acc_o + o, acc_e + e
        acc_l.append(lab)
        if acc_e >= MIN_EXPECTED:
            pooled.append((acc_o, acc_e, acc_l[0] if len(acc_l) == 1 else f"pool of {len(acc_l)}"))
            acc_o, acc_e, acc_l = 0.0, 0.0, []
    if acc_l:  # leftover small tail joins the last pooled cell
        if pooled:
            o, e, _ = pooled.pop()
            pooled.append((o + acc_o, e + acc_e, "pool"))
        else:
            pooled.append((acc_o, acc_e, "pool"))
    return pooled


def _group_statistic(observed, probs, labels):
    observed = np.asarray(observed, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    labels = list(labels) if labels is not None else [str(i) for i in range(observed.size)]
    possible = probs > 0
    impossible = [(labels[i], int(observed[i])) for i in np.flatnonzero(~possible & (observed > 0))]
    idx = np.flatnonzero(possible)
    n = observed[idx].sum()  # G is the fit among possible outcomes; impossible ones fail on their own
    if n == 0:  # every draw was impossible: nothing to fit
        return 0.0, 0, impossible, []
    pooled = _pool(observed[idx], n * probs[idx] / probs[idx].sum(), [labels[i] for i in idx])
    o = np.array([c[0] for c in pooled])
    e = np.array([c[1] for c in pooled])
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(o > 0, o * np.log(o / e), 0.0)
    g = 2.0 * float(terms.sum())
    cells = len(pooled)
    williams = 1.0 + (cells + 1) / (6.0 * max(n, 1.0))
    worst = sorted(((c[2], c[0], c[1]) for c in pooled), key=lambda t: -abs(t[1] - t[2]) / math.sqrt(t[2]))
    return g / williams, max(cells - 1, 0), impossible, worst


def conditional_g_test(groups, alpha: float = NOMINAL_ALPHA) -> GTest:
    """groups: iterable of (observed counts, probabilities, labels or None), each group tested against its
    own total (a multinomial conditioned on the group size); statistics and df add up."""
    total_g, total_df, impossible, worst = 0.0, 0, [], []
    for observed, probs, labels in groups:
        if np.asarray(observed).sum() == 0:
            continue
        g, df, imp, w = _group_statistic(observed, probs, labels)
        total_g, total_df = total_g + g, total_df + df
        impossible += imp
        worst += w
    worst.sort(key=lambda t: -abs(t[1] - t[2]) / math.sqrt(t[2]))
    threshold = chi2_isf(alpha, total_df) if total_df > 0 else 0.0
    return GTest(total_g, total_df, threshold, impossible, worst)


def _homogeneity_group(counts_a, counts_b):
    """One 2 x K table: cells pooled (smallest total first) until each pooled cell expects >= MIN_EXPECTED
    draws in both samples; G = 2 sum O ln(O / E), E from the margins; df = pooled cells - 1."""
    a, b = np.asarray(counts_a, dtype=np.float64).ravel(), np.asarray(counts_b, dtype=np.float64).ravel()
    na, nb = a.sum(), b.sum()
    share_a = na / (na + nb)
    pooled, acc_a, acc_b = [], 0.0, 0.0
    for i in np.argsort(a + b, kind="stable"):
        acc_a, acc_b = acc_a + a[i], acc_b + b[i]
        total = acc_a + acc_b
        if min(total * share_a, total * (1 - share_a)) >= MIN_EXPECTED:
            pooled.append((acc_a, acc_b))
            acc_a, acc_b = 0.0, 0.0
    if acc_a + acc_b > 0:
        if pooled:
            last_a, last_b = pooled.pop()
            pooled.append((last_a + acc_a, last_b + acc_b))
        else:
            pooled.append((acc_a, acc_b))
    o = np.array(pooled)  # [K, 2]
    e = o.sum(axis=1, keepdims=True) * np.array([[share_a, 1 - share_a]])
    with np.errstate(divide="ignore", invalid="ignore"):
        g = 2.0 * float(np.where(o > 0, o * np.log(o / e), 0.0).sum())
    cells = len(pooled)
    williams = 1.0 + (cells + 1) / (6.0 * (na + nb))  # the 2 x K table's correction, as for one sample
    worst = sorted(((f"cell {i}", o[i, 0], e[i, 0]) for i in range(cells)),
                   key=lambda t: -abs(t[1] - t[2]) / math.sqrt(t[2]))
    return g / williams, max(cells - 1, 0), worst


def homogeneity_g_test(groups, alpha: float = NOMINAL_ALPHA) -> GTest:
    """Two samples over the same cells, per group (counts_a, counts_b): drawn from one law? A G-test of
    homogeneity on each 2 x K table (its own margins), statistics and df added over the groups; threshold the
    chi-square 1e-7 quantile, as ``g_test`` (false-failure rate <= 1e-6)."""
    total_g, total_df, worst = 0.0, 0, []
    for counts_a, counts_b in groups:
        g, df, w = _homogeneity_group(counts_a, counts_b)
        total_g, total_df = total_g + g, total_df + df
        worst += w
    worst.sort(key=lambda t: -abs(t[1] - t[2]) / math.sqrt(t[2]))
    threshold = chi2_isf(alpha, total_df) if total_df > 0 else 0.0
    return GTest(total_g, total_df, threshold, [], worst)


def g_test(observed, probs, labels: Optional[Sequence[str]] = None, alpha: float = NOMINAL_ALPHA) -> GTest:
    """Observed counts vs exact probabilities (same shape; flattened)."""
    return conditional_g_test([(observed, probs, labels)], alpha)


def assert_fits(result: GTest, what: str) -> None:
    """Fails with probability <= 1e-6 when the counts really follow the probabilities."""
    assert result.passed, f"{what}: counts do not follow the exact law\n{result.report()}"


def assert_fails_widely(result: GTest, what: str) -> None:
    """Negative control: a broken implementation must be rejected by a wide margin."""
    assert result.fails_widely, f"{what}: the broken implementation was NOT rejected\n{result.report()}"
