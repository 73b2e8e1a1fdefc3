"""Speculative decoding with tree verification, exact ("spec") or relaxed ("lantern"), for a batch; and its
drafter-free variant, Jacobi self-drafting ("sjd", ``jacobi.py``), on the same loop.

Rows advance at different speeds: each verify step emits accept_len[b] + 1 tokens for row b, and every
row stops exactly at the image length L (a row's last step keeps only the tokens it still needs: a
prefix of a valid sample is a valid sample). Everything hot goes through ``lantern.ops``
(tree_attention inside the model, verify, compact_kv, build_tree), so ``lantern.enable_fused()`` swaps
the kernels without touching this loop.

Per row b: n_done[b] image tokens are committed; the last one is the root of the next tree. The target's
cache holds the condition and the committed tokens except the root (its K/V are computed by the verify
forward, as tree node 0); the drafter's cache holds the committed tokens except the ``n_pending`` newest,
which it catches up on in one forward (``Drafter.commit``) before it next drafts.

``tree="auto"`` (the default) lets ``planner.Planner`` pick each step's tree (or a plain AR step: a target
forward over the roots and a one-node verify, no drafter forward) from a cost model measured on the device
(``costs``) and acceptance rates learned from the run's own verify results. The acceptance rule never
depends on the plan, so exact speculative decoding stays exact whatever the planner picks.

Method "sjd" has no drafter: each row keeps a window of drafts (``jacobi.JacobiWindow``) that every step
feeds to the target as a chain and refreshes from that forward's predictions; the planner picks the window W
per step the same way (``planner.jacobi_plans``; W = 0 is the AR step). docs/sjd.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from .. import ops
from .ar import (check_condition, check_image_ids, check_length, condition_masks, generate_ar, nonfinite_logits,
                 sample_next)
from .compiled import (AUTO, CompileOption, CompileStats, bucket, check_compile, compiled_models, pad_room,
                       resolve_compile)
from .costs import CostModel, cache_key, cached_cost_model
from .exclusive import holds_models
from .jacobi import FRESH_INITS, JacobiWindow
from .options import check_gpt_sampling, check_spec_config
from .planner import AR_PLAN, AcceptanceModel, Plan, Planner, candidate_plans, jacobi_plan, jacobi_plans, measured_rates
from .trees import (DraftScorer, grow_chain, grow_dynamic, grow_static, guided_logits, static_shape,
                    unguided_past_interval)

STATIC_WIDTHS = (6, 4, 3, 2, 1, 1)  # 56 nodes with the root
TREES = ("auto", "chain", "static", "dynamic")
METHODS = ("spec", "lantern", "sjd")
CALIBRATION_ROWS = (2,)  # rows (2 x images with guidance) at which each plan's step is timed, and the run's


@dataclass
class SpecConfig:
    # "spec" (exact, δ = 0) | "lantern" (relaxed) | "sjd" (Jacobi self-drafting, no drafter: exact, or relaxed
    # when given a neighbour table)
    method: str = "lantern"
    tree: str = "auto"  # "auto" (planner) | "chain" | "static" | "dynamic"; sjd: "auto" | "chain" (fixed window)
    # "deterministic" | "sampled"; default: sampled for chains and static trees, top-k for EAGLE-2 dynamic trees
    # (tree="auto": see ``planner.candidate_plans``)
    draft: Optional[str] = None
    depth: int = 5  # draft levels below the root (chain length / EAGLE-2 expansions / static depth from widths)
    top_per_node: int = 10  # EAGLE-2: children per expanded node, and the beam width
    n_nodes: int = 58  # EAGLE-2: drafted nodes kept (plus the root)
    static_widths: Sequence[int] = STATIC_WIDTHS
    k: int = 1000  # neighbours merged at most
    delta: float = 0.1
    lam: Optional[float] = None  # LANTERN++ lambda mode instead of delta
    budget: str = "candidate"
    # tree="auto" only
    cost_model: Optional[CostModel] = None  # default: calibrated on the device (cached, see costs.py)
    plans: Optional[Sequence[Plan]] = None  # candidates; default: candidate_plans(depth)
    # per-level acceptance of a chain before the run's own data, where the cost model has no measured rates
    acceptance_prior: float = 0.5
    acceptance_memory: float = 0.98  # per step, the weight the acceptance data keeps (see AcceptanceModel)
    adapt_costs: bool = True  # correct the cost model by the run's step times (see Planner); False: reproducible
    margin: float = 0.1  # draft only when predicted more than 10 % faster than AR (see Planner)
    # True: target and drafter forwards through torch.compile (inductor; CUDA graphs on a GPU), node counts
    # padded to buckets (compiled.py); a dict: those torch.compile options; "auto": True where torch.compile
    # works on the device (compiled.resolve_compile), with the reason in the stats
    compile: CompileOption = AUTO
    # method "sjd" (docs/sjd.md)
    window: int = 8  # drafts per step (tree="chain"), or the largest window the planner considers (tree="auto")
    coupling: bool = False  # SCD: the draws of one image position share their uniforms across steps
    init: str = "repeat"  # fresh slots: "repeat" (copy the token to the left, one-hot q) | "sample" (draw)

    def draft_kind(self) -> str:
        """The drafts of an explicit tree: sampled from the drafter's distribution, or its top tokens."""
        if self.draft is not None:
            return self.draft
        return "deterministic" if self.tree == "dynamic" else "sampled"

    def fixed_plan(self) -> Plan:
        """The plan of an explicit tree (every step)."""
        if self.method == "sjd":
            return jacobi_plan(self.window)
        if self.tree == "chain":
            return Plan("chain", "chain", depth=self.depth, sampled=self.draft_kind() == "sampled")
        if self.tree == "static":
            return Plan("static", "static", depth=len(self.static_widths), static_widths=tuple(self.static_widths))
        return Plan("dynamic", "dynamic", depth=self.depth, n_nodes=self.n_nodes, top_per_node=self.top_per_node)

    def candidates(self) -> List[Plan]:
        if self.plans is not None:
            return list(self.plans)
        if self.method == "sjd":
            return jacobi_plans(self.window)
        return candidate_plans(self.depth, draft=self.draft)


def relaxed_acceptance(config: SpecConfig, neighbours) -> bool:
    """Whether verify relaxes over latent neighbours: method "lantern", or "sjd" given a neighbour table."""
    return config.method == "lantern" or (config.method == "sjd" and neighbours is not None)


@dataclass
class SpecStats:
    target_forwards: int = 0  # batched target forwards (prefill + one per verify step)
    draft_forwards: int = 0  # batched drafter forwards
    steps: int = 0  # verify steps (AR steps of tree="auto" included)
    row_steps: int = 0  # sum over rows of the verify steps in which the row was still generating
    emitted: int = 0  # tokens emitted by verify steps (all rows)
    wall_s: float = 0.0
    accept_lens: list = field(default_factory=list)  # per step: accept_len of the rows still generating
    plan_counts: Dict[str, int] = field(default_factory=dict)  # steps per plan ("ar", "chain3", "tree16", ...)
    planner: dict = field(default_factory=dict)  # tree="auto": per plan expected vs achieved tokens/s, cost model
    compile_s: float = 0.0  # compiled: first calls of each new graph (compile included), part of wall_s
    compiled_graphs: int = 0  # compiled: graphs compiled in this run (0 when earlier runs compiled them)
    compile: str = ""  # what config.compile resolved to on the device, and why ("on (auto)", "off (...)")

    @property
    def tau(self) -> float:
        """Mean tokens per target forward per row: accepted drafts + 1."""
        return self.emitted / max(self.row_steps, 1)


