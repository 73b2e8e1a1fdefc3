"""The fixed test cases of the statistical suite (small V, depth <= 3), built from seeded generators."""
from __future__ import annotations

from typing import Dict, Sequence

import numpy as np

from . import oracle
from .harness import Case, random_draft, random_logits, random_neighbours
from .target64 import target_distribution

CHAIN = [-1, 0, 1, 2]  # depth 3
BRANCHING = [-1, 0, 0, 0, 1, 1, 4]  # root with 3 children; node 1 with 2; node 4 with 1 (depth 3)
SHAPES = {"chain": CHAIN, "branching": BRANCHING}
SETTINGS = dict(cfg_scale=1.6, temperature=1.3, top_k=10, top_p=0.95)  # guidance + all filters on
V_STATS = 12
K_STATS = 4


def _child_tokens(rng, P_parent: np.ndarray, n: int) -> list:
    """n distinct tokens, mostly likely ones (like a good drafter), sometimes any token."""
    mix = 0.8 * P_parent + 0.2 / P_parent.size
    return rng.choice(P_parent.size, size=n, replace=False, p=mix / mix.sum()).tolist()


def make_case(seed: int, parents: Sequence[int], relax: oracle.Relaxation = oracle.EXACT, sampled: bool = False,
              V: int = V_STATS, K: int = K_STATS, name: str = "case") -> Case:
    """A random case: guided logits, the §1 filters on, tokens drawn node by node from the targets
    (deterministic drafts) or from the drafter rows (sampled drafts)."""
    rng = np.random.default_rng(seed)
    T = len(parents)
    logits = random_logits(rng, T, V, scale=1.0)
    case = Case(tokens=[0] * T, parents=list(parents), logits=logits, neighbours=random_neighbours(rng, V, K),
                relax=relax, uncond=random_logits(rng, T, V, scale=1.0),
                name=name, **SETTINGS)
    if sampled:
        guided = case.logits + SETTINGS["cfg_scale"] * (case.logits - case.uncond)
        case.draft = random_draft(rng, T, V, like=guided / SETTINGS["temperature"])
    P = case.targets()
    case.tokens[0] = int(rng.integers(V))
    for node in range(T):
        kids = oracle.children_of(parents, node)
        if not kids:
            continue
        tokens = (rng.choice(V, size=len(kids), replace=False, p=case.draft[node]).tolist() if sampled
                  else _child_tokens(rng, P[node], len(kids)))
        for c, x in zip(kids, tokens):
            case.tokens[c] = x
    return case


class PrefixModel:
    """A toy target and drafter whose distributions depend on the emitted prefix (for static trees whose
    children are sampled afresh in every row). Logits are fixed functions of (seed, prefix)."""

    def __init__(self, seed: int, V: int, settings: Dict = SETTINGS):
        self.seed, self.V, self.settings = seed, V, settings
        self._cache: Dict[tuple, tuple] = {}

    def _rows(self, prefix: tuple):
        if prefix not in self._cache:
            rng = np.random.default_rng([self.seed, len(prefix), *prefix])
            cond, uncond = rng.normal(0, 1.0, self.V), rng.normal(0, 1.0, self.V)
            draft = np.exp(0.6 * cond + rng.normal(0, 0.8, self.V))  # correlated with the target
            self._cache[prefix] = (cond, uncond, draft / draft.sum())
        return self._cache[prefix]

    def logits(self, prefix: tuple):
        return self._rows(prefix)[:2]

    def target(self, prefix: tuple) -> np.ndarray:
        cond, uncond = self.logits(prefix)
        return target_distribution(cond, uncond, **self.settings)

    def draft(self, prefix: tuple) -> np.ndarray:
        return self._rows(prefix)[2]


def sample_static_trees(model: PrefixModel, shape: Sequence[int], rows: int, rng: np.random.Generator):
    """Per row, draw every node's children from draft(prefix) without replacement, in child order (Gumbel
    top-n keys give an ordered draw without replacement). Returns tokens, cond, uncond, draft arrays."""
    T, V = len(shape), model.V
    tokens = np.zeros((rows, T), dtype=np.int64)
    prefixes = [[()] * rows for _ in range(T)]
    for node in range(T):
        kids = oracle.children_of(shape, node)
        if not kids:
            continue
        by_prefix: Dict[tuple, list] = {}
        for b in range(rows):
            by_prefix.setdefault(prefixes[node][b], []).append(b)
        for prefix, members in by_prefix.items():
            members = np.array(members)
            keys = np.log(model.draft(prefix))[None, :] + rng.gumbel(size=(len(members), V))
            order = np.argsort(-keys, axis=1)[:, :len(kids)]
            for j, c in enumerate(kids):
                tokens[members, c] = order[:, j]
                for b, x in zip(members, order[:, j]):
                    prefixes[c][b] = prefix + (int(x),)
    cond = np.zeros((rows, T, V))
    uncond = np.zeros((rows, T, V))
    draft = np.zeros((rows, T, V))
    for node in range(T):
        distinct: Dict[tuple, list] = {}
        for b in range(rows):
            distinct.setdefault(prefixes[node][b], []).append(b)
        for prefix, members in distinct.items():
            cond[members, node], uncond[members, node] = model.logits(prefix)
            draft[members, node] = model.draft(prefix)
    return tokens, cond, uncond, draft
