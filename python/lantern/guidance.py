"""Classifier-free guidance of logits, the one definition every decoding path uses: l = u + s (c - u).

A leaf module (torch only, no lantern imports), so that the readable reference of the ops can share it.
"""
from __future__ import annotations

from typing import Optional

import torch


def guide(cond: torch.Tensor, uncond: Optional[torch.Tensor], cfg_scale) -> torch.Tensor:
    """cond / uncond [B, ..., V] -> uncond + cfg_scale (cond - uncond) [B, ..., V]; uncond None: cond.
    cfg_scale a number or a per-row [B] tensor."""
    if uncond is None:
        return cond
    s = cfg_scale
    if isinstance(s, torch.Tensor):
        s = s.view(-1, *([1] * (cond.dim() - 1)))
    return uncond + s * (cond - uncond)


def guide_halves(logits: torch.Tensor, cfg_scale) -> torch.Tensor:
    """logits [2B, ...] of a doubled batch [cond; uncond] (LlamaGen's guidance) -> [B, ...] guided."""
    cond, uncond = torch.split(logits, logits.shape[0] // 2, dim=0)
    return guide(cond, uncond, cfg_scale)