def _emit_counts(accept_len, n_done, L):
    """Tokens each row keeps from this step: accepted + 1, but never past the image end."""
    return torch.minimum(accept_len + 1, L - n_done).clamp(min=0)


def _tree_size(plan: Plan) -> int:
    """Nodes of the plan's tree, root included."""
    if plan.kind == "ar":
        return 1
    if plan.kind in ("chain", "jacobi"):
        return plan.depth + 1
    if plan.kind == "static":
        return len(static_shape(plan.static_widths))
    k = plan.top_per_node
    return min(plan.n_nodes, k + (plan.depth - 1) * k * k) + 1


@dataclass
class Sampling:
    cfg_scale: object = 1.0
    temperature: object = 1.0
    top_k: object = 0
    top_p: object = 1.0
    seed: int = 0
    cfg_interval: int = -1
    # [B] int64: each image's Philox row key in every draw (verify, the drafts), so an image's tokens follow its
    # id, not its place in the batch; None: the row index b
    rows: Optional[torch.Tensor] = None

    @property
    def guided(self) -> bool:
        return not (isinstance(self.cfg_scale, (int, float)) and self.cfg_scale == 1.0)

    @property
    def halves(self) -> int:
        """Model rows per image: [cond; uncond] with guidance."""
        return 2 if self.guided else 1


