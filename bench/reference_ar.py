"""The AR sampler every lantern speed figure is held against: LlamaGen's GPT decoded the way gpt-fast and
LlamaGen's own ``generate(..., --compile)`` decode it, written out plainly and independently of lantern's
model code.

- A static KV cache per layer ([rows, heads, max_len, head_dim]); every row of the batch sits at the same
  position (AR steps in lockstep), so one ``input_pos`` tensor addresses the cache for all rows.
- Attention is ``F.scaled_dot_product_attention`` over the whole cache with the causal mask's row of the
  current position (LlamaGen's ``causal_mask[:, :, input_pos]``).
- One decode step (the target forward, classifier-free guidance, temperature, top-k, the draw) is one
  ``torch.compile(..., fullgraph=True)`` graph (gpt-fast's ``decode_one_token``); on a GPU with
  ``mode="reduce-overhead"`` (CUDA graphs). The prefill runs eagerly.
- Sampling is LlamaGen's: logits / temperature, top-k (ties kept), softmax, one draw. The draw is
  gpt-fast's exponential race (argmax of probs / Exp(1)), a multinomial sample without a host sync; so the
  tokens follow the same law as lantern's sampler but not its Philox stream. Temperature 0 is greedy
  (argmax), which lantern's AR reproduces token for token (tests/test_reference_ar.py).

Weights: a lantern ``Transformer`` (the same state-dict names as LlamaGen's checkpoints), copied, so the
two samplers run the same numbers. c2i only (the tiny default and the official ImageNet models).
"""
from __future__ import annotations

