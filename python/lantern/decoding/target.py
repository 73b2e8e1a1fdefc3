"""What lantern's decoding loops need from a target model: the ``Target`` protocol.

``ar.py`` (``generate_ar``), ``state.py`` (``DecodeState``: the prefill and every step's forward, whatever the
proposer), ``proposers.py`` / ``trees.py`` / ``jacobi.py`` (which only see the logits) and ``compiled.py``
(``CompiledTarget``) use a target through the members below and nothing else (docs/target.md). lantern's GPT
(``models.gpt.Transformer``) has them;
``lantern.hf.wrap`` gives a Hugging Face model them. The protocol is structural (``typing.Protocol``): a target
does not inherit from it.

The sequence a target decodes is [condition] + image tokens in raster order. The loop owns the per-row
bookkeeping (which tokens are committed, the cache length of every row) and hands the target, per forward,
the tokens, the cache length of each row and the tree layout; the target owns its KV cache, whose layout the
loop relies on in one place: ``ops.compact_kv(target.kv_cache, ...)`` moves the accepted tree nodes' K/V down
after a verify step. So the cache is one contiguous tensor [n_layer, 2, rows, Hkv, Lmax, Dh] (K and V of
every layer), and a forward's node t of row b writes its K/V at cache position cache_len[b] + t.
"""
from __future__ import annotations

from typing import Optional, Protocol, Tuple, Union, runtime_checkable

import torch


class TargetConfig(Protocol):
    """The sizes the loops read from ``target.config``."""

    block_size: int  # L: image tokens of a whole image (``length`` may stop earlier)
    vocab_size: int  # V: the ids the logits cover (drafts, verify, the neighbour table's rows)
    cond_len: int  # cache positions the condition takes at most (the cache is sized C + L + the largest tree)
    model_type: str  # "c2i": the condition is class ids [B] in [0, num_classes), checked; "t2i": any tensor [B, ...]
    num_classes: int  # c2i only


@runtime_checkable
class Target(Protocol):
    """A model lantern can decode. Shapes: R rows (the batch, doubled [cond; uncond] with guidance), T nodes.

    - ``config``: ``TargetConfig``.
    - ``tok_embeddings.weight.device``: the device the loops allocate on (and ``.dtype`` nothing else reads).
    - ``setup_cache(batch, max_len)``: allocates ``kv_cache`` [n_layer, 2, batch, Hkv, max_len, Dh] (contiguous,
      zeroed or not: no position is read before it is written) and ``cond_keys`` [batch] int64.
    - ``kv_cache``: that tensor; the loop compacts it in place with ``ops.compact_kv`` after each verify step.
    - ``cond_keys``: after the prefill, the cache positions each row's condition took (C, or fewer where
      condition positions were dropped as padding); image token t of a row with nothing uncommitted sits at
      cache position cond_keys[b] + t.
    - ``keep_cache_rows(rows)``: keeps the cache rows ``rows`` [R'] int64 in that order (finished rows leave the
      batch; only with a drafter that has ``keep_rows``).
    - ``free_cache()``: releases the cache.
    - ``double_for_cfg(cond)``: [B, ...] -> [2B, ...] the rows [cond; uncond] of classifier-free guidance (the
      loop combines the halves' logits itself: uncond + s (cond - uncond), ``ops.verify``'s §1).
    - ``__call__(tokens, cond_idx=None, *, cache_len, positions=None, tree_mask=None, return_hidden=False,
      emb_masks=None)``:
      * prefill (``cond_idx`` given, ``tokens`` None, ``cache_len`` zeros): writes the condition's K/V from
        position 0, sets ``cond_keys``, returns logits [R, 1, V] whose last row predicts image token 0;
      * a tree or chain (``cond_idx`` None): tokens [R, T] int64 in [0, V); cache_len [R] int64 the committed
        positions of each row (they may differ per row); positions [R, T] the raster index of each node (None:
        a chain after the committed tokens, cache_len - cond_keys + t); tree_mask [R, T, ceil(T/32)] int32 packed
        ancestor bits (``ops.ancestor_mask``; None: causal). Node t attends to the row's cache_len[b] committed
        positions and to its ancestors in the tree (itself included), and writes its K/V at cache_len[b] + t.
      Returns logits [R, T_out, V] float32 (with ``return_hidden`` also the hidden states [R, T_out, D] an EAGLE
      drafter reads). ``emb_masks`` is LlamaGen's t2i caption padding (``config.model_type == "t2i"``).
    """

    config: TargetConfig
    kv_cache: Optional[torch.Tensor]
    cond_keys: Optional[torch.Tensor]

    @property
    def tok_embeddings(self) -> torch.nn.Module: ...

    def setup_cache(self, batch: int, max_len: int) -> torch.Tensor: ...

    def keep_cache_rows(self, rows: torch.Tensor) -> None: ...

    def free_cache(self) -> None: ...

    def double_for_cfg(self, cond_idx: torch.Tensor) -> torch.Tensor: ...

    def __call__(self, tokens: Optional[torch.Tensor] = None, cond_idx: Optional[torch.Tensor] = None, *,
                 cache_len: torch.Tensor, positions: Optional[torch.Tensor] = None,
                 tree_mask: Optional[torch.Tensor] = None, return_hidden: bool = False,
                 emb_masks: Optional[torch.Tensor] = None
                 ) -> Union[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]: ...