class _Loop:
    """The decoding state of a batch (prefilled at construction) and its kinds of step (``step``): with a drafter,
    AR steps and drafted trees; without one (method "sjd"), Jacobi windows (W = 0: an AR step)."""

    def __init__(self, target, drafter, cond_idx, neighbours, config: SpecConfig, sampling: Sampling, L: int,
                 plans: Sequence[Plan], catch_up: bool, emb_masks: Optional[torch.Tensor] = None,
                 compiled: Optional[CompileStats] = None):
        """compiled: None (eager forwards), or the run's CompileStats with ``config.compile`` set: the
        forwards are compiled, their node counts padded to buckets (``compiled.py``)."""
        if compiled is not None:
            options = resolve_compile(config.compile, target.tok_embeddings.weight.device).options
            target, drafter = compiled_models(target, drafter, options, compiled)
        self.target, self.drafter, self.neighbours, self.config, self.s, self.L = (
            target, drafter, neighbours, config, sampling, L)
        self.relaxed = relaxed_acceptance(config, neighbours)
        B = self.B = cond_idx.shape[0]
        greedy = torch.as_tensor(sampling.temperature, device=cond_idx.device) == 0  # [] or [B]
        self.greedy_rows = greedy.expand(B) if bool(greedy.any()) else None  # read once, before the loop
        C = target.config.cond_len
        masks = condition_masks(target, cond_idx, emb_masks, sampling.guided)  # [rows, C] or None
        cond = target.double_for_cfg(cond_idx) if sampling.guided else cond_idx
        self.rows = cond.shape[0]
        self.halves = self.rows // B
        T_max = max(_tree_size(p) for p in plans)
        beams = max((p.depth * p.top_per_node for p in plans if p.kind == "dynamic"), default=0)
        # AR steps leave up to L tokens for the drafter to catch up on, at most T_max from a tree step
        room = T_max + (L if catch_up else 0)
        # compiled: cache slots for the padding nodes (the target's trees; the drafter's expansions, catch-up)
        target_pad = pad_room(T_max) if compiled is not None else 0
        drafter_pad = bucket(max(T_max, beams, room + 1)) if compiled is not None else 0
        # prefill: the condition, then the first token exactly as AR does
        target.setup_cache(self.rows, C + L + T_max + target_pad)
        logits, hidden = target(None, cond, cache_len=torch.zeros(self.rows, dtype=torch.int64), return_hidden=True,
                                emb_masks=masks)
        lc, lu = (logits[:B, -1], logits[B:, -1]) if sampling.guided else (logits[:, -1], None)
        first = sample_next(lc, lu, cfg_scale=sampling.cfg_scale, temperature=sampling.temperature,
                            top_k=sampling.top_k, top_p=sampling.top_p, seed=sampling.seed, offset=0,
                            rows=sampling.rows)
        self.out = torch.zeros(B, L, dtype=torch.int64)
        self.out[:, 0] = first
        self.n_done = torch.ones(B, dtype=torch.int64)
        self.target_len = target.cond_keys[: self.rows].clone()  # C, or the real caption positions
        self.root_parents = torch.full((B, 1), -1, dtype=torch.int64)
        # the rows the models compute (None: all). Finished rows leave the models' caches (``compact``); the
        # loop's own state, verify and the draft sampling stay at full size, so every random stream keeps
        # its row and the tokens are those of the uncompacted loop. Compiled forwards keep static shapes.
        self.live: Optional[torch.Tensor] = None  # [live rows] indices into the rows, both guidance halves
        self.compactable = compiled is None and hasattr(drafter, "keep_rows")
        self.live_drafter = _LiveDrafter(self)
        self.window = None
        if drafter is None:  # Jacobi self-drafting: the window's first drafts from token 0's row
            first_probs = self._process(guided_logits(logits[:, -1], B, sampling.guided, sampling.cfg_scale,
                                                      torch.zeros(B, dtype=torch.int64), sampling.cfg_interval))
            self.window = JacobiWindow(first, first_probs, max(p.depth for p in plans), config.init, config.coupling,
                                       sampling.seed, sampling.rows)
            return
        drafter.reset(cond, self.rows, L + max(T_max, beams) + (L if catch_up else 0) + drafter_pad, masks)
        # the drafter's input: the newly committed tokens [rows, P] and the target hidden state before each
        self.pending = torch.zeros(self.rows, room + 1, dtype=torch.int64)
        self.pending_feat = hidden.new_zeros(self.rows, room + 1, hidden.shape[-1])
        self.pending[:, 0] = first.repeat(self.halves)
        self.pending_feat[:, 0] = hidden[:, -1]
        self.n_pending = torch.ones(self.rows, dtype=torch.int64)
        self.width = 1  # columns of ``pending`` in use (>= n_pending.max())

    @property
    def forward_rows(self) -> int:
        """Rows of the models' forwards."""
        return self.rows if self.live is None else self.live.shape[0]

    def should_compact(self, n_active: int) -> bool:
        """Whether to drop the finished rows from the models now: a quarter of the rows they compute or more
        (with the rows of the drafting plans ragged, the last rows of a batch finish many steps after the
        first; at batch 40 a fifth of the row-steps went to finished rows)."""
        live_b = self.forward_rows // self.halves
        return self.compactable and n_active > 0 and 4 * (live_b - n_active) >= live_b

    def compact(self) -> None:
        """Keeps only the unfinished rows in the models' caches (one host read: which rows)."""
        keep = torch.nonzero(self.n_done < self.L).squeeze(1)  # [B'] caller rows
        live = torch.cat([keep + h * self.B for h in range(self.halves)])  # sorted, both halves
        held = torch.arange(self.rows) if self.live is None else self.live
        place = torch.searchsorted(held, live)  # each kept row's place in the caches now
        self.target.keep_cache_rows(place)
        self.drafter.keep_rows(place)
        self.live = live

    def sub(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, ...] -> [live rows, ...]: a model's per-row input."""
        return x if self.live is None else x.index_select(0, self.live)

    def full(self, y: torch.Tensor) -> torch.Tensor:
        """[live rows, ...] -> [rows, ...]: a model's per-row output, zeros for the rows it did not compute
        (finished rows: verify and the draft sampling read them, their results are never kept)."""
        if self.live is None:
            return y
        return y.new_zeros((self.rows, *y.shape[1:])).index_copy_(0, self.live, y)

    def forward(self, tokens, cache_len, **kwargs):
        """The target over the live rows -> (logits, hidden) at full size."""
        per_row = {k: self.sub(v) for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        logits, hidden = self.target(self.sub(tokens), cache_len=self.sub(cache_len), return_hidden=True,
                                     **{**kwargs, **per_row})
        return self.full(logits), self.full(hidden)

    def rep(self, x: torch.Tensor) -> torch.Tensor:
        """[B, ...] -> [rows, ...]: the same values for both guidance halves."""
        return x.repeat(self.halves, *([1] * (x.dim() - 1)))

    def progress(self, max_depth: int) -> torch.Tensor:
        return _progress(self.n_done, self.L, max_depth)

    def sync(self, max_depth: int, last: Optional["_StepFigures"]) -> List[int]:
        """The loop's one host read per step: ``progress`` and the last step's figures together. Returns
        the progress counts; accounts the last step (``last.values`` filled, ``width`` refined)."""
        if last is None:
            return self.progress(max_depth).tolist()
        values = torch.cat([self.progress(max_depth), last.device_values]).tolist()
        last.values = values[max_depth + 1:]
        if last.broken:
            raise RuntimeError(f"step {last.step}: the target or the drafter produced NaN or +inf logits (broken "
                               f"weights or inputs); the decoding stopped")
        if not last.plan.is_ar:
            self.width = max(last.longest, 1)  # the pending columns the longest row uses
        return values[: max_depth + 1]

    def _verify(self, logits, tokens, parents, depth, draft_probs, offset, drafts: bool):
        """ops.verify of the cond rows' trees (guided by the uncond rows), relaxed only with drafts."""
        s, c = self.s, self.config
        B = self.B
        uncond = (unguided_past_interval(logits[:B], logits[B:], self.n_done[:, None] + depth, s.cfg_interval)
                  if s.guided else None)
        relaxed = self.relaxed and drafts
        return ops.verify(logits[:B], tokens, parents, self.neighbours if relaxed else None, uncond_logits=uncond,
                          cfg_scale=s.cfg_scale, temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                          draft_probs=draft_probs, k=c.k if relaxed else 0, delta=c.delta if relaxed else 0.0,
                          lam=c.lam if relaxed else None, budget=c.budget if relaxed else "candidate",
                          seed=s.seed, offset=offset, rows=s.rows)

    def step(self, plan: Plan, step: int):
        """One step of ``plan`` -> (n_emit [B], drafter forwards)."""
        if self.window is not None:
            return self.jacobi_step(plan, step), 0
        if plan.is_ar:
            return self.ar_step(step), 0
        n_emit, _, forwards = self.spec_step(plan, step)
        return n_emit, forwards

    def jacobi_step(self, plan: Plan, step: int) -> torch.Tensor:
        """Feed every row's root and its first W = plan.depth window drafts to the target as a chain, verify
        them as sampled drafts (draft_probs = the window's q rows), commit, and refresh the window from this
        forward's rows (``JacobiWindow.advance``). W = 0 (the AR plan) samples one token as AR does. -> n_emit [B]"""
        B, L = self.B, self.L
        active = self.n_done < L
        n_done = self.n_done
        W = plan.depth
        root = self.out.gather(1, (n_done - 1)[:, None]).squeeze(1)
        tokens, draft_probs = self.window.chain(root, W)  # [B, W + 1], [B, W + 1, V] or None
        parents = torch.arange(-1, W).expand(B, W + 1)
        depth = torch.arange(W + 1).expand(B, W + 1)
        positions = ((n_done - 1)[:, None] + depth).clamp(max=L - 1)
        logits = self.target(self.rep(tokens), cache_len=self.target_len, positions=self.rep(positions),
                             tree_mask=self.rep(ops.ancestor_mask(parents)))  # [rows, W + 1, V]
        result = self._verify(logits, tokens, parents, depth, draft_probs, step, drafts=W > 0)
        n_emit = torch.where(active, _emit_counts(result.accept_len, n_done, L), 0)  # [B]
        self.figures = _StepFigures(plan, step, _figures(n_emit, result.accept_len, active, L - n_done, W,
                                                         nonfinite_logits(logits)), result.accept_len, active)
        self._commit(tokens, result, n_emit)
        s = self.s
        probs = self._process(guided_logits(logits, B, s.guided, s.cfg_scale, n_done[:, None] + depth,
                                            s.cfg_interval))  # [B, W + 1, V] node j: the row of old slot j
        self.window.advance(result.accept_len, result.next_token, W, probs, self.n_done, step)
        return n_emit

    def _commit(self, tree_tokens: torch.Tensor, result, n_emit: torch.Tensor):
        """Writes each row's accepted path tokens, then next_token, never past L; keeps the root's and the path's
        K/V (ops.compact_kv); advances n_done. -> (kept nodes [B, T]: the root, then the path; emitted [B, T])"""
        B, T = tree_tokens.shape
        n_done, L = self.n_done, self.L
        kept_nodes = torch.cat([torch.zeros(B, 1, dtype=torch.int64), result.path.clamp(min=0)], 1)  # [B, T]
        emitted = torch.cat([tree_tokens.gather(1, kept_nodes[:, 1:]), result.next_token[:, None]], 1)
        j = torch.arange(T)
        emitted = torch.where(j[None] < result.accept_len[:, None], emitted, result.next_token[:, None])
        in_step = torch.arange(L)[None] - n_done[:, None]  # [B, L] index into emitted of each image position
        written = (in_step >= 0) & (in_step < n_emit[:, None])  # never past L
        self.out = torch.where(written, emitted.gather(1, in_step.clamp(0, T - 1)), self.out)
        kept_len = ops.compact_kv(self.target.kv_cache, self.sub(self.target_len), self.sub(self.rep(kept_nodes)),
                                  self.sub(self.rep(n_emit)))
        self.target_len = kept_len if self.live is None else self.target_len.index_copy(0, self.live, kept_len)
        self.n_done = n_done + n_emit
        return kept_nodes, emitted

    def ar_step(self, step: int) -> torch.Tensor:
        """One token per active row, as AR samples it: the target over the roots, a one-node verify. The
        drafter does nothing; the token and the root's hidden state join its pending input. -> n_emit [B]"""
        B, L = self.B, self.L
        active = self.n_done < L
        root = self.out.gather(1, (self.n_done - 1).clamp(max=L - 1)[:, None])  # [B, 1]
        logits, hidden = self.forward(self.rep(root), self.target_len)  # [rows, 1, .]
        result = self._verify(logits, root, self.root_parents, 0, None, step, drafts=False)
        n_emit = active.to(torch.int64)
        zeros = torch.zeros_like(n_emit)
        figures = _figures(n_emit, zeros, active, L - self.n_done, 0, nonfinite_logits(logits))
        self.figures = _StepFigures(AR_PLAN, step, figures, zeros, active)
        slot = self.n_done.clamp(max=L - 1)[:, None]
        self.out.scatter_(1, slot, torch.where(active[:, None], result.next_token[:, None], self.out.gather(1, slot)))
        self.target_len = self.target_len + self.rep(n_emit)  # the root's K/V, written by this forward, stay
        rows = torch.arange(self.rows)
        self.pending[rows, self.n_pending] = self.rep(result.next_token)
        self.pending_feat[rows, self.n_pending] = hidden[:, 0]
        self.n_pending = self.n_pending + self.rep(n_emit)
        self.width += 1
        self.n_done = self.n_done + n_emit
        return n_emit

    def spec_step(self, plan: Plan, step: int):
        """Draft ``plan``'s tree from every row's root, verify it with one target forward, commit.
        -> (n_emit [B], accept_len [B], drafter forwards)"""
        B, L, config, s = self.B, self.L, self.config, self.s
        active = self.n_done < L
        n_done = self.n_done
        # 1. the drafter caches the committed tokens it has not seen and scores the root
        P = self.width
        pos = (n_done.repeat(self.halves) - self.n_pending)[:, None] + torch.arange(P)
        root_logits, root_state = self.live_drafter.commit(self.pending[:, :P], self.pending_feat[:, :P],
                                                           self.n_pending, pos.clamp(max=L - 1))
        scorer = DraftScorer(self.live_drafter, B, s.guided, s.cfg_scale, n_done - 1, L - 1, s.cfg_interval)
        scorer.forwards = 1
        root_tok = self.out.gather(1, (n_done - 1)[:, None]).squeeze(1)
        root_logits = scorer.guide(root_logits, n_done)
        # 2. grow the draft tree
        if plan.kind == "chain":
            tree = grow_chain(scorer, root_tok, root_logits, root_state, plan.depth, plan.sampled, self._process,
                              s.seed, step, s.rows)
        elif plan.kind == "static":
            tree = grow_static(scorer, root_tok, root_logits, root_state, static_shape(plan.static_widths),
                               self._process, s.seed, step, s.rows)
        else:
            tree = grow_dynamic(scorer, root_tok, root_logits, root_state, plan.depth, plan.top_per_node,
                                plan.n_nodes)
        # 3. one target forward over every row's tree
        T = tree.tokens.shape[1]
        rep = self.rep
        positions = ((n_done - 1)[:, None] + tree.depth).clamp(max=L - 1)
        mask = ops.ancestor_mask(tree.parents)
        logits, hidden = self.forward(rep(tree.tokens), self.target_len, positions=rep(positions), tree_mask=rep(mask))
        # 4. verify
        result = self._verify(logits, tree.tokens, tree.parents, tree.depth, tree.draft_probs, step, drafts=True)
        # 5. commit: accepted path tokens, then next_token, never past L; keep the root's and the accepted
        # nodes' K/V (the root plus n_emit - 1 path nodes)
        n_emit = torch.where(active, _emit_counts(result.accept_len, n_done, L), 0)  # [B]
        self.figures = _StepFigures(plan, step, _figures(n_emit, result.accept_len, active, L - n_done, plan.depth,
                                                         nonfinite_logits(logits) | nonfinite_logits(root_logits)),
                                    result.accept_len, active)
        kept_nodes, emitted = self._commit(tree.tokens, result, n_emit)
        # 6. the drafter's next input: the emitted tokens with the target hidden state before each, all T
        # columns (no host read; the drafter ignores the positions past each row's n_pending). ``sync``
        # narrows ``width`` to the longest row's columns once the step's figures are read.
        self.pending[:, :T] = rep(emitted)
        feat_nodes = rep(kept_nodes)[..., None].expand(-1, -1, hidden.shape[-1])
        self.pending_feat[:, :T] = hidden.gather(1, feat_nodes)
        self.n_pending = rep(n_emit)
        self.width = T
        return n_emit, result.accept_len, tree.draft_forwards

    def _process(self, draft_logits):
        """The sampling distribution of sampled drafts [B, ..., V] from guided logits (the drafter's, or the
        target's for Jacobi drafts). Greedy rows (temperature 0) draw the top token (a one-hot q): greedy
        verification keeps a draft only if it is the target's top token, so a draw from the softmax would only
        waste the draft."""
        s = self.s
        q = ops.process_logits(draft_logits, None, 1.0, s.temperature, s.top_k, s.top_p)
        if self.greedy_rows is None:
            return q
        top = torch.zeros_like(q).scatter_(-1, draft_logits.argmax(-1, keepdim=True), 1.0)
        return torch.where(self.greedy_rows.view(-1, *([1] * (q.dim() - 1))), top, q)

    def close(self) -> None:
        if self.drafter is not None:
            self.drafter.release()
        self.target.free_cache()


class _LiveDrafter:
    """The loop's drafter over its live rows: per-row inputs at full size in, outputs at full size out."""

    def __init__(self, loop: "_Loop"):
        self.loop = loop

    def commit(self, tokens, features, n_new, positions):
        loop = self.loop
        out = loop.drafter.commit(loop.sub(tokens), loop.sub(features), loop.sub(n_new), loop.sub(positions))
        return tuple(loop.full(y) for y in out)

    def expand(self, tokens, parents, parent_state, positions):
        loop = self.loop
        out = loop.drafter.expand(loop.sub(tokens), loop.sub(parents), loop.sub(parent_state), loop.sub(positions))
        return tuple(loop.full(y) for y in out)


@dataclass
class _StepFigures:
    """One step's figures, left on the device until the next step's host read (``_Loop.sync``)."""
    plan: Plan
    step: int
    device_values: torch.Tensor  # int64 [4 + 2 depth], see ``_figures``
    accept_len: torch.Tensor  # [B]
    active: torch.Tensor  # [B] bool: the rows that were generating
    values: Optional[List[int]] = None  # device_values once read

    # the read values by name (layout: ``_figures``)
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


def _figures(n_emit, accept_len, active, to_go, depth: int, broken) -> torch.Tensor:
    """int64 [4 + 2 depth]: tokens emitted, active rows, the longest row's tokens, broken logits (0/1), then
    for d = 1..depth the active rows that accepted depth d (hits), then those that reached depth d - 1 with
    depth d inside the image (trials); to_go [B] = tokens each row still needed before the step."""
    d = torch.arange(1, depth + 1)
    inside = (to_go[:, None] >= d) & active[:, None]  # [B, depth]
    hits = ((accept_len[:, None] >= d) & inside).sum(0)
    trials = ((accept_len[:, None] >= d - 1) & inside).sum(0)
    head = torch.stack([n_emit.sum(), active.sum(), n_emit.max(), broken.to(torch.int64)])
    return torch.cat([head, hits, trials])


@holds_models("target", "drafter")
@torch.no_grad()
def generate_spec(target, drafter, cond_idx: torch.Tensor, neighbours: Optional[torch.Tensor] = None, *,
                  config: SpecConfig = SpecConfig(), cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0,
                  seed: int = 0, on_step=None, length: Optional[int] = None, cfg_interval: int = -1,
                  emb_masks: Optional[torch.Tensor] = None, image_ids: Optional[torch.Tensor] = None):
    """cond_idx [B] class ids (or t2i caption features [B, C, D] with emb_masks [B, C] or None, as in
    ``generate_ar``) -> (tokens [B, L] int64, SpecStats). The first token is sampled like AR
    (offset 0); verify step s uses offset s. ``length`` (default: the whole image, block_size) stops every
    row after its first ``length`` tokens, a prefix of the image (tests and benchmarks of the first
    positions). Their law is the full run's; the tokens themselves may differ, since trees near the end
    are clipped. ``cfg_interval`` >= 0: tokens past that index are sampled without guidance, as in
    LlamaGen's AR loop (see ``unguided_past_interval``). With ``config.tree == "auto"`` and no
    ``config.cost_model``, the device's cost model is calibrated first (a few seconds, then cached).
    ``image_ids`` [B] (default 0..B-1): each image's Philox row key in every draw, so with a fixed tree an
    image's tokens depend on its id and the settings, not on the batch (docs/sampling.md)."""
    device = target.tok_embeddings.weight.device
    L = check_length(length, target.config.block_size)
    check_condition(target, cond_idx)
    check_config(config, neighbours, target.config.vocab_size, drafter)
    check_gpt_sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval, cond_idx.shape[0], device)
    sampling = Sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval)
    keyed = dataclasses.replace(sampling, rows=check_image_ids(image_ids, cond_idx.shape[0], device))
    condition_masks(target, cond_idx, emb_masks, sampling.guided)  # bad masks fail before any calibration
    # the loop creates its bookkeeping tensors on the default device; a torch.device context would make it
    # the model's, but it intercepts every torch call (~10 % of a CPU run), so it is entered only when needed
    same = torch.get_default_device() == device
    with contextlib.nullcontext() if same else torch.device(device):
        if config.tree != "auto":
            return _generate_fixed(target, drafter, cond_idx, neighbours, config, keyed, on_step, L, emb_masks)
        # the calibration steps batches of other sizes: row keys 0..b-1
        cost_model = config.cost_model or _resolve(target, drafter, cond_idx, neighbours, config, sampling, L,
                                                   emb_masks=emb_masks)
        return _generate_auto(target, drafter, cond_idx, neighbours, config, keyed, on_step, L, cost_model,
                              emb_masks)


