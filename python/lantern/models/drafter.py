"""Drafters for speculative decoding, behind one small interface the decoding loop uses:

    reset(cond, rows, max_len, emb_masks)       allocate caches; condition prefill (GPT drafter; emb_masks
                                                [rows, C] t2i caption padding or None)
    commit(tokens [R, P], features [R, P, dim] | None, n_new [R], positions [R, P])
        -> (root_logits [R, V], root_state [R, S])   cache the newly committed tokens (ragged rows)
    expand(tokens [R, T], parents [R, T], parent_state [R, T, S], positions [R, T], tree_mask=None)
        -> (logits [R, T, V], state [R, T, S])   score a partial draft tree hanging off the root
                                                (tree_mask: ``partial_tree_mask(parents)`` when the caller
                                                has it; only for drafters with ``accepts_tree_mask``)
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

from .gpt import (
    CacheStep,
    GPTConfig,
    RMSNorm,
    Transformer,
    TransformerBlock,
    precompute_freqs_cis_2d,
    select_cache_rows,
)


def _last_real(x: torch.Tensor, n_new: torch.Tensor) -> torch.Tensor:
    """x [R, P, ...] -> x[r, n_new[r] - 1] [R, ...] (rows with n_new = 0 give position 0)."""
    idx = (n_new - 1).clamp(min=0)
    return x[torch.arange(x.shape[0], device=x.device), idx]


class EagleDrafter(nn.Module):
    """EAGLE head for a LlamaGen target: predicts post-norm target hidden states (what the target's
    ``forward(..., return_hidden=True)`` returns). Call ``bind(target)`` before decoding or training."""

    LAYOUTS = ("lantern", "eagle1")

    def __init__(self, target_config: GPTConfig, n_layer: int = 1, layout: str = "lantern",
                 attend_condition: bool = False):
        """layout "lantern": every block normalises its input and a final RMSNorm precedes the head; "eagle1":
        EAGLE's original head (the LANTERN authors' drafters), no input norm in the first block (fc's output
        enters its attention as is) and no final norm.

        attend_condition: the drafter's sequence starts with the condition, as the LANTERN authors' LlamaGen
        T2I drafters see it (their ``ea_model_llamagen.initialize_tree`` and ``cnets_llamagen.Model``): a
        prefix of C - 1 positions (C = the target's cond_len: 119 of the 120 caption positions), position p
        holding fc([E[0]; h_p]), E[0] the target's embedding of code 0 (their input id 0) and h_p the
        target's post-norm hidden state at condition position p; the last condition position's hidden state
        pairs with image token 0 as without the option. The prefix has LlamaGen's zero rotary rows (so its
        queries and keys are zero in every layer: every query gives each prefix key the logit 0) and no
        padding mask (padded caption positions are seen too, as their inference passes no mask); it is
        causal among itself, and every image position sees all of it. Off: the condition reaches the
        drafter only through the hidden states paired with the image tokens."""
        super().__init__()
        if layout not in self.LAYOUTS:
            raise ValueError(f"layout must be one of {self.LAYOUTS}, got {layout!r}")
        cfg = replace(target_config, n_layer=n_layer)
        self.config, self.layout, self.attend_condition = cfg, layout, bool(attend_condition)
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
        self._condition_source = ()  # attend_condition: (the bound target,), whose condition_hidden it reads
        self.cache_len = None

    def bind(self, target: Transformer) -> "EagleDrafter":
        self._target = (target.tok_embeddings, target.output)
        if self.attend_condition:
            if not hasattr(target, "keep_condition_hidden"):
                raise ValueError(f"attend_condition needs a target that keeps its condition's hidden states "
                                 f"(lantern's GPT), got {type(target).__name__}")
            target.keep_condition_hidden = True
            self._condition_source = (target,)  # a tuple: the target is not a submodule of the drafter
        return self

    @property
    def prefix_len(self) -> int:
        """Cache positions the condition takes in the drafter (C - 1 with attend_condition, else 0)."""
        return max(self.config.cond_len - 1, 0) if self.attend_condition else 0

    # -- the network --------------------------------------------------------------------------------

    def predict(self, tokens, features, positions, step: Optional[CacheStep] = None) -> torch.Tensor:
        """tokens [R, T], features [R, T, dim] (the target hidden state before each token), positions
        [R, T] raster indices -> predicted next hidden states [R, T, dim]."""
        x = self._fc(tokens, features)
        rope = self.freqs_cis[positions]  # [R, T, Dh/2, 2]
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, None if step is None else (self.kv_cache, i), step)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._target[1](hidden).float()

    def forward_train(self, tokens: torch.Tensor, features: torch.Tensor,
                      condition_hidden: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Whole images, causal: tokens [R, L], features [R, L, dim] = target hidden before each token
        (position 0: the last condition position) -> predicted hidden states [R, L, dim]. With
        attend_condition, condition_hidden [R, C, dim] (the target's hidden states over the condition) is the
        prefix the image positions see."""
        positions = torch.arange(tokens.shape[1], device=tokens.device).expand_as(tokens)
        if not self.attend_condition:
            return self.predict(tokens, features, positions)
        x_prefix = self._prefix_input(self._checked_condition(condition_hidden, tokens.shape[0]))  # [R, C-1, dim]
        x = torch.cat([x_prefix, self._fc(tokens, features)], 1)
        rope = torch.cat([self._prefix_rope(x_prefix), self.freqs_cis[positions]], 1)
        for layer in self.layers:
            x = layer(x, rope)
        return self.norm(x[:, x_prefix.shape[1]:])

    def _fc(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        embed, _ = self._target
        return self.fc(torch.cat([embed(tokens).to(features.dtype), features], dim=-1))

    def _checked_condition(self, hidden: Optional[torch.Tensor], rows: int) -> torch.Tensor:
        C, D = self.config.cond_len, self.config.dim
        if hidden is None or hidden.dim() != 3 or hidden.shape[0] < rows or tuple(hidden.shape[1:]) != (C, D):
            raise ValueError(f"attend_condition needs the target's hidden states over its condition [{rows}, {C}, "
                             f"{D}] (a prefill of the bound target), got "
                             f"{None if hidden is None else list(hidden.shape)}")
        return hidden[:rows]

    def _prefix_input(self, condition_hidden: torch.Tensor) -> torch.Tensor:
        """[R, C, dim] -> fc([E[0]; h_p]) for p < C - 1: [R, C - 1, dim]."""
        R, n = condition_hidden.shape[0], self.prefix_len
        code_0 = torch.zeros(R, n, dtype=torch.int64, device=condition_hidden.device)
        return self._fc(code_0, condition_hidden[:, :n].to(self.fc.weight.dtype))

    def _prefix_rope(self, x_prefix: torch.Tensor) -> torch.Tensor:
        """LlamaGen's rotary rows of condition positions: zeros [R, C - 1, Dh/2, 2]."""
        R, n = x_prefix.shape[:2]
        return self.freqs_cis.new_zeros(R, n, *self.freqs_cis.shape[1:])

    # -- the decoding interface ---------------------------------------------------------------------

    def reset(self, cond: torch.Tensor, rows: int, max_len: int, emb_masks: Optional[torch.Tensor] = None) -> None:
        """Without attend_condition the head attends to image positions only (the condition reaches it through
        the target's hidden states), so neither cond nor the caption padding emb_masks enters its cache. With
        it, the cache starts with the condition prefix (``__init__``), built from the hidden states the bound
        target kept at its prefill (``Transformer.condition_hidden``); emb_masks is not applied (their
        drafters see every caption position)."""
        cfg = self.config
        weight = self.fc.weight
        n = self.prefix_len
        self.kv_cache = torch.zeros(cfg.n_layer, 2, rows, cfg.kv_heads, n + max_len, cfg.head_dim,
                                    dtype=weight.dtype, device=weight.device)
        self.cache_len = torch.zeros(rows, dtype=torch.int64, device=weight.device)
        if n == 0:
            return
        source = self._condition_source[0] if self._condition_source else None
        hidden = self._checked_condition(getattr(source, "condition_hidden", None), rows)
        x = self._prefix_input(hidden)  # [rows, n, dim]
        rope = self._prefix_rope(x)
        step = _chain_step(self.cache_len, n)
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, (self.kv_cache, i), step)
        self.cache_len = self.cache_len + n

    def commit(self, tokens, features, n_new, positions) -> Tuple[torch.Tensor, torch.Tensor]:
        step = _chain_step(self.cache_len, tokens.shape[1])
        hidden = self.predict(tokens, features, positions, step)  # [R, P, dim]
        self.cache_len = self.cache_len + n_new
        root = _last_real(hidden, n_new)  # [R, dim]
        return self.logits(root), root

    accepts_tree_mask = True  # expand takes the partial tree's mask when the caller made it already

    def expand(self, tokens, parents, parent_state, positions, tree_mask=None) -> Tuple[torch.Tensor, torch.Tensor]:
        step = _tree_step(self.cache_len, parents, tree_mask)
        hidden = self.predict(tokens, parent_state, positions, step)  # [R, T, dim]
        return self.logits(hidden), hidden

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keeps the cache rows ``rows`` [R'] and drops the others (finished rows leave the batch)."""
        self.kv_cache = select_cache_rows(self.kv_cache, rows)
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

    accepts_tree_mask = True

    def expand(self, tokens, parents, parent_state, positions, tree_mask=None):
        mask = partial_tree_mask(parents) if tree_mask is None else tree_mask
        logits = self.model(tokens, cache_len=self.cache_len, positions=positions, tree_mask=mask)
        return logits, torch.zeros(*tokens.shape, 0, device=tokens.device)

    def keep_rows(self, rows: torch.Tensor) -> None:
        """Keeps the cache rows ``rows`` [R'] and drops the others (finished rows leave the batch)."""
        self.model.keep_cache_rows(rows)
        self.cache_len = self.cache_len.index_select(0, rows)

    def release(self) -> None:
        self.model.free_cache()


_STEP_LAYOUTS: dict = {}  # (R, T, device) -> (node ids [T], causal mask [R, T, W]), eager calls only


def _step_layout(R: int, T: int, device: torch.device):
    """(node ids 0..T-1 [T], packed causal mask [R, T, ceil(T/32)]) of a forward of T nodes over R rows: made
    once per shape in eager code (a decoding step makes several), traced where it is compiled."""
    from ..ops.reference.tree import pack_bits

    key = (R, T, device)
    layout = None if torch.compiler.is_compiling() else _STEP_LAYOUTS.get(key)
    if layout is None:
        layout = (torch.arange(T, device=device),
                  pack_bits(torch.ones(T, T, dtype=torch.bool, device=device).tril()).expand(R, -1, -1))
        if not torch.compiler.is_compiling():
            _STEP_LAYOUTS[key] = layout
    return layout


def _chain_step(cache_len: torch.Tensor, T: int) -> CacheStep:
    nodes, causal = _step_layout(cache_len.shape[0], T, cache_len.device)
    return CacheStep(slots=cache_len[:, None] + nodes, cache_len=cache_len, tree_mask=causal)


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


def _tree_step(cache_len: torch.Tensor, parents: torch.Tensor, tree_mask: Optional[torch.Tensor] = None) -> CacheStep:
    """tree_mask: ``partial_tree_mask(parents)`` if the caller has it."""
    R, T = parents.shape
    nodes, _ = _step_layout(R, T, parents.device)
    return CacheStep(slots=cache_len[:, None] + nodes, cache_len=cache_len,
                     tree_mask=partial_tree_mask(parents) if tree_mask is None else tree_mask)
