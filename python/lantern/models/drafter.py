"""Drafters for speculative decoding, behind one small interface the decoding loop uses:

    reset(cond, rows, max_len, emb_masks)       allocate caches; condition prefill (GPT drafter; emb_masks
                                                [rows, C] t2i caption padding or None)
    commit(tokens [R, P], features [R, P, dim] | None, n_new [R], positions [R, P])
        -> (root_logits [R, V], root_state [R, S])   cache the newly committed tokens (ragged rows)
    expand(tokens [R, T], parents [R, T], parent_state [R, T, S], positions [R, T])
        -> (logits [R, T, V], state [R, T, S])   score a partial draft tree hanging off the root
    keep_rows(rows [R'])                        keep those cache rows only (optional: the loop drops finished
                                                rows from the models' batch when the drafter has it)

``parents`` index into the partial tree (-1 = the root, which is already cached); the loop re-runs the
whole partial tree at each depth, so the drafter's cache only ever holds committed tokens.

- ``EagleDrafter``: EAGLE's head. One (or more) transformer block over fc([token embedding ; target
  hidden state]); it predicts the target's next (post-norm) hidden state and scores it with the target's
  frozen output head. Committed positions use the target's true hidden states; tree nodes use the
  drafter's own prediction at their parent (``state``).
- ``GPTDrafter``: an independent small GPT of the same tokenizer (e.g. GPT-B drafting GPT-XL).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Tuple

import torch
import torch.nn as nn

from .gpt import CacheStep, GPTConfig, RMSNorm, Transformer, TransformerBlock, precompute_freqs_cis_2d


def _last_real(x: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
    """x [R, P, ...] -> x[r, n_new[r] - 1] [R, ...] (rows with n_new = 0 give position 0)."""
    idx = (n_new - 1).clamp(min=0)
    return x[torch.arange(x.shape[0], device=x.device), idx]


class EagleDrafter(nn.Module):
    """EAGLE head for a LlamaGen target: predicts post-norm target hidden states (what the target's
    ``forward(..., return_hidden=True)`` returns). Call ``bind(target)`` before decoding or training."""

    LAYOUTS = ("lantern", "eagle1")

    def __init__(self, target_config: GPTConfig, n_layer: int = 1, layout: str = "lantern"):
        """layout "lantern": every block normalises its input and a final RMSNorm precedes the head; "eagle1":
        EAGLE's original head (the LANTERN authors' drafters), no input norm in the first block (fc's output
        enters its attention as is) and no final norm."""
        super().__init__()
        if layout not in self.LAYOUTS:
            raise ValueError(f"layout must be one of {self.LAYOUTS}, got {layout!r}")
        cfg = replace(target_config, n_layer=n_layer)
        self.config, self.layout = cfg, layout
        self.fc = nn.Linear(2 * cfg.dim, cfg.dim, bias=True)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if layout == "eagle1":
            self.layers[0].attention_norm = nn.Identity()
            self.norm = nn.Identity()
        rope = precompute_freqs_cis_2d(cfg.grid_size, cfg.head_dim, cfg.rope_base, 0)  # [L, Dh/2, 2]
        self.register_buffer("freqs_cis", rope, persistent=False)
        self.register_buffer("kv_cache", None, persistent=False)
        self._target = None  # (embedding, output head) of the target, not parameters of the drafter
        self.cache_len = None

    def bind(self, target: Transformer) -> "EagleDrafter":
        self._target = (target.tok_embeddings, target.output)
        return self

    # -- the network --------------------------------------------------------------------------------

    def predict(self, tokens, features, positions, step: Optional[CacheStep] = None) -> torch.Tensor:
        """tokens [R, T], features [R, T, dim] (the target hidden state before each token), positions
        [R, T] raster indices -> predicted next hidden states [R, T, dim]."""
        embed, _ = self._target
        x = self.fc(torch.cat([embed(tokens).to(features.dtype), features], dim=-1))
        rope = self.freqs_cis[positions]  # [R, T, Dh/2, 2]
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if step is None else (self.kv_cache, i), step)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[1](hidden).float()

    def forward_train(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Whole images, causal: tokens [R, L], features [R, L, dim] = target hidden before each token
        (position 0: the last condition position) -> predicted hidden states [R, L, dim]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        return self.predict(tokens, features, positions)

    # -- the decoding interface ---------------------------------------------------------------------

    def reset(self, cond: torch.Tensor, rows: int, max_len: int, emb_masks: Optional[torch.Tensor] = None) -> None:
        """The head attends to image positions only (the condition reaches it through the target's hidden
        states), so neither cond nor the caption padding emb_masks enters its cache."""
        cfg = self.config
        weight = self.fc.weight
        self.kv_cache = torch.zeros(cfg.n_layer, 2, rows, cfg.kv_heads, max_len, cfg.head_dim,
                                    dtype=weight.dtype, device=weight.device)
        self.cache_len = torch.zeros(rows, dtype=torch.int64, device=weight.device)

    def commit(self, tokens, features, n_new, positions) -> Tuple[torch.Tensor, torch.Tensor]:
        step = _chain_step(self.cache_len, tokens.shape[1])
        hidden = self.predict(tokens, features, positions, step)  # [R, P, dim]
        self.cache_len = self.cache_len + n_new
        root = _last_real(hidden, n_new)  # [R, dim]
        return self.logits(root), root

    def expand(self, tokens, parents, parent_state, positions) -> Tuple[torch.Tensor, torch.Tensor]:
        step = _tree_step(self.cache_len, parents)
        hidden = self.predict(tokens, parent_state, positions, step)  # [R, T, dim]
        return self.logits(hidden), hidden

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keeps the cache rows ``rows`` [R'] and drops the others (finished rows leave the batch)."""
        self.kv_cache = self.kv_cache.index_select(2, rows)
        self.cache_len = self.cache_len.index_select(0, rows)

    def release(self) -> None:
        self.kv_cache = None