DRAFTS = (None, "deterministic", "sampled")


def _check_neighbour_ids(config: SpecConfig, neighbours, vocab: int) -> None:
    """The table's ids, scanned once before the loop and the calibration (inside them the ops' value scans
    are off)."""
    if relaxed_acceptance(config, neighbours) and config.k > 0 and isinstance(neighbours, torch.Tensor) and \
            neighbours.dim() == 2:
        ops.checks.in_range("neighbours", neighbours[:, : config.k], 0, vocab)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def check_config(config: SpecConfig, neighbours, vocab: int, drafter=None) -> None:
    """ValueError naming the option for a config the loop cannot run as asked (vocab: the target's V)."""
    if config.method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {config.method!r}")
    if config.tree not in TREES:
        raise ValueError(f"tree must be one of {TREES}, got {config.tree!r}")
    check_compile(config.compile)
    _check_jacobi(config, drafter)
    if config.draft not in DRAFTS:
        raise ValueError(f"draft must be one of {DRAFTS}, got {config.draft!r}")
    if config.draft == "sampled" and config.tree == "dynamic":
        raise ValueError("draft='sampled' does not apply to tree='dynamic' (EAGLE-2 trees take each node's top "
                         "tokens: deterministic drafts); use tree='chain' or 'static' for sampled drafts")
    if not _is_int(config.depth) or config.depth < 1:
        raise ValueError(f"depth must be an int >= 1 (draft levels below the root), got {config.depth!r}")
    if not _is_int(config.n_nodes) or config.n_nodes < 1:
        raise ValueError(f"n_nodes must be an int >= 1 (drafted nodes kept per step; for no drafts use "
                         f"method='ar'), got {config.n_nodes!r}")
    top_max = vocab if config.tree == "dynamic" else None  # other trees do not use it
    if not _is_int(config.top_per_node) or config.top_per_node < 1 or (top_max and config.top_per_node > top_max):
        raise ValueError(f"top_per_node must be an int in [1, {top_max or 'V'}] (children per expanded node; "
                         f"V = {vocab}), got {config.top_per_node!r}")
    widths = config.static_widths
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or not widths or \
            not all(_is_int(w) and w >= 1 for w in widths):
        raise ValueError(f"static_widths must be a non-empty sequence of ints >= 1 (children of a depth's first "
                         f"node), got {widths!r}")
    if config.method == "lantern" and config.k > 0 and neighbours is None:
        raise ValueError("method='lantern' needs the neighbour table (lantern.ops.latent_neighbours)")
    check_spec_config(config, neighbours, relaxed_acceptance(config, neighbours))
    _check_neighbour_ids(config, neighbours, vocab)


