"""The synthetic acceptance demo: how much more a relaxed (LANTERN) verification accepts than exact
speculative decoding, on logits shaped like a visual AR model's (mass spread over latent neighbours).

Synthetic setup: a random L2-normalised codebook [V, d]; at each tree node the target puts its mass on
the latent neighbourhood of a random centre code (a softmax of negative latent distance plus noise), and
the drafter sees a noisy copy of its parent's target. Draft trees are EAGLE-2 style: each node's
children are the drafter's top candidates (deterministic drafts).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import List

import torch

from . import ops


@dataclass
class DemoConfig:
    vocab: int = 4096
    dim: int = 8
    rows: int = 256
    branching: tuple = (4, 2, 2, 1)  # children per node at each depth
    neighbours: int = 64
    sharpness: float = 6.0
    draft_noise: float = 1.5
    seed: int = 0

    def __post_init__(self):
        """ValueError naming the option (and its ``lantern demo`` flag) for a setting the demo cannot run."""
        for name, flag, low in (("vocab", "--vocab", 2), ("dim", None, 1), ("rows", "--rows", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                where = f" ({flag})" if flag else ""
                raise ValueError(f"{name}{where} must be an int >= {low}, got {value!r}")
        k = self.neighbours
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < self.vocab:
            raise ValueError(f"neighbours (--k) must be an int in [0, vocab - 1 = {self.vocab - 1}], got {k!r}")
        if not self.branching or not all(isinstance(w, int) and w >= 1 for w in self.branching):
            raise ValueError(f"branching must be a non-empty sequence of ints >= 1, got {self.branching!r}")


def tree_parents(branching) -> List[int]:
    """parents of a full tree with the given children per node at each depth, in BFS order."""
    parents, frontier = [-1], [0]
    for width in branching:
        nxt = []
        for node in frontier:
            for _ in range(width):
                parents.append(node)
                nxt.append(len(parents) - 1)
        frontier = nxt
    return parents


def synthetic_batch(cfg: DemoConfig, codebook: torch.Tensor, gen: torch.Generator):
    """(target logits [B, T, V], tokens [B, T], parents [B, T]) for a batch of synthetic trees."""
    parents_list = tree_parents(cfg.branching)
    T, B, V = len(parents_list), cfg.rows, cfg.vocab
    parents = torch.tensor(parents_list).expand(B, T).contiguous()
    centres = torch.randint(V, (B, T), generator=gen)
    dist = torch.cdist(codebook[centres].reshape(B * T, -1), codebook).reshape(B, T, V)
    logits = -cfg.sharpness * dist**2 + torch.randn(B, T, V, generator=gen)
    draft_logits = logits + cfg.draft_noise * torch.randn(B, T, V, generator=gen)
    tokens = torch.zeros(B, T, dtype=torch.int64)
    tokens[:, 0] = torch.randint(V, (B,), generator=gen)
    for node in range(T):  # children of `node` = the drafter's top candidates at node
        children = [c for c in range(T) if parents_list[c] == node]
        if children:
            top = draft_logits[:, node].topk(len(children), dim=-1).indices
            tokens[:, children] = top
    return logits, tokens, parents


def run_demo(cfg: DemoConfig = DemoConfig(), deltas=(0.0, 0.05, 0.1, 0.2, 0.3), lams=(2.0, 4.0)) -> List[dict]:
    gen = torch.Generator().manual_seed(cfg.seed)
    codebook = torch.nn.functional.normalize(torch.randn(cfg.vocab, cfg.dim, generator=gen), dim=-1)
    t0 = time.perf_counter()
    neighbours = ops.latent_neighbours(codebook, cfg.neighbours, normalize=True)
    table_s = time.perf_counter() - t0
    logits, tokens, parents = synthetic_batch(cfg, codebook, gen)
    print(f"synthetic trees: {cfg.rows} rows x {tokens.shape[1]} nodes, V={cfg.vocab}, "
          f"neighbour table K={cfg.neighbours} built in {table_s:.2f}s")
    settings = [dict(delta=d, k=cfg.neighbours if d > 0 else 0) for d in deltas]
    settings += [dict(lam=lam, k=cfg.neighbours) for lam in lams]
    rows = []
    for s in settings:
        t0 = time.perf_counter()
        result = ops.verify(logits, tokens, parents, neighbours, seed=cfg.seed, offset=0, **s)
        elapsed = time.perf_counter() - t0
        tau = result.accept_len.double().mean().item() + 1.0
        first = (result.node_status[:, 1:] >= 0).any(1)
        row = dict(**s, tau=tau, accept_rate_depth1=(result.accept_len > 0).double().mean().item(),
                   verify_ms=1e3 * elapsed, rows=int(first.sum()))
        rows.append(row)
    base = rows[0]["tau"]
    print(f"{'mode':>8} {'delta':>6} {'lam':>5} {'k':>5} {'tau':>6} {'vs exact':>8} {'P(acc@1)':>9} {'ms':>7}")
    for r in rows:
        mode = "lambda" if "lam" in r else ("exact" if r["delta"] == 0 else "delta")
        print(f"{mode:>8} {r.get('delta', 0.0):>6.2f} {r.get('lam', 1.0):>5.1f} {r['k']:>5d} {r['tau']:>6.3f} "
              f"{r['tau'] / base:>7.2f}x {r['accept_rate_depth1']:>9.3f} {r['verify_ms']:>7.1f}")
    print("tau = mean tokens per target forward (accepted drafts + 1). delta = 0 is exact speculative "
          "sampling; larger delta / lambda accept more at a bounded total-variation cost (docs/usage.md).")
    return rows
