"""The LlamaGen GPT (class- and text-conditional), gpt-fast style, with a static KV cache and one forward
that serves prefill, AR decoding and tree verification. State-dict names, shapes and numerics match the
official LlamaGen checkpoints (tests/models/test_gpt_state_dict.py).

Sequence layout: [C condition tokens] + image tokens in raster order (C = 1 for c2i, 120 for t2i).
Cache position of image token t (raster index t) is C + t once the prefix before it is committed.

t2i caption padding (``emb_masks`` [B, C], 1 = a real caption position), LlamaGen's rule: no query
attends to a padded caption position except that position itself. The cached forward writes the
condition's K/V, then drops the padded positions' K/V from the row's cache (ops.compact_kv), so later
forwards see only the real caption keys through ``ops.tree_attention`` unchanged; row b's committed
prefix then holds ``cond_keys[b]`` = the real caption positions instead of C, and image token t sits at
cache position cond_keys[b] + t. Exact because a key's cache position carries no meaning: RoPE is
applied before caching, and condition keys are zero anyway. docs/semantics.md "t2i caption padding".
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ops
from ..ops.reference.tree import pack_bits, unpack_bits


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int
    n_head: int
    dim: int
    n_kv_head: Optional[int] = None  # None = n_head (LlamaGen); fewer = GQA
    vocab_size: int = 16384
    num_classes: int = 1000  # c2i: the class table has num_classes + 1 rows (last = null class for CFG)
    caption_dim: int = 2048  # t2i: caption feature width (FLAN-T5-XL)
    caption_len: int = 120  # t2i: condition tokens
    class_dropout_prob: float = 0.1  # training: condition dropped to the null class / uncond caption
    block_size: int = 256  # image tokens, a square grid (256 = 16x16)
    multiple_of: int = 256  # SwiGLU hidden rounded up to this
    ffn_dim_multiplier: Optional[float] = None
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    initializer_range: float = 0.02
    model_type: str = "c2i"  # "c2i" | "t2i"

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_head

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def cond_len(self) -> int:
        return 1 if self.model_type == "c2i" else self.caption_len

    @property
    def grid_size(self) -> int:
        return math.isqrt(self.block_size)

    @property
    def ffn_hidden(self) -> int:
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return -(-hidden // self.multiple_of) * self.multiple_of


GPT_CONFIGS: Dict[str, GPTConfig] = {
    "GPT-B": GPTConfig(n_layer=12, n_head=12, dim=768),
    "GPT-L": GPTConfig(n_layer=24, n_head=16, dim=1024),
    "GPT-XL": GPTConfig(n_layer=36, n_head=20, dim=1280),
    "GPT-XXL": GPTConfig(n_layer=48, n_head=24, dim=1536),
    "GPT-3B": GPTConfig(n_layer=24, n_head=32, dim=3200),
    # The project's own small default model: 8x8 = 64 image tokens of a 1024-code VQ-tiny, 10 classes.
    "GPT-tiny": GPTConfig(n_layer=4, n_head=4, dim=256, vocab_size=1024, num_classes=10, block_size=64),
    # The shipped default: GPT-tiny grown to 16 layers (docs/tiny_model.md), so that a one-layer EAGLE drafter
    # costs about a tenth of a target forward, as in LlamaGen's regime.
    "GPT-tiny-deep": GPTConfig(n_layer=16, n_head=4, dim=256, vocab_size=1024, num_classes=10, block_size=64),
}


def check_emb_masks(emb_masks, rows: int, cond_len: int, device) -> torch.Tensor:
    """emb_masks [rows, cond_len] bool or integer 0/1 (1 = a real caption position, LlamaGen's T5
    attention mask) -> bool [rows, cond_len] on ``device``; a clear error otherwise (one host sync)."""
    if not isinstance(emb_masks, torch.Tensor):
        raise TypeError(f"emb_masks must be a tensor [B, {cond_len}], got {type(emb_masks).__name__}")
    if emb_masks.dtype != torch.bool and (emb_masks.dtype.is_floating_point or emb_masks.dtype.is_complex):
        raise TypeError(f"emb_masks must be bool or an integer dtype (1 = a real caption position), "
                        f"got {emb_masks.dtype}")
    if tuple(emb_masks.shape) != (rows, cond_len):
        raise ValueError(f"emb_masks must have shape [{rows}, {cond_len}] (rows x caption positions), "
                         f"got {list(emb_masks.shape)}")
    if emb_masks.device != torch.device(device):
        raise ValueError(f"emb_masks must be on {device} (the condition's device), got {emb_masks.device}")
    if emb_masks.dtype == torch.bool:
        return emb_masks
    if bool(((emb_masks != 0) & (emb_masks != 1)).any()):
        raise ValueError("emb_masks values must be 0 (padding) or 1 (a real caption position)")
    return emb_masks != 0


# ---------------------------------------------------------------------------------------------------
# 2D RoPE


def precompute_freqs_cis_2d(grid_size: int, head_dim: int, base: float, cond_len: int) -> torch.Tensor:
    """-> float32 [cond_len + grid_size**2, head_dim // 2, 2] (cos, sin), LlamaGen's table.

    Row cond_len + t is image token t (row r = t // grid, col c = t % grid): the first head_dim/4 pairs
    rotate by r * f_k, the last head_dim/4 by c * f_k, f_k = base^(-k / (head_dim/4)). The cond_len
    condition rows are all zero (cos = sin = 0), so condition q and k are zero: a LlamaGen quirk kept."""
    half_dim = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half_dim, 2)[: half_dim // 2].float() / half_dim))  # [Dh/4]
    t = torch.arange(grid_size, device=freqs.device)
    freqs = torch.outer(t, freqs)  # [grid, Dh/4]
    freqs_grid = torch.cat([
        freqs[:, None, :].expand(-1, grid_size, -1),  # row angles
        freqs[None, :, :].expand(grid_size, -1, -1),  # col angles
    ], dim=-1)  # [grid, grid, Dh/2]
    cache = torch.stack([torch.cos(freqs_grid), torch.sin(freqs_grid)], dim=-1).flatten(0, 1)  # [grid^2, Dh/2, 2]
    return torch.cat([torch.zeros(cond_len, half_dim, 2, device=cache.device), cache])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, Dh], rope [B, T, Dh/2, 2] -> [B, T, H, Dh]: interleaved pairs (x[2j], x[2j+1]) rotated,
    in float32, cast back to x's dtype."""
    pairs = x.float().unflatten(-1, (-1, 2))  # [B, T, H, Dh/2, 2]
    cos, sin = rope[:, :, None, :, 0], rope[:, :, None, :, 1]  # [B, T, 1, Dh/2]
    out = torch.stack([
        pairs[..., 0] * cos - pairs[..., 1] * sin,
        pairs[..., 1] * cos + pairs[..., 0] * sin,
    ], dim=-1)
    return out.flatten(3).type_as(x)


# ---------------------------------------------------------------------------------------------------
# Blocks


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        normed = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


class FeedForward(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def select_cache_rows(cache: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """cache [n_layer, 2, R, ...] -> a new cache [n_layer, 2, R', ...] of the rows ``rows`` [R'] (int64, in
    the order given). Indexed with the layer dimensions flattened, each row's slab of a layer is copied whole;
    ``index_select`` along dimension 2 gathers element by element (8.1 against 4.2 ms for a 33 MB bfloat16
    cache on 2 cores)."""
    n_layer, kv, R = cache.shape[:3]
    return cache.reshape(n_layer * kv, R, -1)[:, rows].reshape(n_layer, kv, rows.shape[0], *cache.shape[3:])


@dataclass
class CacheStep:
    """Where one cached forward writes and what it attends to (shared by every layer)."""
    slots: torch.Tensor  # [B, T] int64 cache position of each new position (cache_len[b] + t)
    cache_len: torch.Tensor  # [B] int64 committed prefix per row
    tree_mask: torch.Tensor  # [B, T, ceil(T/32)] int32 packed ancestor bits among the T new positions

    def write_kv(self, cache: torch.Tensor, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, T, Hkv, Dh] into the whole cache [n_layer, 2, rows, Hkv, Lmax, Dh] at (layer, row, slot):
        one index_put_ on the cache tensor itself, not on a layer's view, so that a compiled forward
        writes the new positions only (functionalisation turns an indexed write into a view into a copy of
        the whole cache)."""
        B, Hkv = k.shape[0], k.shape[2]
        dev = cache.device
        # index tensors that broadcast (none expanded): an exported forward then serves T = 1 too
        index = (torch.full((1, 1, 1, 1), layer, dtype=torch.int64, device=dev),
                 torch.arange(2, device=dev).view(2, 1, 1, 1),  # k, v
                 torch.arange(B, device=dev).view(1, B, 1, 1), torch.arange(Hkv, device=dev).view(1, 1, 1, Hkv),
                 self.slots[None, :, :, None])
        cache.index_put_(index, torch.stack([k, v]).to(cache.dtype))  # [2, B, T, Hkv, Dh]


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.wqkv = nn.Linear(cfg.dim, (cfg.n_head + 2 * cfg.kv_heads) * cfg.head_dim, bias=False)  # rows q | k | v
        self.wo = nn.Linear(cfg.n_head * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, rope: torch.Tensor, kv: Optional[Tuple[torch.Tensor, int]] = None,
                step: Optional[CacheStep] = None, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, T, dim], rope [B, T, Dh/2, 2]; kv = (the model's whole cache [n_layer, 2, rows, Hkv, Lmax, Dh],
        this layer's index) or None (then attention over the T positions: causal, or ``mask`` [B, 1, T, T]
        bool, True = attend)."""
        B, T, _ = x.shape
        H, Hkv, Dh = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.wqkv(x).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        q = apply_rope(q.view(B, T, H, Dh), rope)  # [B, T, H, Dh]
        k = apply_rope(k.view(B, T, Hkv, Dh), rope)  # [B, T, Hkv, Dh]
        v = v.view(B, T, Hkv, Dh)
        if kv is None:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, Dh]
            if Hkv != H:
                k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
            if mask is None:
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, Dh]
            else:
                out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            cache, layer = kv
            step.write_kv(cache, layer, k, v)  # at cache_len + t
            k_cache, v_cache = cache[layer, 0, :B], cache[layer, 1, :B]  # [B, Hkv, Lmax, Dh] views
            q = q.transpose(1, 2).to(k_cache.dtype)  # [B, H, T, Dh]
            out = ops.tree_attention(q, k_cache, v_cache, step.cache_len, step.tree_mask).to(x.dtype)
        # a copy, then a view: reshape's view-or-copy choice would depend on whether T is 1, which an exported
        # forward serving every T cannot know
        out = out.transpose(1, 2).clone(memory_format=torch.contiguous_format).view(B, T, H * Dh)
        return self.wo(out)


class TransformerBlock(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.attention = Attention(cfg)
        self.feed_forward = FeedForward(cfg)
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)

    def forward(self, x, rope, kv=None, step=None, mask=None):
        h = x + self.attention(self.attention_norm(x), rope, kv, step, mask)
        return h + self.feed_forward(self.ffn_norm(h))


# ---------------------------------------------------------------------------------------------------
# Condition embedders


class LabelEmbedder(nn.Module):
    """c2i: class id -> one condition token. Row num_classes is the null class (CFG / dropout)."""

    def __init__(self, num_classes: int, dim: int):
        super().__init__()
        self.num_classes = num_classes
        self.embedding_table = nn.Embedding(num_classes + 1, dim)

    def forward(self, labels: torch.Tensor, drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        """labels [B] int64, drop [B] bool or None -> [B, 1, dim]"""
        if drop is not None:
            labels = torch.where(drop, torch.full_like(labels, self.num_classes), labels)
        return self.embedding_table(labels)[:, None]

    def null_condition(self, labels: torch.Tensor) -> torch.Tensor:
        return torch.full_like(labels, self.num_classes)


class MLP(nn.Module):
    def __init__(self, in_features: int, hidden_features: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden_features, bias=False)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden_features, out_features, bias=False)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class CaptionEmbedder(nn.Module):
    """t2i: caption features [B, caption_len, caption_dim] -> condition tokens [B, caption_len, dim]."""

    def __init__(self, caption_dim: int, dim: int, caption_len: int):
        super().__init__()
        self.caption_len = caption_len
        self.cap_proj = MLP(caption_dim, dim, dim)
        self.register_buffer("uncond_embedding", torch.randn(caption_len, caption_dim) / caption_dim ** 0.5)

    def forward(self, caption: torch.Tensor, drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        caption = caption[:, : self.caption_len].to(self.cap_proj.fc1.weight.dtype)  # [B, C, caption_dim]
        if drop is not None:
            caption = torch.where(drop[:, None, None], self.uncond_embedding.to(caption.dtype), caption)
        return self.cap_proj(caption)

    def null_condition(self, caption: torch.Tensor) -> torch.Tensor:
        return self.uncond_embedding.to(caption.dtype).expand(caption.shape[0], -1, -1)


# ---------------------------------------------------------------------------------------------------
# The model


class Transformer(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.model_type not in ("c2i", "t2i"):
            raise ValueError(f"model_type must be 'c2i' or 't2i', got {cfg.model_type!r}")
        if cfg.grid_size ** 2 != cfg.block_size:
            raise ValueError(f"block_size must be a square number of image tokens, got {cfg.block_size}")
        if cfg.dim % cfg.n_head or cfg.head_dim % 4 or cfg.n_head % cfg.kv_heads:
            raise ValueError(f"bad head layout: dim {cfg.dim}, n_head {cfg.n_head}, n_kv_head {cfg.kv_heads}")
        self.config = cfg
        self.model_type = cfg.model_type
        self.cond_len = cfg.cond_len
        if cfg.model_type == "c2i":
            self.cls_embedding = LabelEmbedder(cfg.num_classes, cfg.dim)
        else:
            self.cls_embedding = CaptionEmbedder(cfg.caption_dim, cfg.dim, cfg.caption_len)
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg) for _ in range(cfg.n_layer))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self.register_buffer("freqs_cis", None, persistent=False)  # [C + block_size, Dh/2, 2]
        self.register_buffer("kv_cache", None, persistent=False)  # [n_layer, 2, B, Hkv, Lmax, Dh]
        self.register_buffer("cond_keys", None, persistent=False)  # [B] int64 condition keys per cache row
        # keep_condition_hidden: a prefill keeps the post-norm hidden states of every condition position in
        # ``condition_hidden`` [B, C, dim] (an EAGLE drafter that attends to the caption reads them)
        self.keep_condition_hidden = False
        self.condition_hidden: Optional[torch.Tensor] = None
        self.reset_rope()
        self.initialize_weights()

    # -- setup -------------------------------------------------------------------------------------

    def initialize_weights(self) -> None:
        """LlamaGen's init: Linear/Embedding N(0, 0.02), output head zero (it is trained from zero)."""
        std = self.config.initializer_range
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=std)
        nn.init.zeros_(self.output.weight)

    def reset_rope(self, device=None) -> None:
        """(Re)compute the non-persistent RoPE table, e.g. after loading onto a meta-built model."""
        cfg = self.config
        device = device if device is not None else self.tok_embeddings.weight.device
        self.freqs_cis = precompute_freqs_cis_2d(cfg.grid_size, cfg.head_dim, cfg.rope_base, cfg.cond_len).to(device)

    def _apply(self, fn, *args, **kwargs):
        """model.to(dtype) must not round the RoPE table: LlamaGen applies it in float32."""
        super()._apply(fn, *args, **kwargs)
        if self.freqs_cis is not None and self.freqs_cis.dtype != torch.float32:
            self.reset_rope(self.freqs_cis.device)
        return self

    def setup_cache(self, batch: int, max_len: int, dtype: Optional[torch.dtype] = None, device=None) -> torch.Tensor:
        """Allocate the static KV cache [n_layer, 2, batch, Hkv, max_len, Dh] (zeros) for every layer;
        max_len counts condition and image positions (C + block_size is a whole image) plus room for a
        draft tree. One tensor, so ``lantern.ops.compact_kv(model.kv_cache, ...)`` compacts all layers.
        ``cond_keys`` [batch] int64 (C until a prefill with ``emb_masks`` lowers it) counts each row's
        condition keys: the committed prefix of a row with n image tokens is cond_keys + n."""
        cfg = self.config
        dtype = dtype or self.tok_embeddings.weight.dtype
        device = device if device is not None else self.tok_embeddings.weight.device
        self.kv_cache = torch.zeros(cfg.n_layer, 2, batch, cfg.kv_heads, max_len, cfg.head_dim, dtype=dtype,
                                    device=device)
        self.cond_keys = torch.full((batch,), cfg.cond_len, dtype=torch.int64, device=device)
        return self.kv_cache

    def keep_cache_rows(self, rows: torch.Tensor) -> None:
        """Keeps the cache rows ``rows`` [R'] (int64, in the order given) and drops the others: a decoding
        loop's finished rows leave the batch."""
        self.kv_cache = select_cache_rows(self.kv_cache, rows)
        self.cond_keys = self.cond_keys.index_select(0, rows)

    def free_cache(self) -> None:
        self.kv_cache = None
        self.cond_keys = None
        self.condition_hidden = None

    # -- conditions and guidance --------------------------------------------------------------------

    def embed_condition(self, cond_idx: torch.Tensor, drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        """cond_idx: c2i class ids [B] or t2i caption features [B, 120, 2048] -> [B, C, dim]"""
        return self.cls_embedding(cond_idx, drop).to(self.tok_embeddings.weight.dtype)

    def double_for_cfg(self, cond_idx: torch.Tensor) -> torch.Tensor:
        """[B, ...] -> [2B, ...] rows [cond; uncond] (uncond = null class / uncond caption embedding)."""
        return torch.cat([cond_idx, self.cls_embedding.null_condition(cond_idx)])

    # -- forwards -----------------------------------------------------------------------------------

    def forward(self, tokens: Optional[torch.Tensor] = None, cond_idx: Optional[torch.Tensor] = None, *,
                cache_len: torch.Tensor, positions: Optional[torch.Tensor] = None,
                tree_mask: Optional[torch.Tensor] = None, return_hidden: bool = False,
                emb_masks: Optional[torch.Tensor] = None):
        """Cached forward for prefill, AR decoding and tree verification (call ``setup_cache`` first).

        tokens [B, T] int64 image tokens (None or T = 0 allowed with a condition); cond_idx: c2i class ids
        [B] or t2i caption features [B, 120, caption_dim], or None. With a condition, its C tokens come
        first (a chain), then the T tokens. cache_len [B] int64: positions already cached per row (may
        differ per row); the new C' = (C if cond_idx else 0) + T keys/values are written at
        cache_len[b] .. cache_len[b] + C' - 1. positions [B, T] int64: raster index of each image token
        (its 2D-RoPE position); default cache position - cond_keys, i.e. a chain following the committed
        prefix.
        tree_mask [B, T, ceil(T/32)] int32 packed ancestor bits among the T tokens (bit j of token i set iff
        j is i or an ancestor), None = causal chain. Returns logits [B, T_out, V] float32 with
        T_out = T, or 1 + T with a condition (the last condition position, which predicts image token 0,
        then the T tokens); with return_hidden also the hidden states [B, T_out, dim] after the final
        norm (logits = output(hidden)), what an EAGLE drafter consumes.

        emb_masks [B, C] bool / integer 0-1 (t2i, with cond_idx only; None = every caption position real):
        padded caption positions are attended by no query but themselves, and after this forward their K/V
        are dropped from the cache (row b's prefix grows by cond_keys[b] = emb_masks[b].sum() + T, not
        C + T; read ``cond_keys`` for the new cache lengths). All ones is exactly the unmasked forward."""
        if self.kv_cache is None:
            raise RuntimeError("call model.setup_cache(batch, max_len) before the cached forward")
        parts, ropes = [], []
        if cond_idx is not None:
            cond = self.embed_condition(cond_idx)  # [B, C, dim]
            parts.append(cond)
            ropes.append(self.freqs_cis[: self.cond_len].expand(cond.shape[0], -1, -1, -1))  # zeros
        n_cond = self.cond_len if cond_idx is not None else 0
        masks = self._caption_masks(emb_masks, cond_idx)  # [B, C] bool, None = no padding
        T = 0 if tokens is None else tokens.shape[1]
        if T > 0:
            B = tokens.shape[0]
            if positions is None:  # a chain after the committed prefix, or after this call's condition
                start = cache_len if cond_idx is not None else cache_len - self.cond_keys[:B]  # [B]
                positions = start[:, None] + torch.arange(T, device=tokens.device)
            if positions.shape != tokens.shape:
                raise ValueError(f"positions must have shape {list(tokens.shape)}, got {list(positions.shape)}")
            self._check_ranges(tokens, positions)
            parts.append(self.tok_embeddings(tokens))  # [B, T, dim]
            ropes.append(self.freqs_cis[self.cond_len + positions])  # [B, T, Dh/2, 2]
        if not parts:
            raise ValueError("forward needs tokens or a condition")
        x = torch.cat(parts, dim=1)  # [B, T', dim], T' = n_cond + T
        rope = torch.cat(ropes, dim=1)  # [B, T', Dh/2, 2]
        B, T_new = x.shape[0], x.shape[1]
        if cache_len.shape != (B,):
            raise ValueError(f"cache_len must have shape [{B}], got {list(cache_len.shape)}")
        if B > self.kv_cache.shape[2]:
            raise ValueError(f"batch {B} exceeds the cache's {self.kv_cache.shape[2]} rows")
        Lmax = self.kv_cache.shape[4]
        if cache_len.dtype != torch.int64 or (
                ops.checks.scan_values() and bool(((cache_len < 0) | (cache_len + T_new > Lmax)).any())):
            raise ValueError(f"cache_len must be int64 with 0 <= cache_len and cache_len + {T_new} new positions "
                             f"<= max_len={Lmax}, got {cache_len.tolist()} ({cache_len.dtype})")
        step = CacheStep(
            slots=cache_len[:, None] + torch.arange(T_new, device=x.device),
            cache_len=cache_len,
            tree_mask=self._full_tree_mask(tree_mask, n_cond, T, B, x.device, masks),
        )
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, (self.kv_cache, i), step)
        if cond_idx is not None:
            self._commit_condition(cache_len, masks, T)
            if self.keep_condition_hidden:
                self.condition_hidden = self.norm(x[:, :n_cond])  # [B, C, dim]
        return self._head(x[:, max(n_cond - 1, 0):], return_hidden)

    def forward_full(self, idx: torch.Tensor, cond_idx: torch.Tensor, *, force_drop_ids: Optional[torch.Tensor] = None,
                     return_hidden: bool = False, emb_masks: Optional[torch.Tensor] = None,
                     return_condition_hidden: bool = False):
        """No-cache training path: [condition] + idx [B, L] with plain causal attention (same math).
        In training mode the condition is dropped with probability class_dropout_prob (force_drop_ids [B]
        overrides; a dropped caption keeps its emb_masks, as in LlamaGen). emb_masks [B, C] (t2i): causal
        attention in which no query sees a padded caption position but that position itself. Returns logits
        [B, 1 + L, V] float32 (position i predicts image token i), with return_hidden the post-norm
        hidden states [B, 1 + L, dim], and with return_condition_hidden last the post-norm hidden states over
        the condition [B, C, dim] (what a prefill keeps in ``condition_hidden``)."""
        masks = self._caption_masks(emb_masks, cond_idx)  # [B, C] bool, None = no padding
        B, L = idx.shape
        drop = None
        if force_drop_ids is not None:
            drop = force_drop_ids.bool()
        elif self.training and self.config.class_dropout_prob > 0:
            drop = torch.rand(B, device=idx.device) < self.config.class_dropout_prob
        x = torch.cat([self.embed_condition(cond_idx, drop), self.tok_embeddings(idx)], dim=1)  # [B, C + L, dim]
        rope = self.freqs_cis[None, : x.shape[1]]  # [1, C + L, Dh/2, 2]
        mask = None if masks is None else self._dense_mask(masks, x.shape[1])[:, None]  # [B, 1, C + L, C + L]
        for layer in self.layers:
            x = layer(x, rope, mask=mask)
        out = self._head(x[:, self.cond_len - 1:], return_hidden)
        if not return_condition_hidden:
            return out
        return (*out, self.norm(x[:, : self.cond_len])) if return_hidden else (out, self.norm(x[:, : self.cond_len]))

    def loss(self, tokens: torch.Tensor, cond_idx: torch.Tensor) -> torch.Tensor:
        """Next-token cross-entropy over a whole image: tokens [B, L] (L <= block_size)."""
        logits = self.forward_full(tokens[:, :-1], cond_idx)  # [B, L, V]
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens.reshape(-1))

    # -- helpers ------------------------------------------------------------------------------------

    def _head(self, x: torch.Tensor, return_hidden: bool):
        hidden = self.norm(x)  # [B, T_out, dim]
        logits = self.output(hidden).float()  # [B, T_out, V]
        return (logits, hidden) if return_hidden else logits

    def _check_ranges(self, tokens: torch.Tensor, positions: torch.Tensor) -> None:
        """0 <= tokens < vocab_size and 0 <= positions < block_size (one host sync; eager mode only, like the
        ops' value checks: ``lantern.ops.checks.scan_values``)."""
        if not ops.checks.scan_values():
            return
        cfg = self.config
        bad_tok = (tokens < 0) | (tokens >= cfg.vocab_size)
        bad_pos = (positions < 0) | (positions >= cfg.block_size)
        if bool((bad_tok | bad_pos).any()):
            if bool(bad_tok.any()):
                raise ValueError(f"tokens must be in [0, {cfg.vocab_size}), got {tokens[bad_tok][0].item()}")
            raise ValueError(f"positions (raster indices) must be in [0, block_size={cfg.block_size}), "
                             f"got {positions[bad_pos][0].item()}")

    def _caption_masks(self, emb_masks, cond_idx) -> Optional[torch.Tensor]:
        """The checked caption mask [B, C] bool, or None without one or when every position is real (then
        the forward is the unmasked one, bit for bit)."""
        if emb_masks is None:
            return None
        if self.model_type != "t2i":
            raise ValueError("emb_masks (caption padding) is for t2i models; this model is c2i")
        if cond_idx is None:
            raise ValueError("emb_masks belongs to the condition: pass it with cond_idx (the captions)")
        masks = check_emb_masks(emb_masks, cond_idx.shape[0], self.cond_len, cond_idx.device)
        return None if bool(masks.all()) else masks

    def _commit_condition(self, cache_len: torch.Tensor, masks: Optional[torch.Tensor], T: int) -> None:
        """After a forward that wrote the condition at cache_len: record each row's condition keys, and
        with masks move the kept K/V (real caption positions, then the T tokens) down over the padded ones."""
        B, C = cache_len.shape[0], self.cond_len
        if masks is None:
            self.cond_keys[:B] = C
            return
        keep = torch.cat([masks, masks.new_ones(B, T)], dim=1)  # [B, C + T] new positions whose K/V stay
        n_keep = keep.sum(1)  # [B]
        order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # [B, C + T] kept ones first, in order
        kept = torch.where(torch.arange(C + T, device=keep.device) < n_keep[:, None], order, -1)
        rows = self.kv_cache.shape[2]  # compact_kv takes the whole cache; rows past B keep nothing
        pad = rows - B
        ops.compact_kv(self.kv_cache, F.pad(cache_len, (0, pad)), F.pad(kept, (0, 0, 0, pad), value=-1),
                       F.pad(n_keep, (0, pad)))
        self.cond_keys[:B] = masks.sum(1)

    def _dense_mask(self, masks: torch.Tensor, n: int) -> torch.Tensor:
        """[B, n, n] bool, True = attend, over [C condition] + image positions: causal, and a padded caption
        column j (masks[b, j] False) is seen by query j alone (LlamaGen's mask times emb_masks, diagonal kept)."""
        C = self.cond_len
        col = torch.arange(n, device=masks.device)
        real = torch.cat([masks, masks.new_ones(masks.shape[0], n - C)], dim=1)  # [B, n] real columns
        causal = col[None, :] <= col[:, None]  # [n, n]
        return causal & (real[:, None, :] | torch.eye(n, dtype=torch.bool, device=masks.device))

    @staticmethod
    def _full_tree_mask(tree_mask, n_cond: int, T: int, B: int, device,
                        masks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The packed mask over the n_cond + T new positions: the condition tokens are a chain that every
        image token follows; among the image tokens, tree_mask (None = causal). masks [B, n_cond] bool
        (caption padding): a padded condition position is seen by itself alone."""
        if tree_mask is None and masks is None:
            n = n_cond + T
            return pack_bits(torch.ones(n, n, dtype=torch.bool, device=device).tril()).expand(B, -1, -1)
        if tree_mask is not None and tree_mask.shape[:2] != (B, T):
            raise ValueError(f"tree_mask must have shape [{B}, {T}, {(T + 31) // 32}], got {list(tree_mask.shape)}")
        if n_cond == 0:
            return tree_mask
        n = n_cond + T
        bits = torch.zeros(B, n, n, dtype=torch.bool, device=device)
        bits[:, :n_cond, :n_cond] = torch.ones(n_cond, n_cond, dtype=torch.bool, device=device).tril()
        bits[:, n_cond:, :n_cond] = True
        bits[:, n_cond:, n_cond:] = (torch.ones(T, T, dtype=torch.bool, device=device).tril() if tree_mask is None
                                     else unpack_bits(tree_mask, T))
        if masks is not None:
            bits[:, :, :n_cond] &= masks[:, None, :] | torch.eye(n, n_cond, dtype=torch.bool, device=device)
        return pack_bits(bits)


def build_gpt(name: str, model_type: str = "c2i", block_size: Optional[int] = None, **overrides) -> Transformer:
    """A randomly initialised LlamaGen GPT: name in GPT_CONFIGS, model_type "c2i" | "t2i", block_size the
    number of image tokens (default: the config's, 256 = 16x16 for the official sizes). overrides replace
    GPTConfig fields. Build on ``with torch.device("meta"):`` to get shapes without memory."""
    if name not in GPT_CONFIGS:
        raise ValueError(f"unknown GPT config {name!r}; choose from {sorted(GPT_CONFIGS)}")
    cfg = replace(GPT_CONFIGS[name], model_type=model_type, **overrides)
    if block_size is not None:
        cfg = replace(cfg, block_size=block_size)
    return Transformer(cfg)


def double_for_cfg(model: Transformer, cond_idx: torch.Tensor) -> torch.Tensor:
    """[B, ...] condition -> [2B, ...] rows [cond; uncond] (LlamaGen's doubled-batch guidance)."""
    return model.double_for_cfg(cond_idx)