def _check_jacobi(config: SpecConfig, drafter) -> None:
    """The options of method "sjd" (and that the others do without them), and who drafts."""
    if config.method != "sjd":
        if drafter is None:
            raise ValueError(f"method={config.method!r} needs a drafter (lantern.models.drafter.EagleDrafter or "
                             f"GPTDrafter); method='sjd' drafts without one")
        if config.coupling:
            raise ValueError("coupling (coupled Jacobi drafts) applies to method='sjd' only")
        if config.plans is not None and any(p.kind == "jacobi" for p in config.plans):
            raise ValueError("plans: Jacobi windows need method='sjd'")
        return
    if drafter is not None:
        raise ValueError("method='sjd' drafts from the target itself: drafter must be None")
    if config.tree not in ("auto", "chain"):
        raise ValueError(f"method='sjd' verifies its window as a chain: tree must be 'auto' (the planner picks the "
                         f"window) or 'chain' (every step the whole window), got {config.tree!r}")
    if config.draft is not None:
        raise ValueError(f"draft does not apply to method='sjd' (its drafts are the target's own samples), "
                         f"got {config.draft!r}")
    if not _is_int(config.window) or config.window < 1:
        raise ValueError(f"window must be an int >= 1 (Jacobi drafts per step), got {config.window!r}")
    if not isinstance(config.coupling, bool):
        raise ValueError(f"coupling must be a bool, got {config.coupling!r}")
    if config.init not in FRESH_INITS:
        raise ValueError(f"init must be one of {FRESH_INITS} (fresh window slots), got {config.init!r}")
    if config.plans is not None and any(p.kind not in ("ar", "jacobi") for p in config.plans):
        raise ValueError("method='sjd' plans must be AR or Jacobi windows (planner.jacobi_plans)")


def _record_step(stats: SpecStats, last: _StepFigures, draft_forwards: int, steps: list) -> int:
    """Accounts a step whose figures were read (``_Loop.sync``) -> its tokens."""
    stats.steps += 1
    stats.target_forwards += 1
    stats.draft_forwards += draft_forwards
    stats.row_steps += last.active_rows
    stats.emitted += last.tokens
    steps.append((last.accept_len, last.active))
    return last.tokens


def _accept_lens(steps: list) -> list:
    """Per step: accept_len of the rows that were generating (host reads after the loop)."""
    return [accept_len[active].cpu() for accept_len, active in steps]


