"""Who proposes each step's drafts: the ``Proposer`` protocol, chosen once per run by the method
(``new_state``). ``DrafterProposer``: a drafter (EAGLE, or a small GPT) grows a chain, a static tree or an
EAGLE-2 dynamic tree from each row's root (``trees.py``); ``JacobiProposer``: method "sjd", the target's own
earlier predictions in a window (``jacobi.py``, docs/sjd.md). Both take the AR plan as a one-node proposal
(the root alone: one token per row, as AR samples it). A new drafting method is one proposer and one plan kind.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Protocol, Sequence

import torch

from .ar import nonfinite_logits
from .compiled import CompiledRun, bucket, compiled_drafter
from .config import Sampling, SpecConfig
from .jacobi import JacobiWindow
from .plans import Plan, static_shape
from .state import AcceptanceRule, DecodeState, Outcome, Proposal, StepFigures
from .trees import DraftScorer, Tree, grow_chain, grow_dynamic, grow_static, guided_logits


class Proposer(Protocol):
    can_compact: bool  # whether finished rows may leave the models' caches (``DecodeState.compact``)

    def start(self, state: DecodeState, plans: Sequence[Plan], cond, masks, logits, hidden, first) -> None:
        """After the prefill: cond [n_rows, ...] the models' condition, logits / hidden [n_rows, V / D] the
        prefill's last row, first [B] the first image token."""

    def propose(self, state: DecodeState, plan: Plan, step: int) -> Proposal: ...

    def observe(self, state: DecodeState, plan: Plan, outcome: Outcome, step: int) -> None: ...

    def settle(self, figures: StepFigures) -> None:
        """The last step's figures, read on the host (``DecodeState.sync``)."""

    def keep_rows(self, place: torch.Tensor) -> None: ...

    def close(self) -> None: ...


def one_node(state: DecodeState) -> Proposal:
    """The AR step's proposal: each row's root alone, fed as a chain after the committed tokens."""
    B = state.B
    root = state.roots()[:, None]  # [B, 1]
    zeros = torch.zeros(B, 1, dtype=torch.int64, device=state.device)
    return Proposal(root, zeros - 1, zeros, None)


@dataclass
class DrafterFeed:
    """The drafter's input not yet in its cache, per model row: the newest committed tokens and the target's
    hidden state before each. The drafter reads it before it drafts (``take``); a step's committed tokens
    then replace it, while AR steps append to it (the drafter catches up on them before its next draft)."""
    tokens: torch.Tensor  # [n_rows, room] int64
    features: torch.Tensor  # [n_rows, room, D]
    n: torch.Tensor  # [n_rows] int64 the columns each row uses
    width: int = 1  # columns in use (>= n.max())
    taken: bool = False  # the drafter read the columns (this step drafted)
    fresh: bool = False  # the columns are a drafting step's (``narrow``)

    @classmethod
    def start(cls, first: torch.Tensor, hidden: torch.Tensor, room: int) -> "DrafterFeed":
        """first [n_rows] the first image token, hidden [n_rows, D] the prefill's state before it."""
        tokens = torch.zeros(first.shape[0], room, dtype=torch.int64, device=first.device)
        features = hidden.new_zeros(first.shape[0], room, hidden.shape[-1])
        tokens[:, 0], features[:, 0] = first, hidden
        return cls(tokens, features, torch.ones(first.shape[0], dtype=torch.int64, device=first.device))

    def take(self):
        """-> (tokens [n_rows, P], features [n_rows, P, D], n [n_rows]), P = width."""
        self.taken = True
        P = self.width
        return self.tokens[:, :P], self.features[:, :P], self.n

    def add(self, tokens: torch.Tensor, features: torch.Tensor, n_new: torch.Tensor) -> None:
        """tokens [n_rows, T], features [n_rows, T, D]: a step's committed tokens (n_new [n_rows] of them)."""
        if self.taken:  # replaces what the drafter read; all T columns (no host read), narrowed later
            T = tokens.shape[1]
            self.tokens[:, :T], self.features[:, :T], self.n, self.width = tokens, features, n_new, T
            self.taken, self.fresh = False, True
            return
        rows = torch.arange(tokens.shape[0], device=tokens.device)  # an AR step: one column at each row's end
        self.tokens[rows, self.n] = tokens[:, 0]
        self.features[rows, self.n] = features[:, 0]
        self.n = self.n + n_new
        self.width += 1
        self.fresh = False

    def narrow(self, longest: int) -> None:
        """After a drafting step's figures are read: the columns the longest row uses."""
        if self.fresh:
            self.width = max(longest, 1)


