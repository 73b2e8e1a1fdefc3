"""MAR (masked autoregressive image generation with a per-token diffusion head), checkpoint-compatible with
the official MAR-B / L / H files, plus the project's tiny configurations. Device-agnostic.

Layout of one image: ``buffer_size`` class-embedding slots followed by L = seq_h * seq_w tokens in raster
order, each token a vector of C = vae_embed_dim * patch_size^2 scaled VAE latent values (channel-major
inside a patch). mask 1 = unknown.

- encoder (MAE style): z_proj(tokens), the buffer slots all set to the class embedding (``fake_latent`` when
  unconditional), + encoder_pos_embed_learned, z_proj_ln, then only the buffer and known rows (in index
  order) go through the blocks and encoder_norm;
- decoder: decoder_embed, ``mask_token`` at the unknown rows, + decoder_pos_embed_learned, blocks over all
  buffer + L rows, decoder_norm, drop the buffer rows, + diffusion_pos_embed_learned -> z [N, L, Dd];
- ``diffloss`` (``lantern.models.diffusion.DiffLoss``) turns the z of a position into a token.

The sampling loop is ``lantern.decoding.mar.sample_mar``; state-dict names: docs/mar.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Dict, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .diffusion import TRAIN_STEPS, DiffLoss


@dataclass(frozen=True)
class MARConfig:
    img_size: int = 256
    vae_stride: int = 16
    patch_size: int = 1
    encoder_embed_dim: int = 1024
    encoder_depth: int = 16
    encoder_num_heads: int = 16
    decoder_embed_dim: int = 1024
    decoder_depth: int = 16
    decoder_num_heads: int = 16
    mlp_ratio: float = 4.0
    norm_eps: float = 1e-6
    vae_embed_dim: int = 16
    mask_ratio_min: float = 0.7
    label_drop_prob: float = 0.1
    class_num: int = 1000
    attn_dropout: float = 0.1
    proj_dropout: float = 0.1
    buffer_size: int = 64
    diffloss_d: int = 3
    diffloss_w: int = 1024
    num_sampling_steps: str = "100"
    diffusion_batch_mul: int = 4
    x0_clip: Optional[float] = None  # sampling: bound on the head's predicted x0 (None: unclipped, the reference)
    # a fixed attention prior for the tiny configs (0: plain attention, the reference): heads 0 .. k-1 of every
    # attention layer favour one grid neighbour each (NEIGHBOUR_OFFSETS), see ``neighbour_bias``
    neighbour_heads: int = 0
    neighbour_slope: float = 2.0

    @property
    def seq_side(self) -> int:
        return self.img_size // self.vae_stride // self.patch_size

    @property
    def seq_len(self) -> int:
        return self.seq_side ** 2

    @property
    def token_embed_dim(self) -> int:
        return self.vae_embed_dim * self.patch_size ** 2


# (row, column) offsets of a query's neighbour, one per neighbour head
NEIGHBOUR_OFFSETS = ((-1, 0), (1, 0), (0, -1), (0, 1), (-1, -1), (1, 1), (-1, 1), (1, -1))
NEIGHBOUR_BUFFER_DISTANCE = 3.0  # how far the class slots count as from an image query in a neighbour head


def neighbour_bias(cfg: MARConfig, num_heads: int) -> torch.Tensor:
    """The fixed attention bias [num_heads, B + L, B + L] (query row, key row; buffer rows first) of
    ``cfg.neighbour_heads`` > 0: in head h < neighbour_heads, an image query at grid position p scores key
    position r with -slope * |r - (p + NEIGHBOUR_OFFSETS[h])| (Euclidean, in tokens) and the class slots with
    -slope * NEIGHBOUR_BUFFER_DISTANCE. Buffer queries and the other heads get 0 (plain attention).

    Why: MAR's attention has to learn from absolute position embeddings which known token lies where before
    it can infer a masked token from its neighbours; on the tiny models' CPU budget it does not get there
    (docs/mar.md, "The tiny continuous default"). One head per neighbour direction gives each a separate
    value projection, as a 3 x 3 convolution has one weight per tap. No parameters: the state dict is MAR's."""
    B, side = cfg.buffer_size, cfg.seq_side
    bias = torch.zeros(num_heads, B + side * side, B + side * side, dtype=torch.float64)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    grid = torch.stack([rows.flatten(), cols.flatten()], dim=1).double()  # [L, 2]
    for h, offset in enumerate(NEIGHBOUR_OFFSETS[: cfg.neighbour_heads]):
        target = grid + torch.tensor(offset, dtype=torch.float64)  # [L, 2]
        bias[h, B:, B:] = -cfg.neighbour_slope * torch.cdist(target, grid)
        bias[h, B:, :B] = -cfg.neighbour_slope * NEIGHBOUR_BUFFER_DISTANCE
    return bias