def _compile_stats(config: SpecConfig, target, stats: SpecStats) -> Optional[CompileStats]:
    """A run's CompileStats when config.compile resolves to compiled forwards on the target's device, else
    None; the resolution and its reason go to stats.compile."""
    choice = resolve_compile(config.compile, target.tok_embeddings.weight.device)
    stats.compile = choice.reason
    return CompileStats() if choice.on else None


def _record_compile(stats: SpecStats, compiled: Optional[CompileStats]) -> None:
    if compiled is not None:
        stats.compile_s, stats.compiled_graphs = compiled.compile_s, compiled.graphs


def _generate_fixed(target, drafter, cond_idx, neighbours, config, sampling, on_step, L, emb_masks=None):
    t0 = time.perf_counter()
    stats = SpecStats()
    plan = config.fixed_plan()
    compiled = _compile_stats(config, target, stats)
    loop = _Loop(target, drafter, cond_idx, neighbours, config, sampling, L, [plan], catch_up=False,
                 emb_masks=emb_masks, compiled=compiled)
    stats.target_forwards += 1  # the prefill
    step, last, forwards, n_emit, steps = 0, None, 0, None, []
    with ops.checks.values_checked_by_caller():
        while True:
            counts = loop.sync(0, last)  # the step's one host read
            if last is not None:
                _record_step(stats, last, forwards, steps)
                if on_step is not None:
                    on_step(n_emit)
            if counts[0] == 0:
                break
            if loop.should_compact(counts[0]):
                loop.compact()
            step += 1
            n_emit, forwards = loop.step(plan, step)
            last = loop.figures
    loop.close()
    stats.accept_lens = _accept_lens(steps)
    stats.plan_counts = {plan.name: stats.steps}
    _record_compile(stats, compiled)
    stats.wall_s = time.perf_counter() - t0
    return loop.out, stats


PRIOR_STEPS = 8  # tree=auto: the acceptance prior's weight, in steps of the batch


def _generate_auto(target, drafter, cond_idx, neighbours, config, sampling, on_step, L, cost_model, emb_masks=None):
    t0 = time.perf_counter()
    stats = SpecStats()
    B = cond_idx.shape[0]
    # the prior weighs PRIOR_STEPS steps of the whole batch: a step of 10 rows is 10 trials, and two
    # unlucky steps must not outweigh a calibration's rates and turn a run to AR for good (AR steps
    # bring no acceptance data)
    acceptance = AcceptanceModel(prior=config.acceptance_prior, memory=config.acceptance_memory,
                                 prior_rates=cost_model.acceptance, prior_weight=PRIOR_STEPS * B)
    planner = Planner(cost_model, config.candidates(), acceptance, adapt_costs=config.adapt_costs,
                      margin=config.margin)
    max_depth = planner.max_depth
    # the progress before the first step: every row has its first token
    at_start = _progress(torch.ones(B, dtype=torch.int64), L, max_depth).tolist()
    first = planner.choose(B * sampling.halves, B, at_start[1:])
    if first.plan.is_ar and not first.probe:
        return _generate_all_ar(target, cond_idx, config, sampling, on_step, L, emb_masks, planner, first, stats, t0)
    compiled = _compile_stats(config, target, stats)
    loop = _Loop(target, drafter, cond_idx, neighbours, config, sampling, L, planner.plans, catch_up=True,
                 emb_masks=emb_masks, compiled=compiled)
    stats.target_forwards += 1  # the prefill
    step, decision, last, forwards, n_emit, steps = 0, None, None, 0, None, []
    t_step = time.perf_counter()
    with ops.checks.values_checked_by_caller():
        while True:
            counts = loop.sync(max_depth, last)  # the step's one host read: the step before is done
            now = time.perf_counter()
            if last is not None:
                tokens = _record_step(stats, last, forwards, steps)
                if not last.plan.is_ar:
                    planner.acceptance.observe(last.plan, last.hits, last.trials)
                # compile=True: a step's first calls of new graphs (compile included) are left out of its time
                compiling = compiled.compile_s - compile_before if compiled is not None else 0.0
                planner.record(decision, tokens, max(now - t_step - compiling, 0.0))
                if on_step is not None:
                    on_step(n_emit)
            if counts[0] == 0:
                break
            if loop.should_compact(counts[0]):
                loop.compact()
            t_step = now
            compile_before = compiled.compile_s if compiled is not None else 0.0
            step += 1
            planner.forget()
            decision = planner.choose(loop.forward_rows, counts[0], counts[1:])
            plan = decision.plan
            n_emit, forwards = loop.step(plan, step)
            last = loop.figures
            stats.plan_counts[plan.name] = stats.plan_counts.get(plan.name, 0) + 1
    loop.close()
    stats.accept_lens = _accept_lens(steps)
    stats.planner = dict(planner.summary(), cost_model={k: v for k, v in cost_model.meta.items() if k != "key"})
    _record_compile(stats, compiled)
    stats.wall_s = time.perf_counter() - t0
    return loop.out, stats


def _progress(n_done: torch.Tensor, L: int, max_depth: int) -> torch.Tensor:
    """int64 [1 + max_depth]: the rows still generating (n_done [B] < L), then for d = 1..max_depth those
    with at least d + 1 tokens to go."""
    to_go = (L - n_done)[:, None] - torch.arange(max_depth + 1)  # [B, D + 1]
    return (to_go >= 1).sum(0)


def _generate_all_ar(target, cond_idx, config, sampling, on_step, L, emb_masks, planner, decision, stats, t0):
    """tree="auto" when AR is the plan of the first step: then it is the plan of every step (AR steps give
    the acceptance model no data, their measured time corrects every plan's predicted time alike, and the
    rows' remaining tokens only shrink, which favours AR further), so the run is ``generate_ar``'s loop: the
    same tokens as AR steps of the speculative loop (one stream, offset = token index), without its
    drafter, tree bookkeeping and per-step host read."""
    B = cond_idx.shape[0]
    progress = None if on_step is None else (lambda step: on_step(torch.ones(B, dtype=torch.int64))
                                             if step >= 1 else None)
    compile_stats: dict = {}
    # generate_spec holds the target already
    tokens = generate_ar.unguarded(target, cond_idx, cfg_scale=sampling.cfg_scale, temperature=sampling.temperature,
                                   top_k=sampling.top_k, top_p=sampling.top_p, cfg_interval=sampling.cfg_interval,
                                   seed=sampling.seed, on_token=progress, length=L, emb_masks=emb_masks,
                                   compile=config.compile, stats=compile_stats, image_ids=sampling.rows)
    stats.wall_s = time.perf_counter() - t0
    steps = L - 1
    stats.steps = steps
    stats.target_forwards = L
    stats.row_steps = stats.emitted = B * steps
    stats.accept_lens = [torch.zeros(B, dtype=torch.int64) for _ in range(steps)]
    stats.plan_counts = {AR_PLAN.name: steps} if steps else {}
    for _ in range(steps):  # the steps' time, shared out evenly (no step was timed alone)
        planner.record(decision, B, stats.wall_s / steps)
    stats.planner = dict(planner.summary(), cost_model={k: v for k, v in planner.cost_model.meta.items()
                                                        if k != "key"}, all_ar=True)
    stats.compile_s = compile_stats.get("compile_s", 0.0)
    stats.compiled_graphs = compile_stats.get("compiled_graphs", 0)
    stats.compile = compile_stats.get("compile", "")
    return tokens, stats


