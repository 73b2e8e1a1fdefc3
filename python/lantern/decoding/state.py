"""The decoding state of a batch and its one kind of step.

``DecodeState`` owns what every method shares: the image tokens, each row's progress (``n_done``), the target's
cache bookkeeping (``target_len``) and the rows the models still compute (``live``), all on ``device``. A step
is the same for every method and plan (``DecodeState.step``): the proposer proposes a tree per row
(``Proposal``; one node, the root, for an AR step), one target forward scores it, ``ops.verify`` accepts a path,
the state commits it, and the proposer observes the result (``Outcome``). Proposers: ``proposers.py``.

Per row b: n_done[b] image tokens are committed; the last one is the root of the next tree. The target's cache
holds the condition and the committed tokens except the root (its K/V are computed by the step's forward, as
tree node 0). Rows advance at different speeds and each stops exactly at the image length L (a row's last
step keeps only the tokens it still needs: a prefix of a valid sample is a valid sample).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import torch

from .. import ops
from .._backend import run_backends
from .ar import condition_masks, nonfinite_logits, sample_next
from .compiled import CompiledRun, compiled_target, pad_room
from .config import Sampling
from .planner import compaction_due
from .plans import Plan
from .trees import DRAFT_SEED_SALT, depths_from_mask, sample_without_replacement, unguided_past_interval


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


@dataclass
class Proposal:
    """A tree per row for one step. Node 0 is the root (the row's last committed token)."""
    tokens: torch.Tensor  # [B, T] int64
    parents: torch.Tensor  # [B, T] int64 (root -1)
    depth: torch.Tensor  # [B, T] int64 (root 0)
    draft_probs: Optional[torch.Tensor]  # [B, T, V] the rows sampled drafts were drawn from; None: top tokens
    positions: Optional[torch.Tensor] = None  # [B, T] raster index per node; None: a chain after the committed
    tree_mask: Optional[torch.Tensor] = None  # [B, T, ceil(T/32)] packed ancestor bits; None: causal
    broken: Optional[torch.Tensor] = None  # [] bool: the drafter's logits were NaN or +inf
    draft_forwards: int = 0
    layout: Optional[tuple] = None  # every row's parents when the tree's shape is fixed (its mask is reused)


@dataclass
class Outcome:
    """What a step did, for the proposer to observe (all at full batch size)."""
    result: object  # ops.verify's VerifyResult
    n_before: torch.Tensor  # [B] committed tokens before the step
    n_emit: torch.Tensor  # [B] tokens the step committed
    kept_nodes: torch.Tensor  # [B, T] the root, then the accepted path
    emitted: torch.Tensor  # [B, T] the path's tokens, then next_token
    logits: torch.Tensor  # [rows, T, V] the target's
    hidden: torch.Tensor  # [rows, T, D] the target's


@dataclass
class StepFigures:
    """One step's figures, left on the device until the next step's host read (``DecodeState.sync``)."""
    plan: Plan
    step: int
    device_values: torch.Tensor  # int64 [4 + 2 depth], see ``step_figures``
    accept_len: torch.Tensor  # [B]
    active: torch.Tensor  # [B] bool: the rows that were generating
    values: Optional[List[int]] = None  # device_values once read

    # the read values by name (layout: ``step_figures``)
    @property
    def tokens(self) -> int:
        return self.values[0]

    @property
    def active_rows(self) -> int:
        return self.values[1]

    @property
    def longest(self) -> int:
        return self.values[2]

    @property
    def broken(self) -> bool:
        return bool(self.values[3])

    @property
    def hits(self) -> List[int]:
        return self.values[4 : 4 + self.plan.depth]

    @property
    def trials(self) -> List[int]:
        return self.values[4 + self.plan.depth :]


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


def progress(n_done: torch.Tensor, L: int, max_depth: int) -> torch.Tensor:
    """int64 [1 + max_depth]: the rows still generating (n_done [B] < L), then for d = 1..max_depth those
    with at least d + 1 tokens to go."""
    to_go = (L - n_done)[:, None] - torch.arange(max_depth + 1, device=n_done.device)  # [B, D + 1]
    return (to_go >= 1).sum(0)


def compacts(compiled: bool, aot: bool, can_compact: bool) -> bool:
    """Whether a run's finished rows leave the models' batch (``DecodeState.compact``): its forwards eager or
    AOT packages (torch.compile's graphs have static shapes; packages serve any row count), and a proposer that
    can drop rows."""
    return (not compiled or aot) and can_compact


def emit_counts(accept_len, n_done, L):
    """Tokens each row keeps from this step: accepted + 1, but never past the image end."""
    return torch.minimum(accept_len + 1, L - n_done).clamp(min=0)


class DecodeState:
    """A batch prefilled at construction (the condition, then the first token sampled as AR samples it) and
    stepped by ``step``. B images; with guidance each has two model rows [cond; uncond] (``n_rows`` = 2B)."""

    def __init__(self, target, proposer, cond_idx: torch.Tensor, sampling: Sampling, rule: Optional[AcceptanceRule],
                 L: int, plans: Sequence[Plan], emb_masks: Optional[torch.Tensor] = None,
                 compiled: Optional[CompiledRun] = None):
        """compiled: None (eager forwards), or the run's compiled forwards, node counts padded to buckets."""
        self.device = target.tok_embeddings.weight.device
        self.backends = run_backends(self.device)  # op -> backend, resolved once for the run
        self.compiled = compiled
        if compiled is not None:
            target = compiled_target(target, compiled)
        self.target, self.proposer, self.s, self.rule, self.L = target, proposer, sampling, rule, L
        B = self.B = cond_idx.shape[0]
        greedy = torch.as_tensor(sampling.temperature, device=self.device) == 0  # [] or [B]
        self.greedy_rows = greedy.expand(B) if bool(greedy.any()) else None  # read once, before the loop
        masks = condition_masks(target, cond_idx, emb_masks, sampling.guided)  # [n_rows, C] or None
        cond = target.double_for_cfg(cond_idx) if sampling.guided else cond_idx
        self.n_rows = cond.shape[0]
        self.halves = self.n_rows // B
        logits, hidden = self._prefill(cond, masks, plans)
        lc, lu = (logits[:B, -1], logits[B:, -1]) if sampling.guided else (logits[:, -1], None)
        first = sample_next(lc, lu, cfg_scale=sampling.cfg_scale, temperature=sampling.temperature,
                            top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed, offset=0,
                            rows=sampling.rows, backend=self.backends["verify"])
        self.out = torch.zeros(B, L, dtype=torch.int64, device=self.device)  # [B, L] the image tokens
        self.out[:, 0] = first
        self.n_done = torch.ones(B, dtype=torch.int64, device=self.device)
        self.target_len = target.cond_keys[: self.n_rows].clone()  # [n_rows] C, or the real caption positions
        # the model rows the models compute (None: all). Finished rows leave the models' caches (``compact``);
        # the state, verify and the draft sampling stay at full size, so every random stream keeps its row and
        # the tokens are those of the uncompacted loop.
        self.live: Optional[torch.Tensor] = None  # [live model rows] indices into the model rows, both halves
        self.compactable = compacts(compiled is not None, compiled is not None and compiled.aot, proposer.can_compact)
        self.figures: Optional[StepFigures] = None
        self._layout_masks: dict = {}  # fixed tree shape -> its packed mask [B, T, W] (``tree_inputs``)
        self._model_row_masks: dict = {}  # fixed tree shape -> the mask of the model rows (``forward``)
        proposer.start(self, plans, cond, masks, logits[:, -1], hidden[:, -1], first)

    def _prefill(self, cond, masks, plans: Sequence[Plan]):
        """Sizes the target's cache for the largest plan and writes the condition -> (logits, hidden)."""
        T_max = max(p.nodes for p in plans)
        padded = self.compiled is not None and not self.compiled.aot  # torch.compile's node-count buckets
        pad = pad_room(T_max) if padded else 0  # cache slots of the padding nodes
        self.target.setup_cache(self.n_rows, self.target.config.cond_len + self.L + T_max + pad)
        cache_len = torch.zeros(self.n_rows, dtype=torch.int64, device=self.device)
        return self.target(None, cond, cache_len=cache_len, return_hidden=True, emb_masks=masks)

    # -- the live rows ------------------------------------------------------------------------------------

    @property
    def forward_rows(self) -> int:
        """Model rows of the models' forwards."""
        return self.n_rows if self.live is None else self.live.shape[0]

    def should_compact(self, n_active: int) -> bool:
        """Whether to drop the finished rows from the models now (``planner.compaction_due``)."""
        live_b = self.forward_rows // self.halves
        return self.compactable and n_active > 0 and compaction_due(live_b, n_active)

    def compact(self) -> None:
        """Keeps only the unfinished rows in the models' caches (one host read: which rows)."""
        keep = torch.nonzero(self.n_done < self.L).squeeze(1)  # [B'] images
        live = torch.cat([keep + h * self.B for h in range(self.halves)])  # sorted, both halves
        held = torch.arange(self.n_rows, device=self.device) if self.live is None else self.live
        place = torch.searchsorted(held, live)  # each kept row's place in the caches now
        self.target.keep_cache_rows(place)
        self.proposer.keep_rows(place)
        self.live = live

    def sub(self, x: torch.Tensor) -> torch.Tensor:
        """[n_rows, ...] -> [live rows, ...]: a model's per-row input."""
        return x if self.live is None else x.index_select(0, self.live)

    def full(self, y: torch.Tensor) -> torch.Tensor:
        """[live rows, ...] -> [n_rows, ...]: a model's per-row output, zeros for the rows it did not compute
        (finished rows: verify and the draft sampling read them, their results are never kept)."""
        if self.live is None:
            return y
        return y.new_zeros((self.n_rows, *y.shape[1:])).index_copy_(0, self.live, y)

    def rep(self, x: torch.Tensor) -> torch.Tensor:
        """[B, ...] -> [n_rows, ...]: the same values for both guidance halves."""
        return x if self.halves == 1 else torch.cat([x] * self.halves)  # (cat: a fifth of repeat's overhead)

    # -- the step -----------------------------------------------------------------------------------------

    def roots(self) -> torch.Tensor:
        """[B] each row's last committed token."""
        return self.out.gather(1, (self.n_done - 1).clamp(max=self.L - 1)[:, None]).squeeze(1)

    def tree_inputs(self, parents: torch.Tensor, depth: Optional[torch.Tensor], layout: Optional[tuple] = None) -> dict:
        """A tree's forward layout for ``Proposal``: depth [B, T] (None: each node's ancestor count, from the
        mask), positions [B, T] (each node's raster index, clamped inside the image) and tree_mask (packed
        ancestor bits). layout: every row's parents as a tuple when the tree's shape is fixed (chain, static
        tree): its mask is made once per run."""
        backend = self.backends["ancestor_mask"]
        if layout is None:
            mask = ops.ancestor_mask(parents, backend=backend)
        else:
            mask = self._layout_masks.get(layout)
            if mask is None:
                mask = self._layout_masks[layout] = ops.ancestor_mask(parents, backend=backend)
        if depth is None:
            depth = depths_from_mask(mask, parents.shape[1])
        positions = ((self.n_done - 1)[:, None] + depth).clamp(max=self.L - 1)
        return dict(depth=depth, positions=positions, tree_mask=mask)

    def step(self, plan: Plan, step: int):
        """One step of ``plan``: propose, one target forward, verify, commit, observe.
        -> (n_emit [B], drafter forwards)"""
        n_done, L = self.n_done, self.L
        active = n_done < L
        proposal = self.proposer.propose(self, plan, step)
        logits, hidden = self.forward(proposal)
        result = self.verify(logits, proposal, step)
        n_emit = torch.where(active, emit_counts(result.accept_len, n_done, L), 0)  # [B]
        broken = nonfinite_logits(logits)
        if proposal.broken is not None:
            broken = broken | proposal.broken
        self.figures = StepFigures(plan, step, step_figures(n_emit, result.accept_len, active, L - n_done,
                                                            plan.depth, broken), result.accept_len, active)
        kept_nodes, emitted = self.commit(proposal.tokens, result, n_emit)
        self.proposer.observe(self, plan, Outcome(result, n_done, n_emit, kept_nodes, emitted, logits, hidden), step)
        return n_emit, proposal.draft_forwards

    def forward(self, proposal: Proposal):
        """The target over every live row's tree -> (logits [n_rows, T, V], hidden [n_rows, T, D])."""
        tree = {}
        if proposal.positions is not None:
            tree = dict(positions=self.sub(self.rep(proposal.positions)), tree_mask=self._model_rows_mask(proposal))
        logits, hidden = self.target(self.sub(self.rep(proposal.tokens)), cache_len=self.sub(self.target_len),
                                     return_hidden=True, **tree)
        return self.full(logits), self.full(hidden)

    def _model_rows_mask(self, proposal: Proposal) -> torch.Tensor:
        """The proposal's tree mask for the models' rows [live rows, T, W] (once per run for a fixed shape
        while every row is live: the same tensor each step, which the compiled forwards pad once)."""
        if proposal.layout is None or self.live is not None:
            return self.sub(self.rep(proposal.tree_mask))
        mask = self._model_row_masks.get(proposal.layout)
        if mask is None:
            mask = self._model_row_masks[proposal.layout] = self.rep(proposal.tree_mask)
        return mask

    def verify(self, logits: torch.Tensor, proposal: Proposal, offset: int):
        """ops.verify of the cond rows' trees (guided by the uncond rows); relaxed only with drafts."""
        s, B = self.s, self.B
        uncond = (unguided_past_interval(logits[:B], logits[B:], self.n_done[:, None] + proposal.depth,
                                         s.cfg_interval) if s.guided else None)
        rule = self.rule if proposal.tokens.shape[1] > 1 else None
        exact = dict(k=0, delta=0.0, lam=None, budget="candidate")
        return ops.verify(logits[:B], proposal.tokens, proposal.parents, rule.neighbours if rule else None,
                          uncond_logits=uncond, cfg_scale=s.cfg_scale, temperature=s.temperature, top_k=s.top_k,
                          top_p=s.top_p, draft_probs=proposal.draft_probs, seed=s.seed, offset=offset, rows=s.rows,
                          backend=self.backends["verify"], **(rule.verify_options() if rule else exact))

    def commit(self, tree_tokens: torch.Tensor, result, n_emit: torch.Tensor):
        """Writes each row's accepted path tokens, then next_token, never past L; keeps the root's and the path's
        K/V (ops.compact_kv; a one-node tree's root K/V are already in place); advances n_done.
        -> (kept nodes [B, T]: the root, then the path; emitted [B, T])"""
        B, T = tree_tokens.shape
        n_done, L = self.n_done, self.L
        root = torch.zeros(B, 1, dtype=torch.int64, device=self.device)
        kept_nodes = torch.cat([root, result.path.clamp(min=0)], 1)  # [B, T]
        emitted = torch.cat([tree_tokens.gather(1, kept_nodes[:, 1:]), result.next_token[:, None]], 1)
        j = torch.arange(T, device=self.device)
        emitted = torch.where(j[None] < result.accept_len[:, None], emitted, result.next_token[:, None])
        in_step = torch.arange(L, device=self.device)[None] - n_done[:, None]  # [B, L] index into emitted
        written = (in_step >= 0) & (in_step < n_emit[:, None])  # never past L
        self.out = torch.where(written, emitted.gather(1, in_step.clamp(0, T - 1)), self.out)
        if T == 1:
            self.target_len = self.target_len + self.rep(n_emit)
        else:
            kept_len = ops.compact_kv(self.target.kv_cache, self.sub(self.target_len), self.sub(self.rep(kept_nodes)),
                                      self.sub(self.rep(n_emit)), backend=self.backends["compact_kv"])
            self.target_len = kept_len if self.live is None else self.target_len.index_copy(0, self.live, kept_len)
        self.n_done = n_done + n_emit
        return kept_nodes, emitted

    def sync(self, max_depth: int, last: Optional[StepFigures]) -> List[int]:
        """The loop's one host read per step: ``progress`` and the last step's figures together. Returns the
        progress counts; accounts the last step (``last.values`` filled, the proposer told)."""
        if last is None:
            return progress(self.n_done, self.L, max_depth).tolist()
        values = torch.cat([progress(self.n_done, self.L, max_depth), last.device_values]).tolist()
        last.values = values[max_depth + 1:]
        if last.broken:
            raise RuntimeError(f"step {last.step}: the target or the drafter produced NaN or +inf logits (broken "
                               f"weights or inputs); the decoding stopped")
        self.proposer.settle(last)
        return values[: max_depth + 1]

    def draft(self, logits: torch.Tensor, draws: int, node_ids: torch.Tensor, offset: int) -> ops.DraftSample:
        """Sampled drafts of tree nodes on the drafter's own Philox stream: guided logits [B, N, V] -> (q [B, N, V]
        each node's draft distribution, tokens [B, N, draws]) by ``ops.draft_sample`` (a greedy row's q is
        one-hot at its top token, as in ``process``); node_ids [B, N] the nodes' Philox node ids. Where no kernel
        serves draft_sample (a GPU, the reference backend), its definition is composed from process_logits and
        philox_uniform (the Philox words by philox_uniform's kernel where one serves it, not the reference's
        Python rounds)."""
        s = self.s
        if self.backends["draft_sample"] == "reference":
            q = self.process(logits)
            return ops.DraftSample(q, sample_without_replacement(q, draws, s.seed, node_ids, offset, s.rows))
        return ops.draft_sample(logits, None, 1.0, s.temperature, s.top_k, s.top_p, draws=draws,
                                seed=s.seed ^ DRAFT_SEED_SALT, node_ids=node_ids, offset=offset, rows=s.rows,
                                backend=self.backends["draft_sample"])

    def process(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """The sampling distribution of sampled drafts [B, ..., V] from guided logits (the drafter's, or the
        target's for Jacobi drafts). Greedy rows (temperature 0) draw the top token (a one-hot q): greedy
        verification keeps a draft only if it is the target's top token, so a draw from the softmax would only
        waste the draft."""
        s = self.s
        q = ops.process_logits(draft_logits, None, 1.0, s.temperature, s.top_k, s.top_p,
                               backend=self.backends["process_logits"])
        if self.greedy_rows is None:
            return q
        top = torch.zeros_like(q).scatter_(-1, draft_logits.argmax(-1, keepdim=True), 1.0)
        return torch.where(self.greedy_rows.view(-1, *([1] * (q.dim() - 1))), top, q)

    def close(self) -> None:
        self.proposer.close()
        self.target.free_cache()