NUM_SAMPLING_STEPS_RULE = f"must be an int in [1, {TRAIN_STEPS}] (diffusion steps kept of the {TRAIN_STEPS} trained)"


def num_sampling_steps_valid(steps) -> bool:
    """The head's sampling steps: an int in [1, 1000] (the training steps), or its decimal string."""
    text = str(steps) if isinstance(steps, int) and not isinstance(steps, bool) else steps
    return isinstance(text, str) and text.isascii() and text.isdigit() and 1 <= int(text) <= TRAIN_STEPS


def check_num_sampling_steps(steps) -> None:
    if not num_sampling_steps_valid(steps):
        raise ValueError(f"num_sampling_steps {NUM_SAMPLING_STEPS_RULE}, got {steps!r}")


def check_neighbour_heads(cfg: MARConfig) -> None:
    k = cfg.neighbour_heads
    if not 0 <= k <= len(NEIGHBOUR_OFFSETS):
        raise ValueError(f"neighbour_heads must be in 0..{len(NEIGHBOUR_OFFSETS)}, got {k}")
    if k > min(cfg.encoder_num_heads, cfg.decoder_num_heads):
        raise ValueError(f"neighbour_heads {k} exceeds the encoder's {cfg.encoder_num_heads} or the decoder's "
                         f"{cfg.decoder_num_heads} heads")
    if k and not cfg.neighbour_slope > 0:
        raise ValueError(f"neighbour_slope must be > 0, got {cfg.neighbour_slope}")


TINY_X0_CLIP = 8.0  # in units of the latents' std: about 99.99 % of the KL-tiny training latents lie within

MAR_CONFIGS: Dict[str, MARConfig] = {
    # the released models: transformer sizes from the MAR configs, head sizes from the training commands
    "MAR-B": MARConfig(encoder_embed_dim=768, encoder_depth=12, encoder_num_heads=12, decoder_embed_dim=768,
                       decoder_depth=12, decoder_num_heads=12, diffloss_d=6, diffloss_w=1024),
    "MAR-L": MARConfig(encoder_embed_dim=1024, encoder_depth=16, encoder_num_heads=16, decoder_embed_dim=1024,
                       decoder_depth=16, decoder_num_heads=16, diffloss_d=8, diffloss_w=1280),
    "MAR-H": MARConfig(encoder_embed_dim=1280, encoder_depth=20, encoder_num_heads=16, decoder_embed_dim=1280,
                       decoder_depth=20, decoder_num_heads=16, diffloss_d=12, diffloss_w=1536),
    # the project's tiny continuous default: 32x32 images -> 8x8 latents of 16 channels (KL-tiny), 10 classes;
    # 50 sampling steps by default to keep CPU sampling affordable (the head is trained on all 1000, so any
    # respacing works: num_sampling_steps="100" as for the released models); x0 clipped at TINY_X0_CLIP
    # (the latents are scaled to unit std) so that the head's eps error at the last training step, which the
    # first reverse step multiplies by about 600, cannot throw the chain off (lantern.models.diffusion);
    # 16-wide heads, 8 of them neighbour heads (``neighbour_bias``), the other 4 plain
    "MAR-tiny": MARConfig(img_size=32, vae_stride=4, encoder_embed_dim=192, encoder_depth=3, encoder_num_heads=12,
                          decoder_embed_dim=192, decoder_depth=3, decoder_num_heads=12, class_num=10,
                          buffer_size=16, diffloss_d=3, diffloss_w=192, num_sampling_steps="50",
                          attn_dropout=0.0, proj_dropout=0.0, x0_clip=TINY_X0_CLIP, neighbour_heads=8),
    # its drafter: same family and latent space, a smaller transformer and head; all 8 heads neighbour heads
    "MAR-tiny-drafter": MARConfig(img_size=32, vae_stride=4, encoder_embed_dim=128, encoder_depth=2,
                                  encoder_num_heads=8, decoder_embed_dim=128, decoder_depth=2, decoder_num_heads=8,
                                  class_num=10, buffer_size=16, diffloss_d=2, diffloss_w=128, num_sampling_steps="50",
                                  attn_dropout=0.0, proj_dropout=0.0, x0_clip=TINY_X0_CLIP, neighbour_heads=8),
}


