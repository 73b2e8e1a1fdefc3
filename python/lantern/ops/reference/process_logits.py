"""§1: the target distribution at a tree node — guidance, temperature, top-k, top-p, normalise.

Math runs in float32 (float64 when the logits are float64, for the exact oracle tests).
"""
from __future__ import annotations

from typing import Optional

import torch


def compute_dtype(logits: torch.Tensor) -> torch.dtype:
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def row_setting(value, logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A scalar or per-row [B] setting, shaped to broadcast against logits [B, ..., V]."""
    t = torch.as_tensor(value, dtype=dtype, device=logits.device)
    if t.dim() == 1:
        t = t.reshape(t.shape[0], *([1] * (logits.dim() - 1)))
    return t


def guide(logits, uncond_logits, cfg_scale) -> torch.Tensor:
    """l = lu + s * (lc - lu). A token masked (-inf) in either input stays masked."""
    dtype = compute_dtype(logits)
    lc = logits.to(dtype)
    if uncond_logits is None:
        return lc
    lu = uncond_logits.to(dtype)
    s = row_setting(cfg_scale, logits, dtype)
    guided = lu + s * (lc - lu)
    return torch.where(torch.isneginf(lc) | torch.isneginf(lu), float("-inf"), guided)


def top_k_mask(l: torch.Tensor, top_k) -> torch.Tensor:
    """keep_i iff l_i >= the top_k-th largest value (ties at the threshold all kept); top_k 0 = off."""
    V = l.shape[-1]
    k = torch.as_tensor(top_k, device=l.device).to(torch.int64)
    if k.dim() == 1:
        k = k.reshape(k.shape[0], *([1] * (l.dim() - 1)))
    k = k.expand(*l.shape[:-1], 1)
    sorted_desc = l.sort(dim=-1, descending=True).values
    threshold = sorted_desc.gather(-1, (k.clamp(1, V) - 1))
    active = (k > 0) & (k < V)
    return ~active | (l >= threshold)


def top_p_mask(pi: torch.Tensor, top_p) -> torch.Tensor:
    """keep_i iff sum_{j: pi_j > pi_i} pi_j <= top_p: HF's shift-right rule, ties kept or dropped together."""
    sorted_pi, order = pi.sort(dim=-1, descending=True)
    inclusive = sorted_pi.to(torch.float64).cumsum(-1)
    # first sorted position of each value's tie group: everything before it is strictly larger
    first = torch.searchsorted(-sorted_pi.contiguous(), -sorted_pi.contiguous(), right=False)
    first = first.clamp(max=pi.shape[-1] - 1)  # NaN rows (unchecked input) find no place: keep the index valid
    strictly_larger = (inclusive - sorted_pi.to(torch.float64)).gather(-1, first)
    p = row_setting(top_p, pi, torch.float64)
    keep_sorted = (strictly_larger <= p) | (p >= 1)  # top_p = 1 is "off", whatever the rounding
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def masked_softmax(l: torch.Tensor, keep: Optional[torch.Tensor]) -> torch.Tensor:
    """softmax of l over the tokens ``keep`` holds (None: every token)."""
    if keep is not None:
        l = torch.where(keep, l, float("-inf"))
    w = torch.exp(l - l.max(dim=-1, keepdim=True).values)
    return w / w.sum(dim=-1, keepdim=True)


def _is_on(setting, on) -> bool:
    """Whether a filter is on for any row (skipping an all-off filter changes no result). A number is
    tested on the host; a per-row tensor costs a device read."""
    if isinstance(setting, (int, float)):
        return bool(on(setting))
    return bool(on(torch.as_tensor(setting)).any())


def _plain(temperature, top_k, top_p) -> bool:
    """Settings given as numbers that leave every token in: a temperature above 0, no top-k, no top-p."""
    numbers = all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (temperature, top_k, top_p))
    return numbers and temperature > 0 and top_k == 0 and top_p >= 1


def process_logits(logits, uncond_logits=None, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0):
    """[..., V] logits -> [..., V] probabilities (float32, or float64 for float64 logits).
    Rows with temperature 0 (greedy) get the unfiltered softmax of the guided logits."""
    l = guide(logits, uncond_logits, cfg_scale)
    if _plain(temperature, top_k, top_p):  # the same values as below, without the no-op masks
        return masked_softmax(l if temperature == 1 else l / row_setting(temperature, l, l.dtype), None)
    temp = row_setting(temperature, l, l.dtype)
    greedy = temp == 0
    scaled = l / torch.where(greedy, torch.ones_like(temp), temp)
    keep = torch.ones_like(scaled, dtype=torch.bool)
    if _is_on(top_k, lambda v: v > 0):
        keep = top_k_mask(scaled, top_k)
    if _is_on(top_p, lambda v: v < 1):
        keep &= top_p_mask(masked_softmax(scaled, keep), top_p)
    sampled = masked_softmax(scaled, keep)
    if not _is_on(temperature, lambda v: v == 0):
        return sampled
    return torch.where(greedy, masked_softmax(l, torch.ones_like(keep)), sampled)