class LiveDrafter:
    """The drafter over the state's live rows: per-row inputs at full size in, outputs at full size out."""

    def __init__(self, drafter, state: DecodeState):
        self.drafter, self.state = drafter, state

    def commit(self, tokens, features, n_new, positions):
        sub = self.state.sub
        return tuple(map(self.state.full, self.drafter.commit(sub(tokens), sub(features), sub(n_new), sub(positions))))

    def expand(self, tokens, parents, parent_state, positions, tree_mask=None):
        sub = self.state.sub
        mask = {} if tree_mask is None else dict(tree_mask=sub(tree_mask))
        out = self.drafter.expand(sub(tokens), sub(parents), sub(parent_state), sub(positions), **mask)
        return tuple(map(self.state.full, out))

    @property
    def accepts_tree_mask(self) -> bool:
        return getattr(self.drafter, "accepts_tree_mask", False)


def drafter_can_compact(drafter) -> bool:
    """Whether ``drafter``'s caches can drop rows (``keep_rows``)."""
    return hasattr(drafter, "keep_rows")


class DrafterProposer:
    """Drafts a tree per row with a drafter. ``catch_up``: AR steps come between drafting steps (the feed and
    the drafter's cache hold up to L tokens more)."""

    def __init__(self, drafter, catch_up: bool):
        self.drafter, self.catch_up = drafter, catch_up
        self.can_compact = drafter_can_compact(drafter)
        self.grow = {"chain": self._chain, "static": self._static, "dynamic": self._dynamic}

    def start(self, state, plans, cond, masks, logits, hidden, first) -> None:
        if state.compiled is not None:
            self.drafter = compiled_drafter(self.drafter, state.device, state.compiled)
        self.live = LiveDrafter(self.drafter, state)
        T_max = max(p.nodes for p in plans)
        beams = max((p.beam_nodes for p in plans), default=0)
        room = T_max + (state.L if self.catch_up else 0)  # the feed's columns
        # compiled: cache slots for the padding nodes (the drafter's expansions, catch-up)
        padded = state.compiled is not None and not state.compiled.aot
        pad = bucket(max(T_max, beams, room + 1)) if padded else 0
        self.drafter.reset(cond, state.n_rows, state.L + max(T_max, beams) + (state.L if self.catch_up else 0)
                           + pad, masks)
        self.feed = DrafterFeed.start(state.rep(first), hidden, room + 1)

    def propose(self, state: DecodeState, plan: Plan, step: int) -> Proposal:
        if plan.is_ar:  # the drafter does nothing; the token joins the feed
            return one_node(state)
        s, B, L, n_done = state.s, state.B, state.L, state.n_done
        # the drafter caches the committed tokens it has not seen and scores the root
        tokens, features, n_new = self.feed.take()
        positions = (state.rep(n_done) - n_new)[:, None] + torch.arange(tokens.shape[1], device=state.device)
        root_logits, root_state = self.live.commit(tokens, features, n_new, positions.clamp(max=L - 1))
        scorer = DraftScorer(self.live, B, s.guided, s.cfg_scale, n_done - 1, L - 1, s.cfg_interval)
        scorer.forwards = 1
        root_logits = scorer.guide(root_logits, n_done)
        tree = self.grow[plan.kind](state, scorer, state.roots(), root_logits, root_state, plan, step)
        return Proposal(tree.tokens, tree.parents, draft_probs=tree.draft_probs,
                        **state.tree_inputs(tree.parents, tree.depth, tree.layout),
                        broken=nonfinite_logits(root_logits), draft_forwards=tree.draft_forwards, layout=tree.layout)

    def _chain(self, state, scorer, root_tok, root_logits, root_state, plan: Plan, step: int) -> Tree:
        return grow_chain(scorer, root_tok, root_logits, root_state, plan.depth,
                          state.draft if plan.sampled else None, step)

    def _static(self, state, scorer, root_tok, root_logits, root_state, plan: Plan, step: int) -> Tree:
        return grow_static(scorer, root_tok, root_logits, root_state, static_shape(plan.static_widths), state.draft,
                           step)

    def _dynamic(self, state, scorer, root_tok, root_logits, root_state, plan: Plan, step: int) -> Tree:
        return grow_dynamic(scorer, root_tok, root_logits, root_state, plan.depth, plan.top_per_node, plan.n_nodes)

    def observe(self, state: DecodeState, plan: Plan, outcome: Outcome, step: int) -> None:
        """The committed tokens and the target's hidden state before each join the feed."""
        hidden = outcome.hidden  # [n_rows, T, D]
        nodes = state.rep(outcome.kept_nodes)[..., None].expand(-1, -1, hidden.shape[-1])
        self.feed.add(state.rep(outcome.emitted), hidden.gather(1, nodes), state.rep(outcome.n_emit))

    def settle(self, figures: StepFigures) -> None:
        self.feed.narrow(figures.longest)

    def keep_rows(self, place: torch.Tensor) -> None:
        self.drafter.keep_rows(place)

    def close(self) -> None:
        self.drafter.release()


