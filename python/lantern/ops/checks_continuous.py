"""Argument checks for continuous_verify (docs/cspd.md): each raises ValueError/TypeError naming the argument.
The value scans (NaN / inf, non-positive stds, key ranges) run in eager mode only (``checks.scan_values``),
folded into one host sync; the argument at fault is found only once something is wrong."""
from __future__ import annotations

import math
from typing import Optional

import torch

from . import checks as c
from .checks_verify import _check_counter
from .reference.continuous_verify import RULES, SIGMA_RATIOS

BLOCK_NAMES = ("draft", "mu_p", "sigma_p", "mu_q", "sigma_q")
MAX_KEY = 2**32


def check_continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio,
                            max_tries, seed, offset, rows: Optional[torch.Tensor],
                            positions: Optional[torch.Tensor]) -> None:
    c.tensor("draft", draft, ndim=3, dtypes=(torch.float32,))
    B, N, C = draft.shape
    if C < 1:
        raise ValueError(f"draft must have shape [B, N, C] with C >= 1, got {list(draft.shape)}")
    blocks = (draft, mu_p, sigma_p, mu_q, sigma_q)
    for name, t in zip(BLOCK_NAMES[1:], blocks[1:]):
        c.tensor(name, t, dtypes=(torch.float32,), device=draft.device, shape=(B, N, C))
    for name, t in (("logsig_p", logsig_p), ("logsig_q", logsig_q)):
        c.tensor(name, t, dtypes=(torch.float32,), device=draft.device, shape=(B, N))
    if rows is not None:
        c.tensor("rows", rows, dtypes=c.INT_DTYPES, device=draft.device, shape=(B,))
    if positions is not None:
        c.tensor("positions", positions, dtypes=c.INT_DTYPES, device=draft.device, shape=(B, N))
    check_settings(rule, bandwidth, sigma_ratio, max_tries)
    _check_counter("seed", seed, 64)
    _check_counter("offset", offset, 32)
    if c.scan_values():
        _scan(blocks, logsig_p, logsig_q, rows, positions)


def check_settings(rule, bandwidth, sigma_ratio, max_tries) -> None:
    """The rule and its settings (shared with lantern.decoding.CSpDConfig)."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    if sigma_ratio not in SIGMA_RATIOS:
        raise ValueError(f"sigma_ratio must be one of {SIGMA_RATIOS}, got {sigma_ratio!r}")
    if isinstance(bandwidth, bool) or not isinstance(bandwidth, (int, float)) or not math.isfinite(bandwidth) \
            or bandwidth <= 0:
        raise ValueError(f"bandwidth must be a finite number > 0, got {bandwidth!r}")
    if rule == "exact" and (bandwidth != 1 or sigma_ratio != "paper"):
        raise ValueError(f"bandwidth and sigma_ratio belong to rule='paper'; rule='exact' compares the real "
                         f"densities (bandwidth=1, sigma_ratio='paper'), got bandwidth={bandwidth!r}, "
                         f"sigma_ratio={sigma_ratio!r}")
    if isinstance(max_tries, bool) or not isinstance(max_tries, int) or not 1 <= max_tries < 2**31 - 1:
        raise ValueError(f"max_tries must be an int in [1, 2^31 - 1), got {max_tries!r}")


def _scan(blocks, logsig_p, logsig_q, rows, positions) -> None:
    """One host sync when every value is valid; the first faulty argument named otherwise."""
    draft, mu_p, sigma_p, mu_q, sigma_q = blocks
    faults = [~torch.isfinite(t).all() for t in (draft, mu_p, mu_q, logsig_p, logsig_q)]
    faults.append(~(torch.isfinite(sigma_p) & (sigma_p > 0)).all())
    faults.append(~(torch.isfinite(sigma_q) & (sigma_q > 0)).all())
    for keys in (rows, positions):
        if keys is not None and keys.numel() > 0:
            faults.append((keys.min() < 0) | (keys.max() >= MAX_KEY))
    if not bool(torch.stack(faults).any()):
        return
    for name, t in (("draft", draft), ("mu_p", mu_p), ("mu_q", mu_q), ("logsig_p", logsig_p),
                    ("logsig_q", logsig_q)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or infinite values")
    for name, t in (("sigma_p", sigma_p), ("sigma_q", sigma_q)):
        if not bool((torch.isfinite(t) & (t > 0)).all()):
            raise ValueError(f"{name} must hold finite stds > 0; it contains NaN, inf or values <= 0")
    for name, keys in (("rows", rows), ("positions", positions)):
        if keys is not None:
            c.in_range(name, keys, 0, MAX_KEY)
