"""continuous_verify (docs/cspd.md): CSpD's acceptance test for a block of B x N drafted continuous tokens
(MAR's diffusion heads), with the residual sampler for the rejected ones, in one call."""
from __future__ import annotations

import math
from typing import Optional, Union

import torch

from .. import _backend
from . import checks as c
from . import library
from .reference.continuous_verify import DEFAULT_MAX_TRIES, RULES, SIGMA_RATIOS, ContinuousVerifyResult, default_keys
from .reference.continuous_verify import continuous_verify as reference

ScalarOrTensor = Union[int, float, torch.Tensor]

# draft, mu_p, sigma_p, mu_q, sigma_q float32 [B, N, C]; logsig_p, logsig_q float32 [B, N] (log-std sums over
# the non-final steps); rows int64 [B], positions int64 [B, N] (Philox keys c1, c2); rule "exact" | "paper";
# bandwidth (paper); sigma_ratio "paper" | "code"; max_tries >= 1; seed, offset one-element int64 (c3 = offset +
# try). Returns (tokens float32 [B, N, C], accepted bool [B, N], tries int32 [B, N]: 0 accepted, k proposal k
# kept, max_tries + 1 capped with the last proposal kept).
SCHEMA = ("(Tensor draft, Tensor mu_p, Tensor sigma_p, Tensor mu_q, Tensor sigma_q, Tensor logsig_p, "
          "Tensor logsig_q, Tensor rows, Tensor positions, str rule, float bandwidth, str sigma_ratio, int max_tries, "
          "Tensor seed, Tensor offset) -> (Tensor, Tensor, Tensor)")


def fake(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions, rule, bandwidth, sigma_ratio,
         max_tries, seed, offset):
    B, N, C = draft.shape
    return (draft.new_empty((B, N, C), dtype=torch.float32), draft.new_empty((B, N), dtype=torch.bool),
            draft.new_empty((B, N), dtype=torch.int32))


def to_schema(backend: str, draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule="exact", bandwidth=1.0,
              sigma_ratio="paper", max_tries=DEFAULT_MAX_TRIES, seed=0, offset=0, *, rows=None,
              positions=None) -> tuple:
    """The schema's arguments: the keys as contiguous int64 (rows [B] default b, positions [B, N] default n),
    seed and offset as 0-d int64 tensors on the block's device."""
    B, N, _ = draft.shape
    dev = draft.device
    rows, positions = default_keys(B, N, dev, rows, positions)
    return (draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows.contiguous(), positions.contiguous(),
            str(rule), float(bandwidth), str(sigma_ratio), int(max_tries), library.seed_tensor(seed, dev),
            library.offset_tensor(offset, dev))


def _reference_kernel(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions, rule, bandwidth,
                      sigma_ratio, max_tries, seed, offset):
    return tuple(reference(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio,
                           max_tries, library.unsigned(seed), int(offset), rows=rows, positions=positions))


def _result(out) -> ContinuousVerifyResult:
    return ContinuousVerifyResult(*out)


OP = library.Op("continuous_verify", SCHEMA, fake, to_schema=to_schema, from_schema=_result,
                reference_kernel=_reference_kernel, backends={
                    "reference": reference,      # ops/reference/continuous_verify.py
                    "cpu": library.EXTENSION,    # csrc/cpu/continuous_verify.cpp
                    "cuda": library.EXTENSION,   # csrc/cuda/continuous_verify.cu
                    "triton": "lantern.kernels.continuous_verify",
                })


def continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule: str = "exact",
                      bandwidth: float = 1.0, sigma_ratio: str = "paper", max_tries: int = DEFAULT_MAX_TRIES,
                      seed: ScalarOrTensor = 0, offset: ScalarOrTensor = 0, *, rows=None, positions=None,
                      backend: Optional[str] = None) -> ContinuousVerifyResult:
    """docs/cspd.md: accept or resample a block of B x N drafted continuous tokens in one call ->
    (tokens [B, N, C], accepted [B, N] bool, tries [B, N] int32; tries > max_tries: the residual sampler hit
    its cap and kept a target sample). draft and both heads' last-step means / stds [B, N, C] float32, the
    log-std sums over the non-final steps [B, N]; rule "exact" | "paper" (bandwidth, sigma_ratio "paper" |
    "code"); Philox keys rows [B] and positions [B, N] (default b and n). See
    ``reference.continuous_verify`` for the definition. ``backend``: which backend runs it (default: the one
    ``lantern.enable_fused`` / ``lantern.fused`` chose)."""
    bandwidth, max_tries, seed, offset = map(c.plain, (bandwidth, max_tries, seed, offset))
    check(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio, max_tries, seed,
          offset, rows, positions)
    impl = _backend.dispatch("continuous_verify", draft.device, backend)
    return impl(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio, max_tries,
                seed, offset, rows=rows, positions=positions)


BLOCK_NAMES = ("draft", "mu_p", "sigma_p", "mu_q", "sigma_q")
MAX_KEY = 2**32


def check(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio,
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
    c.check_counter("seed", seed, 64)
    c.check_counter("offset", offset, 32)
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
