"""A drafting step after the target's forward: ``verify_trees`` (ops.verify of the cond rows' trees, guided by
the uncond rows), ``settle`` (the tokens each row keeps, the step's figures, the image tokens written) and the
cache's compaction. ``DecodeState.step`` runs them eagerly, or, where the target's forwards are AOT packages
(``aot.py``), as one ``VerifyCommit`` package: the same functions exported with dynamic shapes, one call where
the eager code dispatches ~100 small ops.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from .. import ops
from .aot import MAX_CACHE_LEN, MAX_ROWS, WORD, Packaged
from .config import Sampling
from .trees import unguided_past_interval


@dataclass(frozen=True)
class AcceptanceRule:
    """How ``ops.verify`` relaxes the acceptance of drafts over LANTERN's latent neighbours (None: exact)."""
    neighbours: torch.Tensor  # [V, K] int32
    k: int
    delta: float
    lam: Optional[float]
    budget: str

    def verify_options(self) -> dict:
        return dict(k=self.k, delta=self.delta, lam=self.lam, budget=self.budget)


def step_figures(n_emit, accept_len, active, to_go, depth: int, broken) -> torch.Tensor:
    """int64 [4 + 2 depth]: tokens emitted, active rows, the longest row's tokens, broken logits (0/1), then
    for d = 1..depth the active rows that accepted depth d (hits), then those that reached depth d - 1 with
    depth d inside the image (trials); to_go [B] = tokens each row still needed before the step."""
    d = torch.arange(1, depth + 1, device=n_emit.device)
    inside = (to_go[:, None] >= d) & active[:, None]  # [B, depth]
    hits = ((accept_len[:, None] >= d) & inside).sum(0)
    trials = ((accept_len[:, None] >= d - 1) & inside).sum(0)
    head = torch.stack([n_emit.sum(), active.sum(), n_emit.max(), broken.to(torch.int64)])
    return torch.cat([head, hits, trials])


def emit_counts(accept_len, n_done, L):
    """Tokens each row keeps from this step: accepted + 1, but never past the image end."""
    return torch.minimum(accept_len + 1, L - n_done).clamp(min=0)


EXACT = dict(k=0, delta=0.0, lam=None, budget="candidate")  # verify's options without a relaxation


def verify_trees(logits, tokens, parents, depth, draft_probs, n_done, s: Sampling, rule: Optional[AcceptanceRule],
                 offset, backend: str):
    """ops.verify of the cond rows' trees, guided by the uncond rows: logits [n_rows, T, V] (both halves
    when guided), tokens / parents / depth [B, T], draft_probs [B, T, V] or None, n_done [B]; relaxed by
    ``rule`` only when the trees hold drafts (T > 1)."""
    B = tokens.shape[0]
    uncond = (unguided_past_interval(logits[:B], logits[B:], n_done[:, None] + depth, s.cfg_interval)
              if s.guided else None)
    relaxed = rule is not None and tokens.shape[1] > 1
    return ops.verify(logits[:B], tokens, parents, rule.neighbours if relaxed else None, uncond_logits=uncond,
                      cfg_scale=s.cfg_scale, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                      draft_probs=draft_probs, seed=s.seed, offset=offset, rows=s.rows, backend=backend,
                      **(rule.verify_options() if relaxed else EXACT))


def settle(tokens, result, n_done, out, broken, depth: int):
    """What a verified step keeps, before the caches: tokens [B, T] the trees, result ops.verify's, n_done [B]
    committed tokens, out [B, L] the image tokens, broken [] bool -> (n_emit [B], the step's figures
    (``step_figures``), kept nodes [B, T]: the root, then the accepted path, emitted [B, T]: the path's
    tokens, then next_token, out with each row's emitted tokens written, never past L)."""
    B, T = tokens.shape
    L = out.shape[1]
    active = n_done < L
    n_emit = torch.where(active, emit_counts(result.accept_len, n_done, L), 0)  # [B]
    figures = step_figures(n_emit, result.accept_len, active, L - n_done, depth, broken)
    root = torch.zeros(B, 1, dtype=torch.int64, device=tokens.device)
    kept_nodes = torch.cat([root, result.path.clamp(min=0)], 1)  # [B, T]
    emitted = torch.cat([tokens.gather(1, kept_nodes[:, 1:]), result.next_token[:, None]], 1)
    j = torch.arange(T, device=tokens.device)
    emitted = torch.where(j[None] < result.accept_len[:, None], emitted, result.next_token[:, None])
    in_step = torch.arange(L, device=tokens.device)[None] - n_done[:, None]  # [B, L] index into emitted
    written = (in_step >= 0) & (in_step < n_emit[:, None])  # never past L
    out = torch.where(written, emitted.gather(1, in_step.clamp(0, T - 1)), out)
    return n_emit, figures, kept_nodes, emitted, out


@dataclass(frozen=True)
class TailSettings:
    """What a ``VerifyCommit`` package is made for, besides the shapes: the run's settings that are not
    tensors (they are in the package's name)."""

    vocab: int
    dtype: torch.dtype  # the logits'
    cache_dtype: torch.dtype
    guided: bool
    cfg_interval: int
    sampled: bool  # the drafts carry draft_probs
    rule: Optional[Tuple]  # (K, k, delta, lam, budget) of LANTERN's relaxation; None: exact
    backends: Tuple[str, str]  # verify's, compact_kv's


