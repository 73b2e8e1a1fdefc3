"""docs/cspd.md: verify a block of B x N drafted continuous tokens in one call (continuous speculative
decoding's acceptance test and residual sampler).

Per token (b, n), with x = draft[b, n] and the two heads' last reverse step N(mu_p, sigma_p) (target) and
N(mu_q, sigma_q) (drafter), diagonal, every density in log space:
  lg(x; mu, sigma, bw) = sum_c [ -log sigma_c - 1/2 ((x_c - mu_c) / (bw sigma_c))^2 ]   (2 pi dropped: it cancels)
  rule "exact":  log r = lg(x; mu_p, sigma_p, 1) - lg(x; mu_q, sigma_q, 1)
  rule "paper":  log r = log Sigma + lg(x; mu_p, sigma_p, bw) - lg(x; mu_q, sigma_q, bw),
                 log Sigma = logsig_q - logsig_p ("paper": prod sigma_q / sigma_p over the non-final steps) or
                 logsig_p - logsig_q ("code": the official code's reciprocal)
The draft is accepted iff log u_0 < log r. Otherwise proposals y_k = mu_p + sigma_p xi_k (k = 1, 2, ...) are
drawn from the target's last step, and y_k is kept iff u_k < 1 - exp(d_k) with d_k = lg(y_k; q) - lg(y_k; p) < 0
(probability max(0, p - q) / p: rejection sampling of the residual max(0, p - q), both rules at bw = 1).
After ``max_tries`` proposals without a keep, the last proposal (a plain sample of the target's last step)
is kept and the token is counted as capped: never a placeholder value.

Randomness: Philox4x32-10 (SPEC §5) with the layout of ``lantern.ops.reference.noise``, keyed by (row,
token position, try): c1 = rows[b], c2 = positions[b, n], c3 = offset + try (mod 2^32). u_k has purpose
PURPOSE_ACCEPT (channel 0, half 0); xi_k is Box-Muller on purpose PURPOSE_RESIDUAL's two halves per channel.
The defaults rows = b, positions = n key a token by its place in the block; the CSpD loop passes image ids
and raster positions, so that a run does not depend on its batch composition.

Returns tokens [B, N, C] float32, accepted [B, N] bool (the draft was kept) and tries [B, N] int32: 0 for an
accepted draft, k in 1..max_tries when proposal k was kept, max_tries + 1 when the cap was hit.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Tuple

import torch

from .noise import PURPOSE_ACCEPT, PURPOSE_RESIDUAL, box_muller, noise_counters
from .philox import philox_uniform

RULES = ("exact", "paper")
# deliberate faults for the statistical tests' negative controls (tests/stats): the reference only
FAULTS = ("first_proposal", "swapped_residual", "dropped_std_ratio")
SIGMA_RATIOS = ("paper", "code")
DEFAULT_MAX_TRIES = 1000


class ContinuousVerifyResult(NamedTuple):
    tokens: torch.Tensor  # [B, N, C] float32
    accepted: torch.Tensor  # [B, N] bool
    tries: torch.Tensor  # [B, N] int32


def capped(tries: torch.Tensor, max_tries: int) -> torch.Tensor:
    """[B, N] bool: the tokens whose residual sampler hit the cap (kept an unaccepted target sample)."""
    return tries > max_tries


def log_gaussian(x: torch.Tensor, mu: torch.Tensor, sigma: torch.Tensor, bandwidth: float = 1.0) -> torch.Tensor:
    """[..., C] -> [...]: sum_c -log sigma_c - 1/2 ((x_c - mu_c) / (bandwidth sigma_c))^2 (float32)."""
    z = (x - mu) / (bandwidth * sigma)
    return -(torch.log(sigma) + 0.5 * z * z).sum(-1)


def log_ratio(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule: str, bandwidth: float,
              sigma_ratio: str, faults: Tuple[str, ...] = ()) -> torch.Tensor:
    """log r [B, N] of the acceptance test (module docstring)."""
    if rule == "exact":
        return log_gaussian(draft, mu_p, sigma_p) - log_gaussian(draft, mu_q, sigma_q)
    log_sigma = logsig_q - logsig_p if sigma_ratio == "paper" else logsig_p - logsig_q
    if "dropped_std_ratio" in faults:
        log_sigma = torch.zeros_like(log_sigma)
    return log_sigma + (log_gaussian(draft, mu_p, sigma_p, bandwidth) - log_gaussian(draft, mu_q, sigma_q, bandwidth))


def accept_uniform(seed: int, rows: torch.Tensor, positions: torch.Tensor, step: int) -> torch.Tensor:
    """u [M] of try ``step`` (= offset + try, mod 2^32) for tokens keyed (rows [M], positions [M])."""
    return philox_uniform(seed, *noise_counters(PURPOSE_ACCEPT, 0, 0, rows, positions, step & 0xFFFFFFFF))


def proposal_noise(seed: int, rows: torch.Tensor, positions: torch.Tensor, step: int, C: int) -> torch.Tensor:
    """xi [M, C] of try ``step`` for tokens keyed (rows [M], positions [M])."""
    channel = torch.arange(C, dtype=torch.int64, device=rows.device)[None, :]  # [1, C]
    r, p = rows[:, None], positions[:, None]
    u0 = philox_uniform(seed, *noise_counters(PURPOSE_RESIDUAL, 0, channel, r, p, step & 0xFFFFFFFF))
    u1 = philox_uniform(seed, *noise_counters(PURPOSE_RESIDUAL, 1, channel, r, p, step & 0xFFFFFFFF))
    return box_muller(*torch.broadcast_tensors(u0, u1))


def default_keys(B: int, N: int, device: torch.device, rows: Optional[torch.Tensor],
                 positions: Optional[torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(rows [B], positions [B, N]) int64: the given keys, or b and n."""
    if rows is None:
        rows = torch.arange(B, dtype=torch.int64, device=device)
    if positions is None:
        positions = torch.arange(N, dtype=torch.int64, device=device)[None, :].expand(B, N)
    return rows.to(torch.int64), positions.to(torch.int64)


def continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule: str = "exact",
                      bandwidth: float = 1.0, sigma_ratio: str = "paper", max_tries: int = DEFAULT_MAX_TRIES,
                      seed: int = 0, offset: int = 0, *, rows: Optional[torch.Tensor] = None,
                      positions: Optional[torch.Tensor] = None, faults: Tuple[str, ...] = ()) -> ContinuousVerifyResult:
    """draft, mu_p, sigma_p, mu_q, sigma_q [B, N, C] float32; logsig_p, logsig_q [B, N] float32 (the sums of
    log-stds over the non-final steps); rows [B], positions [B, N] int64 (Philox keys, default b and n).
    See the module docstring for the definition. ``faults`` (negative controls of the statistical tests
    only) breaks it on purpose: "first_proposal" keeps every first proposal, "swapped_residual" tests
    proposals with max(0, 1 - p/q), "dropped_std_ratio" leaves log Sigma out of the paper rule."""
    unknown = set(faults) - set(FAULTS)
    if unknown:
        raise ValueError(f"unknown faults {sorted(unknown)}; choose from {FAULTS}")
    B, N, C = draft.shape
    seed, offset = int(seed), int(offset)
    rows, positions = default_keys(B, N, draft.device, rows, positions)
    row_key = rows[:, None].expand(B, N).reshape(-1)  # [M = B N]
    pos_key = positions.reshape(-1)  # [M]
    x = draft.reshape(-1, C)
    mp, sp, mq, sq = (t.reshape(-1, C) for t in (mu_p, sigma_p, mu_q, sigma_q))
    log_r = log_ratio(x, mp, sp, mq, sq, logsig_p.reshape(-1), logsig_q.reshape(-1), rule, float(bandwidth),
                      sigma_ratio, faults)  # [M]
    u = accept_uniform(seed, row_key, pos_key, offset)
    accepted = torch.log(u) < log_r  # u = 0 always accepts a finite log r; NaN (q(x) = p(x) = 0) rejects
    tokens = x.clone()
    tries = torch.zeros(B * N, dtype=torch.int32, device=draft.device)
    pending = (~accepted).nonzero().flatten()  # [P] tokens still sampling from the residual
    for k in range(1, int(max_tries) + 1):
        if pending.numel() == 0:
            break
        xi = proposal_noise(seed, row_key[pending], pos_key[pending], offset + k, C)
        y = mp[pending] + sp[pending] * xi  # [P, C] proposals from the target's last step
        d = log_gaussian(y, mq[pending], sq[pending]) - log_gaussian(y, mp[pending], sp[pending])  # log q/p
        if "swapped_residual" in faults:
            d = -d
        u_k = accept_uniform(seed, row_key[pending], pos_key[pending], offset + k)
        keep = (d < 0) & (u_k < -torch.expm1(d))
        if "first_proposal" in faults:
            keep = torch.ones_like(keep)
        tokens[pending] = y
        tries[pending] = k
        pending = pending[~keep]
    tries[pending] = int(max_tries) + 1
    return ContinuousVerifyResult(tokens.reshape(B, N, C), accepted.reshape(B, N), tries.reshape(B, N))
