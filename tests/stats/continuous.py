"""Exact laws of continuous_verify's pieces, computed in float64 (no sampling): equiprobable Gaussian cells,
the residual max(0, p - q) / Z on a fine grid, and the cells of observed tokens. One-dimensional unless said
otherwise; every figure here is a fixed function of the case, decided before any draw."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

GRID = 400_001  # points of the residual's numerical integration (error ~1e-9 of the mass per cell)


def normal_pdf(y: np.ndarray, mu: float, sigma: float) -> np.ndarray:
    return np.exp(-0.5 * ((y - mu) / sigma) ** 2) / (sigma * math.sqrt(2 * math.pi))


def gaussian_edges(mu: float, sigma: float, k: int) -> np.ndarray:
    """The k - 1 inner edges of k cells of equal probability under N(mu, sigma^2)."""
    q = torch.arange(1, k, dtype=torch.float64) / k
    return (mu + sigma * torch.special.ndtri(q)).numpy()


def cells(values: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """The cell index of each value, cells split at the sorted ``edges``."""
    return np.searchsorted(edges, values, side="right")


@dataclass
class Residual:
    """The residual max(0, p - q) / Z of p = N(mu_p, sigma_p^2), q = N(mu_q, sigma_q^2) in 1-D: its mass Z
    (= TV(p, q), the chance that one proposal is kept), its support [lo, hi] (where p > q; sigma_q > sigma_p
    makes it one interval) and ``k`` cells of equal residual probability inside it."""
    mass: float
    lo: float
    hi: float
    inner_edges: np.ndarray  # [k - 1]

    @classmethod
    def of(cls, mu_p: float, sigma_p: float, mu_q: float, sigma_q: float, k: int) -> "Residual":
        if not sigma_q > sigma_p:
            raise ValueError("these cases take sigma_q > sigma_p: the residual's support is then one interval")
        span = 12 * max(sigma_p, sigma_q)
        y = np.linspace(min(mu_p, mu_q) - span, max(mu_p, mu_q) + span, GRID)
        r = np.maximum(normal_pdf(y, mu_p, sigma_p) - normal_pdf(y, mu_q, sigma_q), 0.0)
        cdf = np.concatenate([[0.0], np.cumsum((r[1:] + r[:-1]) / 2 * np.diff(y))])
        mass = float(cdf[-1])
        inside = y[r > 0]
        targets = mass * np.arange(1, k) / k
        return cls(mass, float(inside[0]), float(inside[-1]), np.interp(targets, cdf, y))

    def cells(self, values: np.ndarray, margin: float):
        """(cell counts, probabilities): one cell below lo - margin and one above hi + margin, both of
        probability 0 (an impossible outcome fails the G-test outright), and the k cells inside."""
        edges = np.concatenate([[self.lo - margin], self.inner_edges, [self.hi + margin]])
        counts = np.bincount(cells(values, edges), minlength=len(edges) + 1)
        k = len(self.inner_edges) + 1
        probs = np.concatenate([[0.0], np.full(k, 1.0 / k), [0.0]])
        return counts, probs


def geometric_tries(mass: float, cap: int):
    """P(tries = k) for k = 1 .. cap and P(capped) (the last entry): each proposal is kept with probability
    ``mass``, independently."""
    k = np.arange(1, cap + 1)
    return np.concatenate([(1 - mass) ** (k - 1) * mass, [(1 - mass) ** cap]])
