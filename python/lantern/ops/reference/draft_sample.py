"""SPEC §5 "Sampled drafts": a drafter's sampled children of tree nodes, drawn without replacement from the
nodes' draft distributions by the exponential race.

q is the SPEC §1 distribution of each node's logits (``process_logits``), except that a greedy row's
(temperature 0) is one-hot at its guided logits' first largest value: greedy verification keeps a draft only
if it is the target's top token, so a draw from the softmax would only waste it. The draws of node (b, n) are
the ``draws`` smallest keys E_i / q_i over the tokens with q_i > 0, ascending (the lower token on ties), with
E_i = -log1p(-u_i) and u_i the Philox uniform of counter (token i, node_ids[b, n], rows[b] or b, offset);
tokens whose key is +inf (q_i = 0) follow in token order.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from .philox import exponential_key, philox_uniform
from .process_logits import guide, process_logits, row_setting


class DraftSample(NamedTuple):
    probs: torch.Tensor  # [B, N, V] each node's q (float32; float64 for float64 logits)
    tokens: torch.Tensor  # [B, N, draws] int64


def draft_sample(logits: torch.Tensor, uncond_logits: Optional[torch.Tensor] = None, cfg_scale=1.0, temperature=1.0,
                 top_k=0, top_p=1.0, *, draws: int = 1, seed: int = 0, node_ids: torch.Tensor,
                 offset: int = 0, rows: Optional[torch.Tensor] = None) -> DraftSample:
    """logits [B, N, V] -> (probs [B, N, V], tokens [B, N, draws]); node_ids [B, N], rows [B] or None."""
    B, N, V = logits.shape
    q = process_logits(logits, uncond_logits, cfg_scale, temperature, top_k, top_p)
    greedy = row_setting(temperature, q, q.dtype) == 0  # [] or [B, 1, 1]
    if bool(greedy.any()):
        top = guide(logits, uncond_logits, cfg_scale).argmax(-1, keepdim=True)
        q = torch.where(greedy, torch.zeros_like(q).scatter_(-1, top, 1.0), q)
    row_keys = torch.arange(B, device=logits.device) if rows is None else rows
    u = philox_uniform(seed, torch.arange(V, device=logits.device)[None, None, :], node_ids[..., None],
                       row_keys[:, None, None], offset)
    keys = torch.where(q > 0, exponential_key(u) / q, float("inf"))
    return DraftSample(q, keys.sort(dim=-1, stable=True).indices[..., :draws].contiguous())