class Attention(nn.Module):
    """Full (unmasked) multi-head self-attention; qkv rows are [q; k; v], heads contiguous in each."""

    def __init__(self, dim: int, num_heads: int, attn_drop: float, proj_drop: float):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"dim {dim} is not divisible by num_heads {num_heads}")
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.attn_drop, self.proj_drop = attn_drop, nn.Dropout(proj_drop)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        """x [B, N, D]; bias None or [B or 1, H, N, N] added to the attention scores."""
        B, N, D = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, D // self.num_heads).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each [B, H, N, Dh]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                             dropout_p=self.attn_drop if self.training else 0.0)
        return self.proj_drop(self.proj(out.transpose(1, 2).reshape(B, N, D)))


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, drop: float):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        self.drop = nn.Dropout(drop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(self.drop(F.gelu(self.fc1(x)))))


class Block(nn.Module):
    """Pre-norm transformer block with the key names of the reference's vision-transformer block."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float, eps: float, attn_drop: float, proj_drop: float):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=eps)
        self.attn = Attention(dim, num_heads, attn_drop, proj_drop)
        self.norm2 = nn.LayerNorm(dim, eps=eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), proj_drop)

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), bias)
        return x + self.mlp(self.norm2(x))


class MAR(nn.Module):
    family = "mar"  # lantern.generate dispatches on this

    def __init__(self, cfg: MARConfig):
        super().__init__()
        if cfg.buffer_size < 1:
            raise ValueError("buffer_size must be >= 1 (the class embedding lives in the buffer slots)")
        check_neighbour_heads(cfg)
        check_num_sampling_steps(cfg.num_sampling_steps)
        self.config = cfg
        self._bias_cache: Dict[tuple, torch.Tensor] = {}
        De, Dd, L, B, C = (cfg.encoder_embed_dim, cfg.decoder_embed_dim, cfg.seq_len, cfg.buffer_size,
                           cfg.token_embed_dim)
        blocks = lambda dim, depth, heads: nn.ModuleList(
            [Block(dim, heads, cfg.mlp_ratio, cfg.norm_eps, cfg.attn_dropout, cfg.proj_dropout) for _ in range(depth)])
        self.class_emb = nn.Embedding(cfg.class_num, De)
        self.fake_latent = nn.Parameter(torch.zeros(1, De))
        self.z_proj = nn.Linear(C, De)
        self.z_proj_ln = nn.LayerNorm(De, eps=1e-6)
        self.encoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L + B, De))
        self.encoder_blocks = blocks(De, cfg.encoder_depth, cfg.encoder_num_heads)
        self.encoder_norm = nn.LayerNorm(De, eps=cfg.norm_eps)
        self.decoder_embed = nn.Linear(De, Dd)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, Dd))
        self.decoder_pos_embed_learned = nn.Parameter(torch.zeros(1, L + B, Dd))
        self.decoder_blocks = blocks(Dd, cfg.decoder_depth, cfg.decoder_num_heads)
        self.decoder_norm = nn.LayerNorm(Dd, eps=cfg.norm_eps)
        self.diffusion_pos_embed_learned = nn.Parameter(torch.zeros(1, L, Dd))
        self.initialize_weights()
        self.diffloss = DiffLoss(C, Dd, cfg.diffloss_d, cfg.diffloss_w, cfg.num_sampling_steps, cfg.x0_clip)

    def initialize_weights(self) -> None:
        """The reference's init of the transformer part (the head initialises itself)."""
        if self.fake_latent.is_meta:
            return
        for p in (self.class_emb.weight, self.fake_latent, self.mask_token, self.encoder_pos_embed_learned,
                  self.decoder_pos_embed_learned, self.diffusion_pos_embed_learned):
            nn.init.normal_(p, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm) and m.elementwise_affine:
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    # ---- tokens <-> latents ----------------------------------------------------------------------

    def patchify(self, latents: torch.Tensor) -> torch.Tensor:
        """[N, c, h, w] scaled latents -> [N, L, C] tokens (raster order, channel-major inside a patch)."""
        N, c, h, w = latents.shape
        p = self.config.patch_size
        x = latents.reshape(N, c, h // p, p, w // p, p).permute(0, 2, 4, 1, 3, 5)  # nchpwq -> nhwcpq
        return x.reshape(N, (h // p) * (w // p), c * p * p)

    def unpatchify(self, tokens: torch.Tensor) -> torch.Tensor:
        """[N, L, C] -> [N, c, h, w]."""
        N = tokens.shape[0]
        p, side, c = self.config.patch_size, self.config.seq_side, self.config.vae_embed_dim
        x = tokens.reshape(N, side, side, c, p, p).permute(0, 3, 1, 4, 2, 5)  # nhwcpq -> nchpwq
        return x.reshape(N, c, side * p, side * p)

    # ---- the transformer ---------------------------------------------------------------------------

    def attention_bias(self, num_heads: int, like: torch.Tensor) -> Optional[torch.Tensor]:
        """``neighbour_bias`` [H, B + L, B + L] in like's dtype and device (cached), or None without neighbour
        heads."""
        if not self.config.neighbour_heads:
            return None
        key = (num_heads, like.device, like.dtype)
        if key not in self._bias_cache:
            self._bias_cache[key] = neighbour_bias(self.config, num_heads).to(device=like.device, dtype=like.dtype)
        return self._bias_cache[key]

    def class_embedding(self, labels: Optional[torch.Tensor], batch: Optional[int] = None,
                        drop: Optional[torch.Tensor] = None) -> torch.Tensor:
        """labels [N] int64 -> [N, De]; labels None -> ``fake_latent`` for ``batch`` rows (unconditional);
        drop [N] bool replaces those rows by ``fake_latent`` (training's label dropout)."""
        if labels is None:
            if batch is None:
                raise ValueError("class_embedding needs labels or batch")
            return self.fake_latent.expand(batch, -1)
        emb = self.class_emb(labels)
        if drop is not None:
            emb = torch.where(drop[:, None], self.fake_latent.to(emb.dtype), emb)
        return emb

    def forward_encoder(self, tokens: torch.Tensor, mask: torch.Tensor, class_embedding: torch.Tensor) -> torch.Tensor:
        """tokens [N, L, C], mask [N, L] (1/True = unknown; every row the same count), class_embedding
        [N, De] -> [N, buffer + n_known, De]."""
        N, L, _ = tokens.shape
        B = self.config.buffer_size
        x = self.z_proj(tokens)  # [N, L, De]
        buffer = class_embedding[:, None, :].to(x.dtype).expand(N, B, x.shape[-1])
        x = torch.cat([buffer, x], dim=1) + self.encoder_pos_embed_learned
        x = self.z_proj_ln(x)
        keep = torch.cat([torch.zeros(N, B, dtype=torch.bool, device=mask.device), mask.bool()], dim=1).logical_not()
        x = x[keep].reshape(N, -1, x.shape[-1])  # [N, B + n_known, De]
        bias = self.attention_bias(self.config.encoder_num_heads, x)
        if bias is not None:
            rows = keep.nonzero(as_tuple=True)[1].reshape(N, -1)  # [N, S] the kept rows' indices
            bias = bias[:, rows[:, :, None], rows[:, None, :]].transpose(0, 1)  # [N, H, S, S]
        for block in self.encoder_blocks:
            x = block(x, bias)
        return self.encoder_norm(x)

    def forward_decoder(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Encoder output [N, B + n_known, De], mask [N, L] -> z [N, L, Dd]."""
        N, L = mask.shape
        B = self.config.buffer_size
        x = self.decoder_embed(x)
        keep = torch.cat([torch.zeros(N, B, dtype=torch.bool, device=mask.device), mask.bool()], dim=1).logical_not()
        full = self.mask_token.to(x.dtype).expand(N, B + L, x.shape[-1]).clone()
        full[keep] = x.reshape(-1, x.shape[-1])
        x = full + self.decoder_pos_embed_learned
        bias = self.attention_bias(self.config.decoder_num_heads, x)
        bias = None if bias is None else bias[None]  # [1, H, B + L, B + L]
        for block in self.decoder_blocks:
            x = block(x, bias)
        x = self.decoder_norm(x)[:, B:]
        return x + self.diffusion_pos_embed_learned

    def forward_z(self, tokens: torch.Tensor, mask: torch.Tensor, class_embedding: torch.Tensor) -> torch.Tensor:
        """The condition vectors z [N, L, Dd] of every position given the known tokens."""
        return self.forward_decoder(self.forward_encoder(tokens, mask, class_embedding), mask)

    # ---- training (the tiny models) ----------------------------------------------------------------

    def training_loss(self, latents: torch.Tensor, labels: torch.Tensor, generator: Optional[torch.Generator] = None,
                      mask_rate: Optional[float] = None) -> torch.Tensor:
        """The reference's training objective for scaled latents [N, c, h, w] and labels [N]: one random
        order per image, one mask rate per batch from the truncated normal on [mask_ratio_min, 1], label
        dropout, and the head's mse + vb loss on the masked rows (each repeated diffusion_batch_mul times)."""
        cfg = self.config
        tokens = self.patchify(latents)
        N, L, C = tokens.shape
        device = tokens.device
        if mask_rate is None:
            mask_rate = truncated_mask_rate(cfg.mask_ratio_min, generator)
        n_masked = int(math.ceil(L * mask_rate))
        orders = torch.argsort(torch.rand(N, L, generator=generator), dim=1).to(device)
        mask = torch.zeros(N, L, dtype=torch.bool, device=device)
        mask.scatter_(1, orders[:, :n_masked], True)
        drop = (torch.rand(N, generator=generator) < cfg.label_drop_prob).to(device)
        z = self.forward_z(tokens, mask, self.class_embedding(labels, drop=drop))  # [N, L, Dd]
        target = tokens[mask].repeat(cfg.diffusion_batch_mul, 1)  # [M, C]
        z_rows = z[mask].repeat(cfg.diffusion_batch_mul, 1)  # [M, Dd]
        return self.diffloss.loss(target, z_rows, generator=generator).mean()


def truncated_mask_rate(mask_ratio_min: float, generator: Optional[torch.Generator] = None) -> float:
    """A draw from the normal (mean 1, std 0.25) truncated to [mask_ratio_min, 1], by inverse CDF."""
    lo = (mask_ratio_min - 1.0) / 0.25
    cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
    u = float(torch.rand((), generator=generator))
    p = cdf(lo) + u * (0.5 - cdf(lo))
    p = min(max(p, 1e-12), 0.5)
    return 1.0 + 0.25 * math.sqrt(2) * torch.erfinv(torch.tensor(2 * p - 1, dtype=torch.float64)).item()


def build_mar(name: str, **overrides) -> MAR:
    """A randomly initialised MAR: name "MAR-B" | "MAR-L" | "MAR-H" | "MAR-tiny" | "MAR-tiny-drafter";
    overrides replace MARConfig fields (e.g. diffloss_d, diffloss_w, num_sampling_steps, buffer_size)."""
    if name not in MAR_CONFIGS:
        raise ValueError(f"unknown MAR config {name!r}; choose from {sorted(MAR_CONFIGS)}")
    unknown = set(overrides) - set(MARConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown MARConfig fields: {sorted(unknown)}")
    return MAR(replace(MAR_CONFIGS[name], **overrides))
