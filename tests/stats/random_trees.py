"""Random verify inputs (trees with padding nodes, logits, settings) for greedy brute-force and property
tests. Everything is numpy, generated from one integer seed so hypothesis can shrink over it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from op_cases import random_tree

from . import oracle
from .harness import random_draft, random_neighbours
from .target64 import guided_logits, target_distribution


@dataclass
class Batch:
    logits: np.ndarray  # [B, T, V] float64
    tokens: np.ndarray  # [B, T] int64, -1 at padding
    parents: np.ndarray  # [B, T] int64, -1 at the root and padding
    neighbours: np.ndarray  # [V, K] int32
    uncond: Optional[np.ndarray] = None
    cfg_scale: float = 1.0
    temperature: np.ndarray = None  # [B]
    top_k: np.ndarray = None  # [B]
    top_p: np.ndarray = None  # [B]
    draft: Optional[np.ndarray] = None  # [B, T, V]
    relax: oracle.Relaxation = oracle.EXACT

    @property
    def shape(self):
        return self.logits.shape

    def target(self, b: int, node: int) -> np.ndarray:
        return target_distribution(self.logits[b, node], None if self.uncond is None else self.uncond[b, node],
                                   self.cfg_scale, float(self.temperature[b]), int(self.top_k[b]),
                                   float(self.top_p[b]))

    def guided(self, b: int) -> np.ndarray:
        return guided_logits(self.logits[b], None if self.uncond is None else self.uncond[b], self.cfg_scale)

    def kwargs(self, per_row_tensors: bool = True, seed: int = 0, offset: int = 0) -> dict:
        """verify's arguments (settings as per-row tensors, or as Python scalars when uniform)."""
        def setting(values, dtype, cast):
            if per_row_tensors:
                return torch.as_tensor(values, dtype=dtype)
            assert np.all(values == values[0])
            return cast(values[0])
        kw = dict(uncond_logits=None if self.uncond is None else torch.as_tensor(self.uncond),
                  cfg_scale=self.cfg_scale, temperature=setting(self.temperature, torch.float64, float),
                  top_k=setting(self.top_k, torch.int64, int), top_p=setting(self.top_p, torch.float64, float),
                  draft_probs=None if self.draft is None else torch.as_tensor(self.draft),
                  k=self.relax.k, delta=self.relax.delta, budget=self.relax.budget, seed=seed, offset=offset)
        if self.relax.lam is not None:
            kw["lam"] = self.relax.lam
        return kw

    def tensors(self):
        return (torch.as_tensor(self.logits), torch.as_tensor(self.tokens), torch.as_tensor(self.parents),
                torch.as_tensor(self.neighbours))


def random_tokens(rng: np.random.Generator, parents: np.ndarray, P_of, V: int, draft=None) -> np.ndarray:
    """Distinct sibling tokens: from the drafter row when given, else often the parent's most likely
    tokens (so greedy paths get deep), sometimes any token."""
    T = len(parents)
    tokens = np.full(T, -1, dtype=np.int64)
    tokens[0] = rng.integers(V)
    for node in range(T):
        kids = [c for c in range(1, T) if parents[c] == node]
        if not kids:
            continue
        n = len(kids)
        assert n <= V, "a node cannot have more distinct children than the vocabulary"
        if draft is not None:
            chosen = rng.choice(V, size=n, replace=False, p=draft[node])
        else:
            ranked = np.argsort(-P_of(node), kind="stable")
            chosen = ranked[:n] if rng.random() < 0.5 else rng.choice(V, size=n, replace=False)
            chosen = rng.permutation(chosen)
        for c, x in zip(kids, chosen):
            tokens[c] = x
    return tokens


def random_batch(seed: int, B: int, T: int, V: int, K: int, relax: oracle.Relaxation, *, greedy_rate: float = 0.0,
                 sampled: bool = False, guidance: bool = True, grid: Optional[float] = None) -> Batch:
    """A batch of independent random trees. grid: round logits to multiples of it (creates exact ties)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1.5, size=(B, T, V))
    uncond = rng.normal(0, 1.5, size=(B, T, V)) if guidance else None
    if grid:
        logits = np.round(logits / grid) * grid
        uncond = None if uncond is None else np.round(uncond / grid) * grid
    greedy = rng.random(B) < greedy_rate
    batch = Batch(logits=logits, tokens=np.zeros((B, T), dtype=np.int64), parents=np.zeros((B, T), dtype=np.int64),
                  neighbours=random_neighbours(rng, V, K), uncond=uncond,
                  cfg_scale=float(rng.choice([1.0, 2.0, 4.0])) if guidance else 1.0,
                  temperature=np.where(greedy, 0.0, rng.choice([0.5, 1.0, 1.7], size=B)),
                  top_k=rng.choice([0, max(1, V // 2), V - 1], size=B),
                  top_p=rng.choice([1.0, 0.9, 0.6], size=B), relax=relax)
    batch.draft = np.stack([random_draft(rng, T, V) for _ in range(B)]) if sampled else None
    for b in range(B):
        batch.parents[b] = random_tree(rng, T)  # nodes padding w.p. 0.2, else a uniform earlier real node
        batch.tokens[b] = random_tokens(rng, batch.parents[b], lambda n: batch.target(b, n), V,
                                        None if batch.draft is None else batch.draft[b])
    return batch
