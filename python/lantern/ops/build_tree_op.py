"""build_tree: EAGLE-2 tree selection, the n_nodes best draft candidates (by cumulative draft log-probability)
plus the root, as a tree in topological order."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import checks as c
from . import library
from .reference.tree import build_tree as reference
from .reference.tree import select_candidates, selection_is_ancestor_closed

# cand_tokens, cand_parents int64 [B, M], cand_scores float [B, M], root_token int64 [B]
# -> (tokens [B, n_nodes + 1], parents [B, n_nodes + 1]) int64
SCHEMA = ("(Tensor cand_tokens, Tensor cand_parents, Tensor cand_scores, Tensor root_token, int n_nodes) "
          "-> (Tensor, Tensor)")


def fake(cand_tokens, cand_parents, cand_scores, root_token, n_nodes):
    B = cand_tokens.shape[0]
    return (cand_tokens.new_empty((B, n_nodes + 1), dtype=torch.int64),
            cand_tokens.new_empty((B, n_nodes + 1), dtype=torch.int64))


def to_schema(backend: str, cand_tokens, cand_parents, cand_scores, root_token, n_nodes) -> tuple:
    return cand_tokens, cand_parents, cand_scores, root_token, int(n_nodes)


OP = library.Op("build_tree", SCHEMA, fake, to_schema=to_schema, from_schema=tuple,
                reference_kernel=lambda *args: tuple(reference(*args)), backends={
                    "reference": reference,      # ops/reference/tree.py (no fused kernel)
                })


def build_tree(cand_tokens, cand_parents, cand_scores, root_token, n_nodes: int, *, backend: Optional[str] = None):
    """EAGLE-2 tree selection: the ``n_nodes`` best candidates (by cumulative draft log-probability)
    plus the root, as ``(tokens [B, n_nodes+1], parents [B, n_nodes+1])`` in topological order."""
    n_nodes = c.plain(n_nodes)
    check(cand_tokens, cand_parents, cand_scores, root_token, n_nodes)
    impl = _backend.dispatch("build_tree", cand_tokens.device, backend)
    return impl(cand_tokens, cand_parents, cand_scores, root_token, n_nodes)


def check(cand_tokens, cand_parents, cand_scores, root_token, n_nodes) -> None:
    """cand_tokens/cand_parents int64 [B, M], cand_scores float [B, M] without NaN/+inf, root_token int64 [B],
    tokens >= 0, -1 <= cand_parents[b, m] < m, n_nodes int in [0, M], and the selected set ancestor-closed."""
    c.tensor("cand_tokens", cand_tokens, ndim=2, dtypes=(torch.int64,))
    B, M = cand_tokens.shape
    dev = cand_tokens.device
    c.tensor("cand_parents", cand_parents, shape=[B, M], dtypes=(torch.int64,), device=dev)
    c.tensor("cand_scores", cand_scores, shape=[B, M], dtypes=c.FLOAT_DTYPES, device=dev)
    c.tensor("root_token", root_token, shape=[B], dtypes=(torch.int64,), device=dev)
    n_nodes = c.int_arg("n_nodes", n_nodes, 0, M)
    if not c.scan_values():
        return
    for name, t in (("cand_tokens", cand_tokens), ("root_token", root_token)):
        if bool((t < 0).any()):
            raise ValueError(f"{name} must be >= 0 (token ids), got {t.min().item()}")
    cand_ids = torch.arange(M, device=dev)
    if bool(((cand_parents < -1) | (cand_parents >= cand_ids)).any()):
        raise ValueError("cand_parents must satisfy -1 <= cand_parents[b, m] < m (parents come first; -1 = root)")
    c.no_nan("cand_scores", cand_scores)
    chosen = select_candidates(cand_scores, n_nodes)
    if not bool(selection_is_ancestor_closed(cand_parents, chosen).all()):
        raise ValueError("cand_scores must not increase from a candidate to its child: the n_nodes best "
                         "candidates are not ancestor-closed")