import time
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class KVCache(nn.Module):
    def __init__(self, rows: int, heads: int, max_len: int, head_dim: int, dtype, device):
        super().__init__()
        shape = (rows, heads, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, input_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """input_pos [T], k, v [rows, heads, T, head_dim] -> the whole cache (k, v)."""
        self.k.index_copy_(2, input_pos, k)
        self.v.index_copy_(2, input_pos, v)
        return self.k, self.v


def rope_table(grid: int, head_dim: int, base: float, cond_len: int) -> torch.Tensor:
    """LlamaGen's 2D RoPE: float32 [cond_len + grid^2, head_dim / 2, 2] (cos, sin); the condition rows are zero."""
    half = head_dim // 2
    freqs = 1.0 / (base ** (torch.arange(0, half, 2)[: half // 2].float() / half))
    angles = torch.outer(torch.arange(grid).float(), freqs)  # [grid, Dh/4]
    grid_angles = torch.cat([angles[:, None].expand(-1, grid, -1), angles[None].expand(grid, -1, -1)], -1)
    table = torch.stack([grid_angles.cos(), grid_angles.sin()], -1).flatten(0, 1)  # [grid^2, Dh/2, 2]
    return torch.cat([torch.zeros(cond_len, half, 2), table])


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, Dh], rope [T, Dh/2, 2]: interleaved pairs rotated in float32."""
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = rope[None, :, None, :, 0], rope[None, :, None, :, 1]
    out = torch.stack([pairs[..., 0] * cos - pairs[..., 1] * sin, pairs[..., 1] * cos + pairs[..., 0] * sin], -1)
    return out.flatten(3).type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x, rope, mask, input_pos):
        B, T, D = x.shape
        q, k, v = self.wqkv(x).split(D, dim=-1)
        q = apply_rope(q.view(B, T, self.heads, self.head_dim), rope).transpose(1, 2)  # [B, H, T, Dh]
        k = apply_rope(k.view(B, T, self.heads, self.head_dim), rope).transpose(1, 2)
        v = v.view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_cache.update(input_pos, k, v)  # [B, H, max_len, Dh]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(B, T, D))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int, eps: float):
        super().__init__()
        self.attention = Attention(dim, heads)
        self.feed_forward = FeedForward(dim, hidden)
        self.attention_norm = RMSNorm(dim, eps)
        self.ffn_norm = RMSNorm(dim, eps)

    def forward(self, x, rope, mask, input_pos):
        h = x + self.attention(self.attention_norm(x), rope, mask, input_pos)
        return h + self.feed_forward(self.ffn_norm(h))


class ReferenceGPT(nn.Module):
    """LlamaGen's c2i GPT with gpt-fast's static cache; ``from_lantern`` copies a lantern Transformer's weights."""

    def __init__(self, n_layer: int, dim: int, heads: int, hidden: int, vocab: int, num_classes: int,
                 block_size: int, eps: float = 1e-5, rope_base: float = 10000.0):
        super().__init__()
        self.num_classes, self.block_size = num_classes, block_size
        self.cls_embedding = nn.Module()
        self.cls_embedding.embedding_table = nn.Embedding(num_classes + 1, dim)
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden, eps) for _ in range(n_layer))
        self.norm = RMSNorm(dim, eps)
        self.output = nn.Linear(dim, vocab, bias=False)
        grid = int(round(block_size ** 0.5))
        self.register_buffer("rope", rope_table(grid, dim // heads, rope_base, 1), persistent=False)
        self.register_buffer("causal_mask", None, persistent=False)

    @classmethod
    def from_lantern(cls, gpt) -> "ReferenceGPT":
        cfg = gpt.config
        if cfg.model_type != "c2i" or cfg.kv_heads != cfg.n_head:
            raise ValueError("the reference AR loop covers LlamaGen's c2i GPTs (no GQA)")
        weight = gpt.tok_embeddings.weight
        with torch.device("meta"):
            model = cls(cfg.n_layer, cfg.dim, cfg.n_head, cfg.ffn_hidden, cfg.vocab_size, cfg.num_classes,
                        cfg.block_size, cfg.norm_eps, cfg.rope_base)
        model.load_state_dict(gpt.state_dict(), strict=True, assign=True)
        grid = int(round(cfg.block_size ** 0.5))
        model.rope = rope_table(grid, cfg.head_dim, cfg.rope_base, 1).to(weight.device)
        return model.to(device=weight.device, dtype=weight.dtype).eval()

    def setup_caches(self, rows: int, max_len: int) -> None:
        weight = self.tok_embeddings.weight
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(rows, layer.attention.heads, max_len, layer.attention.head_dim,
                                               weight.dtype, weight.device)
        self.causal_mask = torch.ones(max_len, max_len, dtype=torch.bool, device=weight.device).tril()

    def forward(self, x: torch.Tensor, input_pos: torch.Tensor) -> torch.Tensor:
        """x [rows, T, dim] embedded inputs at cache positions input_pos [T] -> logits float32 [rows, T, V]."""
        rope = self.rope[input_pos]  # [T, Dh/2, 2]
        mask = self.causal_mask[None, None, input_pos]  # [1, 1, T, max_len]
        for layer in self.layers:
            x = layer(x, rope, mask, input_pos)
        return self.output(self.norm(x)).float()


def sample(logits: torch.Tensor, uncond: Optional[torch.Tensor], cfg_scale: float, temperature: float,
           top_k: int) -> torch.Tensor:
    """logits, uncond [B, V] -> tokens [B] int64, LlamaGen's rule (temperature 0: argmax)."""
    if uncond is not None:
        logits = uncond + (logits - uncond) * cfg_scale
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / max(temperature, 1e-5)
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = torch.where(logits < kth, float("-inf"), logits)
    probs = torch.softmax(logits, dim=-1)
    race = torch.empty_like(probs).exponential_(1)  # argmax(p / Exp(1)) is a draw from p, without a host sync
    return (probs / race).argmax(-1)


def decode_one_token(model: ReferenceGPT, token: torch.Tensor, input_pos: torch.Tensor, cfg_scale: float,
                     temperature: float, top_k: int) -> torch.Tensor:
    """token [B] -> the next token [B]: one forward of the [cond; uncond] rows and one draw."""
    guided = cfg_scale != 1.0
    feed = torch.cat([token, token]) if guided else token
    logits = model(model.tok_embeddings(feed[:, None]), input_pos)[:, -1]  # [rows, V]
    B = token.shape[0]
    return sample(logits[:B], logits[B:] if guided else None, cfg_scale, temperature, top_k)


class ReferenceAR:
    """The compiled AR loop: ``generate(labels)`` -> tokens [B, L]. ``compile`` False runs it eagerly."""

    def __init__(self, model: ReferenceGPT, compile: bool = True):
        self.model = model
        self.step = decode_one_token
        self.compile_s = 0.0
        if compile:
            mode = "reduce-overhead" if model.tok_embeddings.weight.is_cuda else None
            self.step = torch.compile(decode_one_token, mode=mode, fullgraph=True)

    @torch.no_grad()
    def generate(self, labels: torch.Tensor, cfg_scale: float = 1.0, temperature: float = 1.0, top_k: int = 0,
                 seed: int = 0, length: Optional[int] = None) -> torch.Tensor:
        model = self.model
        L = length or model.block_size
        guided = cfg_scale != 1.0
        cond = torch.cat([labels, torch.full_like(labels, model.num_classes)]) if guided else labels
        model.setup_caches(cond.shape[0], 1 + L)
        torch.manual_seed(seed)
        x = model.cls_embedding.embedding_table(cond)[:, None]  # [rows, 1, dim]
        logits = model(x, torch.zeros(1, dtype=torch.int64, device=labels.device))[:, -1]
        B = labels.shape[0]
        token = sample(logits[:B], logits[B:] if guided else None, cfg_scale, temperature, top_k)
        tokens = [token]
        for t in range(1, L):
            t0 = time.perf_counter()
            input_pos = torch.tensor([t], device=labels.device)
            token = self.step(model, token.clone(), input_pos, cfg_scale, temperature, top_k)
            if t == 1 and not self.compile_s:
                self.compile_s = time.perf_counter() - t0  # the first call compiles (once per process)
            tokens.append(token)
        return torch.stack(tokens, 1)
