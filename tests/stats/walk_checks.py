"""The statistical checks, each returning G-tests, so that a positive test asserts they all pass and its
negative control asserts that the same check rejects a broken implementation."""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import numpy as np
import torch

from . import oracle
from .cases import PrefixModel, sample_static_trees
from .gtest import GTest, conditional_g_test, g_test
from .harness import Case, cell_labels, draws_for, emitted_tokens, outcome_counts, run_copies, run_rows


def tokens_after_each_node(result, tokens, T: int, V: int) -> np.ndarray:
    """counts[n, y]: rows whose walk reached node n (the root, or n accepted) and then emitted y next
    (the accepted child's token, or next_token when the walk stopped at n)."""
    path, n_acc, nxt = result.path.numpy(), result.accept_len.numpy(), result.next_token.numpy()
    B = len(n_acc)
    tokens = np.broadcast_to(tokens, (B, T))
    nodes = np.concatenate([np.zeros((B, 1), dtype=np.int64), path], axis=1)  # depth j -> node
    counts = np.zeros((T, V), dtype=np.int64)
    for depth in range(nodes.shape[1]):
        reached = n_acc >= depth
        if not reached.any():
            break
        continues = n_acc > depth
        following = np.where(continues, path[:, min(depth, path.shape[1] - 1)] if path.shape[1] else 0, 0)
        emitted = np.where(continues, tokens[np.arange(B), np.maximum(following, 0)], nxt)
        np.add.at(counts, (nodes[reached, depth], emitted[reached]), 1)
    return counts


def outcome_vs_oracle(verify: Callable, case: Case, seed: int) -> List[GTest]:
    """(last node, next token) frequencies from DRAWS copies vs the oracle's exact law."""
    result = run_copies(verify, case, draws_for(verify), seed=seed)
    counts = outcome_counts(result, case.T, case.V)
    return [g_test(counts, case.outcome_law(), cell_labels(case.T, case.V))]


def exact_fixed_tree(verify: Callable, case: Case, seed: int, dtype=torch.float64) -> List[GTest]:
    """Deterministic drafts at delta = 0: the outcome law matches the oracle, and at every node the walk
    reaches, the next emitted token follows the target P_node (conditional G-test over nodes).
    With float32 logits the backend's P differs from the float64 oracle by ~1e-7, far below what 10^5
    draws can resolve (~3e-3)."""
    result = run_copies(verify, case, draws_for(verify), seed=seed, dtype=dtype)
    counts = outcome_counts(result, case.T, case.V)
    after = tokens_after_each_node(result, np.array(case.tokens), case.T, case.V)
    P = case.targets()
    labels = lambda n: [f"(after node {n}, token {y})" for y in range(case.V)]
    return [g_test(counts, case.outcome_law(), cell_labels(case.T, case.V)),
            conditional_g_test([(after[n], P[n], labels(n)) for n in range(case.T)])]


def sequences_by_prefix(sequences) -> Dict[tuple, Dict[int, int]]:
    """For every proper prefix of every emitted sequence, the counts of the token that followed it."""
    table: Dict[tuple, Dict[int, int]] = {}
    for seq in sequences:
        for j, y in enumerate(seq):
            row = table.setdefault(seq[:j], {})
            row[y] = row.get(y, 0) + 1
    return table


def exact_random_drafts(verify: Callable, model: PrefixModel, shape, relax: oracle.Relaxation, seed: int,
                        rows: Optional[int] = None) -> List[GTest]:
    """Sampled drafts drawn afresh in every row from draft(prefix): (1) the emitted sequences follow the
    oracle's exact law (marginal over the draws); (2) for delta = 0, every emitted token follows the
    target given the tokens before it (conditional G-test over prefixes)."""
    rng = np.random.default_rng(seed)
    tokens, cond, uncond, draft = sample_static_trees(model, shape, rows or draws_for(verify), rng)
    parents = np.broadcast_to(np.array(shape), tokens.shape)
    neighbours = _prefix_model_neighbours(model.V)
    result = run_rows(verify, cond, tokens, parents, neighbours, relax, uncond=uncond, draft=draft, seed=seed,
                      **model.settings)
    sequences = emitted_tokens(result, tokens)
    law = oracle.emitted_sequence_distribution(shape, model.target, model.draft, neighbours, relax)
    outcomes = sorted(set(law) | set(sequences))
    index = {s: i for i, s in enumerate(outcomes)}
    observed = np.bincount([index[s] for s in sequences], minlength=len(outcomes))
    probs = np.array([law.get(s, 0.0) for s in outcomes])
    tests = [g_test(observed, probs, [str(s) for s in outcomes])]
    if relax.delta == 0 and (relax.lam is None or relax.lam == 1):
        groups = []
        for prefix, row in sequences_by_prefix(sequences).items():
            counts = np.bincount(list(row.keys()), weights=list(row.values()), minlength=model.V)
            groups.append((counts, model.target(prefix), [f"{prefix}+{y}" for y in range(model.V)]))
        tests.append(conditional_g_test(groups))
    return tests


def _prefix_model_neighbours(V: int) -> np.ndarray:
    return np.array([[(x + d) % V for d in (1, V - 1, 2, V - 2)] for x in range(V)], dtype=np.int32)