class GPTDrafter:
    """An independent small GPT as the drafter (same tokenizer and condition as the target)."""

    def __init__(self, model: Transformer):
        self.model = model
        self.cache_len = None

    def reset(self, cond: torch.Tensor, rows: int, max_len: int, emb_masks: Optional[torch.Tensor] = None) -> None:
        """Caches the condition [rows, ...]; emb_masks [rows, C] (t2i caption padding) or None."""
        m = self.model
        m.setup_cache(rows, m.config.cond_len + max_len)
        zero = torch.zeros(rows, dtype=torch.int64, device=cond.device)
        m(None, cond, cache_len=zero, emb_masks=emb_masks)  # caches the condition (its real positions)
        self.cache_len = m.cond_keys[:rows].clone()

    def commit(self, tokens, features, n_new, positions):
        logits = self.model(tokens, cache_len=self.cache_len, positions=positions)  # [R, P, V]
        self.cache_len = self.cache_len + n_new
        return _last_real(logits, n_new), torch.zeros(tokens.shape[0], 0, device=tokens.device)

    def expand(self, tokens, parents, parent_state, positions):
        mask = partial_tree_mask(parents)
        logits = self.model(tokens, cache_len=self.cache_len, positions=positions, tree_mask=mask)
        return logits, torch.zeros(*tokens.shape, 0, device=tokens.device)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keeps the cache rows ``rows`` [R'] and drops the others (finished rows leave the batch)."""
        self.model.keep_cache_rows(rows)
        self.cache_len = self.cache_len.index_select(0, rows)

    def release(self) -> None:
        self.model.free_cache()


def _chain_step(cache_len: torch.Tensor, T: int) -> CacheStep:
    from ..ops.reference.tree import pack_bits

    R, device = cache_len.shape[0], cache_len.device
    causal = pack_bits(torch.ones(T, T, dtype=torch.bool, device=device).tril()).expand(R, -1, -1)
    return CacheStep(rows=torch.arange(R, device=device)[:, None].expand(R, T),
                     slots=cache_len[:, None] + torch.arange(T, device=device), cache_len=cache_len,
                     tree_mask=causal)


def partial_tree_mask(parents: torch.Tensor) -> torch.Tensor:
    """parents [R, T] within a partial tree (-1 = the cached root, outside the block) -> packed ancestor
    bits [R, T, ceil(T/32)] over the T nodes (each node sees itself and its in-block ancestors)."""
    from ..ops.reference.tree import pack_bits

    R, T = parents.shape
    # reach[r, i, j]: j is i or an ancestor of i. Transitive closure of the parent relation by repeated
    # squaring (log2 T boolean matrix products), so no Python loop runs over nodes.
    node_ids = torch.arange(T, device=parents.device)
    step = (parents[..., None] == node_ids).to(torch.float32)  # [R, T, T]; parent -1 matches no node
    reach = torch.eye(T, device=parents.device).expand(R, T, T) + step
    for _ in range(max(1, (T - 1).bit_length())):
        reach = (reach @ reach > 0).to(torch.float32)
    bits = reach > 0
    return pack_bits(bits)


def _tree_step(cache_len: torch.Tensor, parents: torch.Tensor) -> CacheStep:
    R, T = parents.shape
    device = parents.device
    return CacheStep(rows=torch.arange(R, device=device)[:, None].expand(R, T),
                     slots=cache_len[:, None] + torch.arange(T, device=device), cache_len=cache_len,
                     tree_mask=partial_tree_mask(parents))
