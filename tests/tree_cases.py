"""Random draft trees shared by the tree tests (and by fused backends' tests)."""
import random

import torch


def random_parents(rng: random.Random, B: int, T: int, pad_prob: float) -> torch.Tensor:
    """Valid trees: each node is padding (-1) with probability pad_prob, else a child of an earlier real node."""
    rows = []
    for _ in range(B):
        row, real = [-1], [0]
        for i in range(1, T):
            if rng.random() < pad_prob:
                row.append(-1)
            else:
                row.append(rng.choice(real))
                real.append(i)
        rows.append(row)
    return torch.tensor(rows, dtype=torch.int64)


def random_expansion(rng: random.Random, B: int, M: int, V: int = 1000):
    """Candidates with parents earlier in the list and cumulative scores that never increase along a path
    (quantised so ties are common)."""
    tokens = torch.tensor([[rng.randrange(V) for _ in range(M)] for _ in range(B)], dtype=torch.int64)
    tokens = tokens.reshape(B, M)
    parents = torch.full((B, M), -1, dtype=torch.int64)
    scores = torch.zeros(B, M, dtype=torch.float32)
    for b in range(B):
        for m in range(M):
            p = rng.choice([-1] + list(range(m))) if m else -1
            parents[b, m] = p
            base = 0.0 if p < 0 else float(scores[b, p])
            scores[b, m] = base - rng.choice([0.0, 0.5, 1.0, 2.5])
    root = torch.tensor([rng.randrange(V) for _ in range(B)])
    return tokens, parents, scores, root