# -- calibration ------------------------------------------------------------------------------------------

def _mode(config: SpecConfig, sampling: Sampling, L: int, plans: Sequence[Plan], relaxed: bool,
          compile_options: Optional[dict] = None) -> dict:
    """What, besides the device and models, changes a step's cost: the verify work, the candidates and
    whether (and how) the forwards are compiled (and, for the acceptance the calibration measures, the
    drafting rules)."""
    jacobi = {"coupling": config.coupling, "init": config.init} if config.method == "sjd" else {}
    compiled = {} if compile_options is None else {"compiled": repr(sorted(compile_options.items()))}
    return {**jacobi, **compiled, "method": config.method, "k": config.k if relaxed else 0,
            "budget": config.budget if relaxed else "",
            "lam": config.lam if relaxed else None, "guided": sampling.guided, "length": L,
            # the acceptance the calibration measures depends on these (the step costs do not)
            "delta": config.delta if relaxed else 0.0, "cfg_scale": _number(sampling.cfg_scale),
            "temperature": _number(sampling.temperature),
            "draft": config.draft, "top_k": _positive(sampling.top_k), "top_p": _below_one(sampling.top_p),
            "plans": [p.name for p in plans]}


def _number(x):
    """A scalar setting as a float, a per-row tensor as "per-row"."""
    return "per-row" if isinstance(x, torch.Tensor) else float(x)


def _positive(x) -> bool:
    return bool((torch.as_tensor(x) > 0).any())


def _below_one(x) -> bool:
    return bool((torch.as_tensor(x) < 1).any())


@holds_models("target", "drafter")
def resolve_cost_model(target, drafter, cond_idx, neighbours=None, *, config: SpecConfig = SpecConfig(),
                       cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0, seed: int = 0,
                       length: Optional[int] = None, cfg_interval: int = -1, remeasure: bool = False,
                       emb_masks: Optional[torch.Tensor] = None) -> CostModel:
    """The cost model ``tree="auto"`` uses for these models and settings: cached, or calibrated now (a few
    seconds). Call it before timing a run so the calibration is not part of it."""
    L = check_length(length, target.config.block_size)
    check_condition(target, cond_idx)
    check_config(config, neighbours, target.config.vocab_size, drafter)
    device = target.tok_embeddings.weight.device
    check_gpt_sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval, cond_idx.shape[0], device)
    sampling = Sampling(cfg_scale, temperature, top_k, top_p, seed, cfg_interval)
    same = torch.get_default_device() == device
    with torch.no_grad(), contextlib.nullcontext() if same else torch.device(device):
        return _resolve(target, drafter, cond_idx, neighbours, config, sampling, L, remeasure, emb_masks)


def _resolve(target, drafter, cond_idx, neighbours, config, sampling, L, remeasure=False,
             emb_masks=None) -> CostModel:
    plans = config.candidates()
    device = target.tok_embeddings.weight.device
    options = resolve_compile(config.compile, device).options
    key = cache_key(device, target, drafter, _mode(config, sampling, L, plans, relaxed_acceptance(config, neighbours),
                                                   options))
    rows = cond_idx.shape[0] * sampling.halves
    grid = sorted(set(CALIBRATION_ROWS) | {rows})

    def measure(missing, known):
        return calibrate(target, drafter, cond_idx, neighbours, config, sampling, L, plans, rows_grid=missing,
                         known=known, emb_masks=emb_masks)

    return cached_cost_model(key, measure, rows=grid, remeasure=remeasure)