class VerifyCommit(Packaged):
    """A drafting step after the target's forward (``state.verify_trees``, the logits' check, ``state.settle``,
    ops.compact_kv of the live rows): (cache [n_layer, 2, R, Hkv, Lmax, Dh], logits [n_rows, T, V], tokens,
    parents, depth [B, T], draft_probs [B, T, V] or None, neighbours [V, K] or None, n_done [B], out [B, L],
    target_len [n_rows], live [R] (the model rows the cache holds), cfg_scale, temperature, top_k, top_p [B]
    (as ops.verify's schema takes them), seed, offset [], rows [B], figure_depths [D] (its length is the
    plan's depth), drafter_broken []) -> (accept_len, path, next_token, node_status, n_emit, figures,
    kept_nodes, emitted, out, target_len); compacts the cache in place. n_rows = 2B when guided, else B."""

    def __init__(self, settings: TailSettings):
        super().__init__()
        self.settings = settings

    def key_parts(self) -> List[str]:
        return [repr(self.settings)]

    @staticmethod
    def node_range(words: int) -> Tuple[int, int]:  # noqa: ARG004 (one package, whatever the mask)
        return 2, WORD * 2  # trees of drafts; verify takes no mask, so one package serves up to 64 nodes

    @staticmethod
    def words(args) -> int:  # noqa: ARG004
        return 1

    def sync(self) -> None:
        """Nothing to follow: the package holds no tensors of a model."""

    def forward(self, cache, logits, tokens, parents, depth, draft_probs, neighbours, n_done, out, target_len, live,
                cfg_scale, temperature, top_k, top_p, seed, offset, rows, figure_depths, drafter_broken):
        torch._check(cache.shape[2] == live.shape[0])  # the cache holds the live rows (and no others)
        st = self.settings
        halves = 2 if st.guided else 1
        sampling = Sampling(cfg_scale if st.guided else 1.0, temperature, top_k, top_p, seed, st.cfg_interval, rows)
        rule = None if st.rule is None else AcceptanceRule(neighbours, *st.rule[1:])
        result = verify_trees(logits, tokens, parents, depth, draft_probs, n_done, sampling, rule, offset,
                              st.backends[0])
        broken = ~(logits.amax() < float("inf")) | drafter_broken  # ar.nonfinite_logits
        n_emit, figures, kept_nodes, emitted, out = settle(tokens, result, n_done, out, broken,
                                                           figure_depths.shape[0])
        kept_len = ops.compact_kv(cache, target_len.index_select(0, live),
                                  kept_nodes.repeat(halves, 1).index_select(0, live),
                                  n_emit.repeat(halves).index_select(0, live), backend=st.backends[1])
        return (*result, n_emit, figures, kept_nodes, emitted, out, target_len.index_copy(0, live, kept_len))

    def example(self, rows: int, nodes: int, words: int):  # noqa: ARG002
        st, B, L = self.settings, rows, 12
        halves = 2 if st.guided else 1
        i64 = dict(dtype=torch.int64)
        real = self.real_dtype()
        return (torch.zeros(3, 2, halves * B, 2, L + nodes + 8, 4, dtype=st.cache_dtype),
                torch.zeros(halves * B, nodes, st.vocab, dtype=st.dtype),
                torch.zeros(B, nodes, **i64), torch.arange(-1, nodes - 1).expand(B, nodes).contiguous(),
                torch.arange(nodes).expand(B, nodes).contiguous(),
                torch.full((B, nodes, st.vocab), 1.0 / st.vocab) if st.sampled else None,
                torch.zeros(st.vocab, st.rule[0], dtype=torch.int32) if st.rule is not None else None,
                torch.ones(B, **i64), torch.zeros(B, L, **i64), torch.full((halves * B,), 1, **i64),
                torch.arange(halves * B), torch.ones(B, dtype=real), torch.ones(B, dtype=real),
                torch.zeros(B, **i64), torch.ones(B, dtype=torch.float64), torch.zeros((), **i64),
                torch.zeros((), **i64), torch.arange(B), torch.arange(1, nodes), torch.zeros((), dtype=torch.bool))

    def dynamic_shapes(self, rows, nodes, length):
        from torch.export import Dim

        model_rows = 2 * rows if self.settings.guided else rows
        live, image = Dim("live", min=1, max=MAX_ROWS), Dim("image", min=1, max=MAX_CACHE_LEN)
        depths = Dim("depths", min=1, max=WORD * 2)
        per_node = {0: rows, 1: nodes}
        layers, heads, head_dim = (Dim(name, min=1, max=MAX_ROWS) for name in ("layers", "heads", "head_dim"))
        return dict(cache={0: layers, 2: live, 3: heads, 4: length, 5: head_dim}, logits={0: model_rows, 1: nodes},
                    tokens=per_node, parents=per_node,
                    depth=per_node, draft_probs=per_node if self.settings.sampled else None, neighbours=None,
                    n_done={0: rows}, out={0: rows, 1: image}, target_len={0: model_rows}, live={0: live},
                    cfg_scale={0: rows}, temperature={0: rows}, top_k={0: rows}, top_p={0: rows}, seed=None,
                    offset=None, rows={0: rows}, figure_depths={0: depths}, drafter_broken=None)

    def real_dtype(self) -> torch.dtype:
        """ops.verify's compute type on the CPU kernels (``library.compute_dtype``): its settings' type."""
        return torch.float64 if self.settings.dtype == torch.float64 else torch.float32

    def input_dtypes(self):
        st, i64, real = self.settings, torch.int64, self.real_dtype()
        return (st.cache_dtype, st.dtype, i64, i64, i64, torch.float32 if st.sampled else None,
                torch.int32 if st.rule is not None else None, i64, i64, i64, i64, real, real, i64, torch.float64,
                i64, i64, i64, i64, torch.bool)
