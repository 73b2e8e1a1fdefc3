"""A Hugging Face ``Cache`` over lantern's KV layout, with a length per row.

HF's caches keep one length for the whole batch; lantern's loop accepts a different number of drafts in each
row, so a row's committed prefix ends where its own ``cache_len`` says. ``RowCache`` stores every layer's K/V in
one tensor [n_layer, 2, rows, Hkv, Lmax, Dh] (the layout ``ops.compact_kv`` compacts, the same as lantern's
GPT), and a forward writes node t of row b at cache_len[b] + t. What each query may see is the 4D mask the
adapter passes to the model (``tree_attention_mask``), which HF's attention functions take as given.
"""
from __future__ import annotations

from typing import Optional

import torch
from transformers.cache_utils import Cache

from .. import ops
from ..ops.reference.tree import unpack_bits

TREE_ATTENTION = "lantern_tree"  # the HF attention function name of ``tree_attention_function``


class RowCache(Cache):
    """K/V of ``n_layer`` layers in one tensor; ``begin(cache_len, n_keys)`` before each forward says where its
    nodes go (cache_len [R] int64) and how many positions the attention reads (n_keys, >= max(cache_len) + T)."""

    def __init__(self, n_layer: int, rows: int, kv_heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__(layers=[])
        self.n_layer = n_layer
        self.kv = torch.zeros(n_layer, 2, rows, kv_heads, max_len, head_dim, dtype=dtype, device=device)
        self.cache_len: Optional[torch.Tensor] = None
        self.n_keys = 0
        self._heads: Optional[torch.Tensor] = None
        self.T, self.uniform = 0, False

    @property
    def kv(self) -> torch.Tensor:
        return self._kv

    @kv.setter
    def kv(self, kv: torch.Tensor) -> None:
        self._kv = kv
        self._layers = [(kv[i, 0], kv[i, 1]) for i in range(kv.shape[0])]  # each layer's K and V, made once

    def __len__(self) -> int:
        return self.n_layer

    @property
    def max_len(self) -> int:
        return self.kv.shape[4]

    def begin(self, cache_len: torch.Tensor, T: int, n_keys: int, uniform: bool = False) -> None:
        """The next forward writes T nodes per row at cache_len [R] + t and attends to n_keys positions;
        uniform: every row's cache_len is n_keys - T (the nodes are written as one slice, no index built)."""
        self.T, self.uniform = T, uniform
        self.cache_len, self.n_keys = cache_len, n_keys
        if uniform:
            return
        R, dev = cache_len.shape[0], cache_len.device
        _, _, _, Hkv, Lmax, _ = self.kv.shape
        if self._heads is None or self._heads.shape[0] != R:
            heads = torch.arange(R, device=dev)[:, None] * Hkv + torch.arange(Hkv, device=dev)  # [R, Hkv]
            self._heads = heads[:, :, None] * Lmax  # [R, Hkv, 1] the first position of each (row, head)
        slots = cache_len[:, None] + torch.arange(T, device=dev)  # [R, T]
        self._flat = (self._heads + slots[:, None, :]).reshape(-1)  # [R Hkv T] into a layer's K

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states / value_states [R, Hkv, T, Dh] -> this layer's keys and values [R, Hkv, n_keys, Dh]
        (views of the cache) after writing them at cache_len + t."""
        R, Dh = key_states.shape[0], key_states.shape[-1]
        if torch.compiler.is_compiling():  # the graph's one input is the whole cache, not views made before
            keys, values = self.kv[layer_idx, 0], self.kv[layer_idx, 1]
        else:
            keys, values = self._layers[layer_idx]  # [rows, Hkv, Lmax, Dh], contiguous
        keys, values = (keys, values) if R == keys.shape[0] else (keys[:R], values[:R])
        if self.uniform:
            keys[:, :, self.n_keys - self.T: self.n_keys].copy_(key_states)
            values[:, :, self.n_keys - self.T: self.n_keys].copy_(value_states)
        else:
            keys.view(-1, Dh).index_copy_(0, self._flat, key_states.reshape(-1, Dh).to(keys.dtype))
            values.view(-1, Dh).index_copy_(0, self._flat, value_states.reshape(-1, Dh).to(values.dtype))
        return keys[:, :, : self.n_keys], values[:, :, : self.n_keys]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The keys before this forward's nodes: one number only when every row has the same length (the
        adapter then lets HF build the mask, see ``HFTarget._tree``)."""
        if not self.uniform:
            raise NotImplementedError("RowCache has a length per row; pass the 4D attention mask")
        return self.n_keys - self.T

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0):
        return self.get_seq_length() + query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False

    @property
    def is_sliding(self):
        return [False] * self.n_layer

    @property
    def is_linear(self):
        return [False] * self.n_layer


def tree_attention_mask(cache_len: torch.Tensor, tree_mask: Optional[torch.Tensor], T: int,
                        n_keys: int) -> torch.Tensor:
    """bool [R, 1, T, n_keys], True = attend: node i of row b sees the row's committed positions
    j < cache_len[b] and the positions cache_len[b] + a of its ancestors a (itself included) in the packed
    ancestor bits tree_mask [R, T, ceil(T/32)] (``ops.ancestor_mask``; None: a chain, causal)."""
    R = cache_len.shape[0]
    rel = torch.arange(n_keys, device=cache_len.device)[None, :] - cache_len[:, None]  # [R, n_keys] node index
    if tree_mask is None:  # a chain: node i sees nodes 0..i
        return (rel[:, None, :] <= torch.arange(T, device=rel.device)[None, :, None])[:, None]
    ancestors = unpack_bits(tree_mask, T)  # [R, T, T]
    in_tree = ancestors.gather(2, rel.clamp(0, T - 1)[:, None, :].expand(R, T, n_keys))  # [R, T, n_keys]
    mask = (rel < 0)[:, None, :] | (in_tree & (rel < T)[:, None, :])
    return mask[:, None]


def prompt_attention_mask(valid: torch.Tensor) -> torch.Tensor:
    """valid [R, W] bool (a prompt position holds a token) -> bool [R, 1, W, W]: causal over the valid positions,
    and each position sees itself (a padding query's row is never all masked; its output is not used)."""
    W = valid.shape[1]
    j = torch.arange(W, device=valid.device)
    causal = j[None, :] <= j[:, None]  # [W, W]
    mask = causal & valid[:, None, :] | torch.eye(W, dtype=torch.bool, device=valid.device)
    return mask[:, None]


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask as the additive float mask of HF's "eager" attention (0 = attend, the dtype's min = not)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


class TreeStep:
    """What ``tree_attention_function`` reads during one forward of the adapter (HF's attention call carries no
    per-row cache lengths): cache_len [R] int64 and the packed ancestor bits [R, T, ceil(T/32)]."""
    current = None


def tree_attention_function(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An HF attention function over ``ops.tree_attention`` (lantern's fused kernels when enabled): query
    [R, H, T, Dh], key / value the row cache's layer [R, Hkv, Lmax, Dh] -> ([R, T, H, Dh], None). The mask is
    the cache lengths and tree of ``TreeStep.current``; ``attention_mask`` is unused."""
    cache_len, tree_mask = TreeStep.current
    Dh = query.shape[-1]
    if scaling is not None and abs(scaling * Dh ** 0.5 - 1.0) > 1e-6:
        raise ValueError(f"lantern's tree attention scales by 1/sqrt(head_dim); this model scales by {scaling}")
    out = ops.tree_attention(query.contiguous(), key, value, cache_len, tree_mask)  # [R, H, T, Dh]
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(TREE_ATTENTION, tree_attention_function)


_register()
