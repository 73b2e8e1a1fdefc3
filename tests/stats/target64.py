"""SPEC §1 written independently in float64 numpy: the target distribution at one tree node.
Used by the oracle (to turn a test case's logits into P_node) and to check ``lantern.ops.process_logits``."""
from __future__ import annotations

import numpy as np


def guided_logits(cond, uncond=None, cfg_scale=1.0) -> np.ndarray:
    """l = lu + s * (lc - lu) (float64 here); lc alone without unconditional logits."""
    cond = np.asarray(cond, dtype=np.float64)
    if uncond is None:
        return cond.copy()
    uncond = np.asarray(uncond, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        out = uncond + cfg_scale * (cond - uncond)
    return np.where(np.isneginf(cond) | np.isneginf(uncond), -np.inf, out)


def softmax_over(l: np.ndarray, keep: np.ndarray) -> np.ndarray:
    w = np.where(keep, np.exp(np.where(keep, l, -np.inf) - np.max(np.where(keep, l, -np.inf))), 0.0)
    return w / w.sum()


def top_k_keep(l: np.ndarray, top_k: int) -> np.ndarray:
    """Keep i iff l_i >= the top_k-th largest value (all ties at the threshold kept)."""
    V = l.shape[0]
    if not 0 < top_k < V:
        return np.ones(V, dtype=bool)
    threshold = sorted(l.tolist(), reverse=True)[top_k - 1]
    return l >= threshold


def top_p_keep(pi: np.ndarray, top_p: float) -> np.ndarray:
    """Keep i iff the mass of tokens strictly more probable than i is <= top_p (no sort needed)."""
    if top_p >= 1.0:
        return np.ones(pi.shape[0], dtype=bool)
    above = np.array([pi[pi > pi_i].sum() for pi_i in pi])
    return above <= top_p


def target_distribution(cond, uncond=None, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """P_node for one node's logits [V] (float64)."""
    l = guided_logits(cond, uncond, cfg_scale)
    if temperature == 0:
        return softmax_over(l, np.isfinite(l) | (l > -np.inf))
    l = l / temperature
    keep = top_k_keep(l, top_k) & (l > -np.inf)
    pi = softmax_over(l, keep)
    keep &= top_p_keep(pi, top_p)
    return softmax_over(l, keep)


def target_distributions(cond, uncond=None, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0) -> np.ndarray:
    """Row-wise target_distribution over a [N, V] array."""
    cond = np.asarray(cond, dtype=np.float64)
    rows = [target_distribution(cond[i], None if uncond is None else uncond[i], cfg_scale, temperature,
                                top_k, top_p) for i in range(cond.shape[0])]
    return np.stack(rows)
