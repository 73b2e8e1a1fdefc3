"""Jacobi self-drafting (method "sjd": SJD, Teng et al., ICLR 2025) and its coupled drafts (``coupling``: the
Gumbel-sharing variant of SCD, So et al., ICML 2026): the drafts of the speculative loop without a drafter.

Each row keeps a window of ``slots`` drafts for the positions right after its committed tokens, each with the
probability row q it was drawn from (``JacobiWindow``). A step feeds the root and the first W drafts to the
target as a chain, verifies them with ``ops.verify`` (sampled drafts, draft_probs = the stored q rows), and
builds the next window from that forward's own predictions (``JacobiWindow.advance``): the slot a position
takes over is drawn from the target's distribution at that position in this forward; past the forward's
reach a slot keeps an earlier forward's draw for its position, if it has one, or is filled fresh
(``FRESH_INITS``). The rules and the proof that δ = 0 stays exact: docs/sjd.md.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from .trees import sample_without_replacement

FRESH_INITS = ("repeat", "sample")
COUPLED_OFFSET = 0  # coupled drafts: every draw of one absolute position uses this Philox offset (verify steps >= 1)


class JacobiWindow:
    """Per row b: tokens[b, i] the draft of image position n_done[b] + i (i < slots), q[b, i] the row it was
    drawn from (one-hot for a copied token), jacobi[b, i] whether that row was a forward's prediction of this
    very position (else the slot is fresh; the Jacobi slots are a prefix of the window). Draws use the
    drafter's Philox stream (``sample_without_replacement``) keyed by the absolute position: at offset = the
    step (independent draws), or at ``COUPLED_OFFSET`` for every step (``coupled``: a position keeps its
    uniforms, so a draw from a nearly unchanged row repeats its token)."""

    def __init__(self, root: torch.Tensor, root_probs: torch.Tensor, slots: int, init: str, coupled: bool,
                 seed: int, rows: Optional[torch.Tensor] = None):
        """root [B]: the first image token (n_done = 1); root_probs [B, V]: the row it was sampled from (fresh
        slots of init "sample" draw from it); rows [B]: the rows' Philox keys (default b)."""
        if init not in FRESH_INITS:
            raise ValueError(f"init must be one of {FRESH_INITS}, got {init!r}")
        self.slots, self.init, self.coupled, self.seed, self.rows = slots, init, coupled, seed, rows
        B, V = root_probs.shape
        dev = self.device = root.device
        self.tokens = torch.zeros(B, slots, dtype=torch.int64, device=dev)
        self.q = torch.zeros(B, slots, V, dtype=torch.float32, device=dev)
        self.jacobi = torch.zeros(B, slots, dtype=torch.bool, device=dev)
        rows = root_probs.float()[:, None].expand(B, slots, V)
        self._fill(~self.jacobi, rows, root, torch.ones(B, dtype=torch.int64, device=dev), 0)

    def chain(self, root: torch.Tensor, W: int):
        """root [B] -> (tokens [B, W + 1]: the root, then the first W drafts; draft_probs [B, W + 1, V]: node j's
        row is the q its child (draft j + 1) was drawn from, the last node's is zero; None for W = 0)."""
        tokens = torch.cat([root[:, None], self.tokens[:, :W]], 1)
        if W == 0:
            return tokens, None
        return tokens, torch.cat([self.q[:, :W], torch.zeros_like(self.q[:, :1])], 1)

    def advance(self, accept_len: torch.Tensor, next_token: torch.Tensor, W: int, probs: torch.Tensor,
                n_done: torch.Tensor, step: int) -> None:
        """After a step that fed W drafts: accept_len [B] drafts accepted, next_token [B] the committed token
        after them (the new root), probs [B, W + 1, V] the target's sampling rows at the forward's nodes (node j
        predicts old slot j), n_done [B] committed tokens after the step. New slot i takes over old slot
        s = accept_len + 1 + i: drawn from node s's row when s <= W (the Jacobi update); past the forward
        (W < s < slots) the old draft if it was a Jacobi draw; else fresh."""
        B, S, V = self.q.shape
        old = accept_len[:, None] + 1 + torch.arange(S, device=self.device)  # [B, S]
        jacobi = old <= W
        old_idx = old.clamp(max=S - 1)
        kept = (old > W) & (old < S) & self.jacobi.gather(1, old_idx)
        rows = probs.float().gather(1, old.clamp(max=W)[..., None].expand(B, S, V))  # [B, S, V]
        tokens = self.tokens.gather(1, old_idx)
        q = self.q.gather(1, old_idx[..., None].expand(B, S, V))
        self.tokens = torch.where(kept, tokens, self.tokens)
        self.q = torch.where(kept[..., None], q, self.q)
        self._fill(~kept, rows, next_token, n_done, step, jacobi)
        self.jacobi = jacobi | kept

    def _fill(self, new: torch.Tensor, rows: torch.Tensor, root: torch.Tensor, n_done: torch.Tensor, step: int,
              jacobi: torch.Tensor = None) -> None:
        """Sets the slots ``new`` [B, S]: the Jacobi slots (``jacobi``, default none) draw from ``rows`` [B, S, V],
        the others are fresh: init "sample" draws from ``rows`` too (the caller's last row), "repeat" copies the
        token left of the first fresh slot (the root [B] when it is slot 0) with a one-hot q."""
        B, S, V = rows.shape
        jacobi = torch.zeros_like(new) if jacobi is None else jacobi
        fresh = new & ~jacobi
        drawn_slots = jacobi | fresh if self.init == "sample" else jacobi
        offset = COUPLED_OFFSET if self.coupled else step
        keys = n_done[:, None] + torch.arange(S, device=self.device)
        drawn = sample_without_replacement(rows, 1, self.seed, keys, offset, self.rows)[..., 0]
        tokens = torch.where(drawn_slots, drawn, self.tokens)
        q = torch.where(drawn_slots[..., None], rows, self.q)
        if self.init == "repeat":
            first_fresh = (~fresh).sum(1, keepdim=True)  # fresh slots are a suffix of the window
            copy = torch.cat([root[:, None], tokens], 1).gather(1, first_fresh)  # [B, 1]
            tokens = torch.where(fresh, copy, tokens)
            q = torch.where(fresh[..., None], F.one_hot(copy, V).to(q.dtype), q)
        self.tokens, self.q = tokens, q
