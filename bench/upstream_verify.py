"""An upstream-style verify, for benchmarks: the way the LANTERN research code (EAGLE-based) runs the relaxed
acceptance — one row, one node and one candidate at a time, with host-side control flow (Python loops over
nodes and siblings, ``.item()`` reads), each node's distribution computed with torch ops when the walk gets
there (LlamaGen's top_k_top_p_filtering, then softmax).

It implements the same rule as lantern (SPEC §3: deterministic drafts, delta mode, candidate budget, the
merged set A(x) removed on rejection, Philox uniforms and the exponential race), so its tokens can be
compared with lantern's; only the speed is meant to differ. Not a public API.
"""
from __future__ import annotations

import torch

from lantern.ops.reference.philox import ACCEPT_COUNTER, exponential_key, philox_uniform


def top_k_top_p_filtering(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """LlamaGen's filter on one row [V] (sort-based, as upstream)."""
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[-1]
        logits = torch.where(logits < kth, float("-inf"), logits)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, -1).cumsum(-1)
        remove = cumulative > top_p
        remove[1:] = remove[:-1].clone()  # keep the first token above the threshold
        remove[0] = False
        logits = logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    return logits


def node_probs(logits, uncond, b, node, cfg_scale, temperature, top_k, top_p):
    node_logits = logits[b, node].float()
    if uncond is not None:
        lu = uncond[b, node].float()
        node_logits = lu + cfg_scale * (node_logits - lu)
    node_logits = top_k_top_p_filtering(node_logits / temperature, top_k, top_p)
    return torch.softmax(node_logits, -1)


def upstream_verify(logits, tokens, parents, neighbours, *, uncond_logits=None, cfg_scale=1.0, temperature=1.0,
                    top_k=0, top_p=1.0, k=0, delta=0.0, seed=0, offset=0):
    """Returns (accept_len [B], next_token [B]) as lists."""
    B, T, V = logits.shape
    parents_host = parents.tolist()  # the tree shape lives on the host
    accept_lens, next_tokens = [], []
    for b in range(B):
        node, accepted_path = 0, []
        p = node_probs(logits, uncond_logits, b, 0, cfg_scale, temperature, top_k, top_p)
        while True:
            children = [c for c in range(1, T) if parents_host[b][c] == node]
            moved_on = False
            for c in children:
                x = int(tokens[b, c])
                nbrs = neighbours[x, :k].long()
                cum = p[nbrs].cumsum(0)
                m = int((cum <= delta).sum().item())
                p_tilde = p[x] + (cum[m - 1] if m > 0 else 0.0)
                u = float(philox_uniform(seed, ACCEPT_COUNTER, c, b, offset))
                if u < float(p_tilde):
                    accepted_path.append(c)
                    node = c
                    p = node_probs(logits, uncond_logits, b, c, cfg_scale, temperature, top_k, top_p)
                    moved_on = True
                    break
                p = p.clone()
                p[x] = 0.0
                p[nbrs[:m]] = 0.0
                p = p / p.sum()
            if not moved_on:
                break
        u = philox_uniform(seed, torch.arange(V), node, b, offset)
        keys = torch.where(p > 0, exponential_key(u) / p, float("inf"))
        accept_lens.append(len(accepted_path))
        next_tokens.append(int(keys.argmin()))
    return accept_lens, next_tokens