class JacobiProposer:
    """Method "sjd": each row's window of drafts (``JacobiWindow``), W = plan.depth of them fed as a chain
    after the root and verified as sampled drafts (draft_probs = the window's q rows); the window is refreshed
    from the same forward's predictions. W = 0 (the AR plan) samples one token as AR does."""

    can_compact = False

    def __init__(self, config: SpecConfig):
        self.init, self.coupling = config.init, config.coupling

    def start(self, state, plans, cond, masks, logits, hidden, first) -> None:
        s, B = state.s, state.B
        predicts = torch.zeros(B, dtype=torch.int64, device=state.device)  # the first token's row
        first_probs = state.process(guided_logits(logits, B, s.guided, s.cfg_scale, predicts, s.cfg_interval))
        self.window = JacobiWindow(first, first_probs, max(p.depth for p in plans), self.init, self.coupling,
                                   s.seed, s.rows)

    def propose(self, state: DecodeState, plan: Plan, step: int) -> Proposal:
        B, W = state.B, plan.depth
        tokens, draft_probs = self.window.chain(state.roots(), W)  # [B, W + 1], [B, W + 1, V] or None
        parents = torch.arange(-1, W, device=state.device).expand(B, W + 1)
        depth = torch.arange(W + 1, device=state.device).expand(B, W + 1)
        layout = tuple(range(-1, W))
        return Proposal(tokens, parents, draft_probs=draft_probs, **state.tree_inputs(parents, depth, layout),
                        layout=layout)

    def observe(self, state: DecodeState, plan: Plan, outcome: Outcome, step: int) -> None:
        s, B, W = state.s, state.B, plan.depth
        predicts = outcome.n_before[:, None] + torch.arange(W + 1, device=state.device)  # [B, W + 1]
        # [B, W + 1, V] node j: the row of old slot j
        probs = state.process(guided_logits(outcome.logits, B, s.guided, s.cfg_scale, predicts, s.cfg_interval))
        self.window.advance(outcome.result.accept_len, outcome.result.next_token, W, probs, state.n_done, step)

    def settle(self, figures: StepFigures) -> None:
        pass

    def keep_rows(self, place: torch.Tensor) -> None:
        raise RuntimeError("Jacobi windows keep every row (can_compact is False)")

    def close(self) -> None:
        pass


def new_state(target, drafter, cond_idx: torch.Tensor, neighbours, config: SpecConfig, sampling: Sampling, L: int,
              plans: Sequence[Plan], catch_up: bool, emb_masks: Optional[torch.Tensor] = None,
              compiled: Optional[CompiledRun] = None) -> DecodeState:
    """A prefilled ``DecodeState`` with the method's proposer."""
    proposer = JacobiProposer(config) if config.self_drafting else DrafterProposer(drafter, catch_up)
    return DecodeState(target, proposer, cond_idx, sampling, acceptance_rule(config, neighbours), L, plans,
                       emb_masks, compiled)


def acceptance_rule(config: SpecConfig, neighbours) -> Optional[AcceptanceRule]:
    """The relaxation of the drafts' verification (None: exact, unless ``config.relaxed(neighbours)``)."""
    if not config.relaxed(neighbours):
        return None
    return AcceptanceRule(neighbours, config.k, config.delta, config.lam, config.budget)
