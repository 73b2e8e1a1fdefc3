"""Continuous speculative decoding (``cspd.py``) from a given context: one drafted and verified block, or one
MAR step of one model, for rows that share the context (the statistical tests and bench/bench_cspd.py).
"""
from __future__ import annotations

import torch

from .cspd import CSpDConfig, CSpDRun
from .mar import cfg_scale_at, conditions, forward_guided, predict_positions


@torch.no_grad()
def block_from_context(target, drafter, tokens: torch.Tensor, mask: torch.Tensor, order: torch.Tensor,
                       labels: torch.Tensor, image_ids: torch.Tensor, *, num_iter: int, first: int,
                       config: CSpDConfig, cfg: float = 1.0, cfg_schedule: str = "linear",
                       temperature: float = 1.0, seed: int = 0):
    """One drafted and verified block of ``config.gamma`` MAR steps from step ``first``, for B rows that share
    one context: tokens [B, L, C] and mask [B, L] (the verified state), order [L] (the rows' common MAR
    order), labels [B], image_ids [B] (distinct ids give the rows independent noise). Returns (the block's
    tokens [B, N, C], its positions [N], the block's last mask_len, CSpDStats)."""
    config.check()
    B = tokens.shape[0]
    run = CSpDRun(target, drafter, labels, B, image_ids, num_iter, config, cfg, cfg_schedule, temperature, seed)
    run.orders = order[None, :].expand(B, -1)
    block, _, mask_len, drafted = run.draft(tokens, mask, first, min(first + config.gamma, num_iter))
    out = run.verify(tokens, mask, block, mask_len, drafted)
    positions = drafted[0].nonzero().flatten()
    return out[:, positions], positions, mask_len, run.stats


@torch.no_grad()
def one_step_from_context(model, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor,
                          labels: torch.Tensor, image_ids: torch.Tensor, *, mask_len: int, cfg: float = 1.0,
                          cfg_schedule: str = "linear", temperature: float = 1.0, seed: int = 0,
                          last_step_noise: bool = True):
    """``model`` sampling ``positions`` [N] in one MAR step from the context (tokens [B, L, C], mask [B, L]) at
    the guidance of a step that leaves mask_len masked: (tokens, last-step means, last-step stds), each
    [B, N, C]. At the image ids of a ``block_from_context`` call it sees that call's trajectories."""
    B = tokens.shape[0]
    z, z_uncond = forward_guided(model, tokens, mask, conditions(model, labels, B, cfg != 1.0))
    to_predict = torch.zeros_like(mask)
    to_predict[:, positions] = True
    scale = cfg_scale_at(cfg, cfg_schedule, model.config.seq_len, mask_len)
    _, out = predict_positions(model, z, z_uncond, to_predict, image_ids, seed=seed, cfg=scale,
                               temperature=temperature, last_step_noise=last_step_noise)
    return tuple(t.reshape(B, len(positions), -1) for t in (out.tokens, out.mean0, out.std0))