def calibrate(target, drafter, cond_idx, neighbours, config: SpecConfig, sampling: Sampling, L: int,
              plans: Sequence[Plan], rows_grid: Sequence[int] = CALIBRATION_ROWS, reps: int = 2,
              max_point_s: float = 0.3, known: Optional[CostModel] = None,
              emb_masks: Optional[torch.Tensor] = None) -> dict:
    """{"points": seconds per step of the plans at each row count of ``rows_grid`` (labels cycled from
    cond_idx), "acceptance": the chain-equivalent acceptance per level that the drafting steps measured
    (``planner.measured_rates``; the planner's prior)}. ``known``: a cost model already measured at other row
    counts, which this calibration extends.

    At one row count every plan steps the same decoding state in turn, round after round, as ``tree="auto"``
    would switch between them: the steps run at the cache lengths of a real image, the drafter catches up
    after AR steps as it does in a run, and a change of the device's load during the calibration hits
    every plan alike; an AR step runs before each drafting plan's, so AR, the reference, is timed often and
    next to every plan. A step's time includes its host read (``_Loop.sync``). The first round is not timed
    (first calls, caches); a point is the fastest of ``reps`` timed steps (on a shared device, load only ever
    adds time). A fresh state starts when a row finishes its image.

    At the smallest row count every plan is timed. At a larger one AR is timed first, and then only the
    plans that could pay there (``_could_pay``: their time at the largest smaller row count grown by AR's
    growth times their nodes, and the acceptance measured so far); an untimed step longer than 4
    ``max_point_s`` drops a plan too. A plan left out gets, as its point there, the time that left it out
    (the prediction, or that untimed step): extrapolating its smaller row counts' slope could make it look
    cheaper than the bound that said it cannot pay, and the planner would choose it.

    A Jacobi window's acceptance depends on the windows the steps before it used (docs/sjd.md), so the
    interleaved steps say little about it: each window's acceptance is measured on a run of that window alone
    instead (``_jacobi_counts``; once per cost model, not when extending ``known``)."""
    device = target.tok_embeddings.weight.device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    halves = sampling.halves
    points: Dict[str, Dict[int, float]] = {p.name: dict(known.points.get(p.name, {})) if known else {} for p in plans}
    counts = {p: ([0] * p.depth, [0] * p.depth) for p in plans if not p.is_ar}  # hits, trials per depth
    if known is None or not known.acceptance:
        counts.update(_jacobi_counts(target, cond_idx, neighbours, config, sampling, L, plans, emb_masks))
    max_depth = max(p.depth for p in plans)
    compiled = CompileStats() if resolve_compile(config.compile, device).on else None  # the run's forwards
    new_rows = set()
    for rows in sorted(rows_grid):
        B = max(rows // halves, 1)
        rows = B * halves
        pick = torch.arange(B, device=cond_idx.device) % cond_idx.shape[0]
        labels, masks = cond_idx[pick], None if emb_masks is None else emb_masks[pick]
        state = {"loop": None, "step": 0}

        def timed_step(plan: Plan) -> float:
            loop = state["loop"]
            if loop is None or bool((loop.n_done >= L).any()):  # one host read, outside any timing
                if loop is not None:
                    loop.close()
                loop = state["loop"] = _Loop(target, drafter, labels, neighbours, config, sampling, L, plans,
                                             catch_up=True, emb_masks=masks, compiled=compiled)
            state["step"] += 1
            sync()
            compiling = compiled.compile_s if compiled is not None else 0.0
            t0 = time.perf_counter()
            with ops.checks.values_checked_by_caller():  # as in the decoding loop
                loop.step(plan, state["step"])
                loop.sync(max_depth, loop.figures)  # the step's host read, as in the loop
            sync()
            seconds = time.perf_counter() - t0
            if compiled is not None:  # a first call of a new graph: its compile is not the step's cost
                seconds = max(seconds - (compiled.compile_s - compiling), 0.0)
            if not plan.is_ar and plan.kind != "jacobi":  # a window's acceptance: _jacobi_counts
                hits, trials = counts[plan]
                for d, (h, t) in enumerate(zip(loop.figures.hits, loop.figures.trials)):
                    hits[d] += h
                    trials[d] += t
            return seconds

        times: Dict[str, List[float]] = {p.name: [] for p in plans}
        bounds: Dict[str, float] = {}
        smaller = [r for r in points[AR_PLAN.name] if r < rows]
        todo = list(plans)
        if smaller:  # AR first, then the plans that could pay at this row count
            times[AR_PLAN.name] = [timed_step(AR_PLAN) for _ in range(reps + 1)][1:]
            rates = measured_rates(counts, max_depth) if any(sum(t) for _, t in counts.values()) else \
                (known.acceptance if known else {})
            todo = [p for p in plans if p.is_ar or _could_pay(p, points, max(smaller), rows, min(times["ar"]),
                                                             halves, rates, max_point_s)]
            for p in plans:  # a plan left out gets the bound that left it out: never a cheaper extrapolation
                if p not in todo and max(smaller) in points[p.name]:
                    bounds[p.name] = _predicted(p, points, max(smaller), min(times["ar"]))
        for rnd in range(reps + 1):
            # AR, the reference every plan is compared with, before each drafting plan's step
            for plan in [q for p in todo if not p.is_ar for q in (AR_PLAN, p)] or [AR_PLAN]:
                if plan not in todo:
                    continue
                seconds = timed_step(plan)
                if rnd > 0:
                    times[plan.name].append(seconds)
                elif smaller and seconds > 4 * max_point_s and not plan.is_ar:
                    todo.remove(plan)  # its untimed step already says it is too slow: that step is its point
                    bounds[plan.name] = seconds
        if state["loop"] is not None:
            state["loop"].close()
        if compiled is not None:  # the graph of tree="auto"'s all-AR runs (generate_ar's), compiled here too
            generate_ar.unguarded(target, labels, cfg_scale=sampling.cfg_scale, temperature=sampling.temperature,
                                  top_k=sampling.top_k, top_p=sampling.top_p, cfg_interval=sampling.cfg_interval,
                                  seed=sampling.seed, length=min(L, 2), emb_masks=masks, compile=config.compile)
        for name, measured in times.items():
            if measured:
                points[name][rows] = min(measured)
                new_rows.add(rows)
            elif name in bounds:
                points[name][rows] = bounds[name]
    _nested_min(points, plans)
    fresh = {name: {r: s for r, s in by_rows.items() if r in new_rows} for name, by_rows in points.items()}
    return {"points": {name: by_rows for name, by_rows in fresh.items() if by_rows},
            "acceptance": measured_rates(counts, max_depth)}


JACOBI_CALIBRATION_IMAGES = 2  # images of each Jacobi window's acceptance run
JACOBI_CALIBRATION_TOKENS = 32  # tokens per image it generates (at most the image)


def _jacobi_counts(target, cond_idx, neighbours, config: SpecConfig, sampling: Sampling, L: int,
                   plans: Sequence[Plan], emb_masks=None) -> Dict[Plan, tuple]:
    """Per Jacobi window of ``plans``: (hits, trials) per depth over a run of that window alone, from the image's
    start, of JACOBI_CALIBRATION_IMAGES images (labels cycled from cond_idx) and JACOBI_CALIBRATION_TOKENS
    tokens each."""
    counts = {}
    pick = torch.arange(JACOBI_CALIBRATION_IMAGES, device=cond_idx.device) % cond_idx.shape[0]
    labels, masks = cond_idx[pick], None if emb_masks is None else emb_masks[pick]
    length = min(L, JACOBI_CALIBRATION_TOKENS)
    for plan in plans:
        if plan.kind != "jacobi":
            continue
        hits, trials = [0] * plan.depth, [0] * plan.depth
        loop = _Loop(target, None, labels, neighbours, config, sampling, length, [plan], catch_up=False,
                     emb_masks=masks)
        step, last = 0, None
        with ops.checks.values_checked_by_caller():
            while True:
                active = loop.sync(0, last)[0]  # reads the last step's figures
                if last is not None:
                    for d, (h, t) in enumerate(zip(last.hits, last.trials)):
                        hits[d] += h
                        trials[d] += t
                if active == 0:
                    break
                step += 1
                loop.step(plan, step)
                last = loop.figures
        loop.close()
        counts[plan] = (hits, trials)
    return counts


PRUNE_SLACK = 0.25  # calibrate: a plan predicted this much slower than AR at a row count is still timed there


def _predicted(plan: Plan, points: Dict[str, Dict[int, float]], at: int, ar_seconds: float) -> float:
    """A plan's step where an AR step takes ``ar_seconds``, from its time at ``at`` rows: plus AR's growth
    since ``at`` rows times its nodes (the target's forward grows with its tokens, rows x nodes)."""
    ar_growth = max(ar_seconds - points[AR_PLAN.name][at], 0.0)
    return points[plan.name][at] + ar_growth * _tree_size(plan)


def _could_pay(plan: Plan, points: Dict[str, Dict[int, float]], at: int, rows: int, ar_seconds: float,
               halves: int, acceptance, max_point_s: float) -> bool:
    """Whether to time ``plan`` at ``rows`` rows, where an AR step took ``ar_seconds`` (see ``calibrate``):
    measured at ``at`` rows, predicted (``_predicted``) within 4 max_point_s and at most PRUNE_SLACK slower
    than AR in tokens per second, every row drafting every level at the acceptance measured so far."""
    if at not in points[plan.name]:
        return False
    seconds = _predicted(plan, points, at, ar_seconds)
    if seconds > 4 * max_point_s:
        return False
    B = max(rows // halves, 1)
    tokens = AcceptanceModel(prior_rates=acceptance).expected_tokens(plan, B, [B] * plan.depth)
    return tokens / seconds * (1.0 + PRUNE_SLACK) >= B / ar_seconds


def _contains(big: Plan, small: Plan) -> bool:
    """Whether a step of ``big`` does all the work of a step of ``small`` and more (same kind of drafts, a
    tree that holds small's, at least as many drafter calls); every step contains an AR step."""
    if small.is_ar:
        return True
    if big.kind != small.kind or big.family != small.family or big.depth < small.depth:
        return False
    if big.kind == "dynamic":
        return big.n_nodes >= small.n_nodes and big.top_per_node >= small.top_per_node
    if big.kind == "static":
        return all(b >= w for b, w in zip(big.static_widths, small.static_widths))
    return True  # chains and Jacobi windows


def _nested_min(points: Dict[str, Dict[int, float]], plans: Sequence[Plan]) -> None:
    """Load on a shared device only adds time, and a step never costs more than a step that does all of its
    work and more (``_contains``), nor more than itself at a larger row count: ``points`` is lowered in
    place to the least such bound of the measured times."""
    measured = {p.name: dict(points[p.name]) for p in plans}
    for p in plans:
        for rows in points[p.name]:
            points[p.name][rows] = min(measured[q.name][r] for q in plans if _contains(q, p)
                                       for r in measured[q.name] if r >= rows)
