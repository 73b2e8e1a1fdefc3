"""The KL autoencoder MAR uses for its continuous tokens (KL-16: 256 px -> 16 x 16 x 16 latents), official key
names, plus a tiny configuration (32 px -> 8 x 8 x 16) for the project's continuous default. Float32.

Layout (KL-16, ch 128, ch_mult (1, 1, 2, 2, 4), 2 res blocks per level): encoder.{conv_in, down.{i}.{block.{j},
attn.{j} (levels in ``encoder_attn_levels``), downsample.conv}, mid.{block_1, attn_1, block_2}, norm_out,
conv_out (2 z_channels: mean and log-variance)}; decoder.{conv_in, mid.*, up.{i}.{block.{0..2}, attn.{j}
(levels in ``decoder_attn_levels``: none for KL-16), upsample.conv}, norm_out, conv_out}; quant_conv (2z -> 2e),
post_quant_conv (e -> z). ``up.{i}`` is level i; the decoder runs the levels from the last to up.0.

``encode(images in [-1, 1])`` gives the diagonal Gaussian posterior (log-variance clamped to [-30, 20]);
MAR trains on ``posterior.sample() * scale`` (scale 0.2325 for KL-16) and decodes ``decode(tokens / scale)``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Optional, Sequence

import torch
import torch.nn as nn

from .vq import AttnBlock, Downsample, ResnetBlock, Upsample, group_norm, swish

KL16_SCALE = 0.2325


@dataclass(frozen=True)
class VAEConfig:
    ch: int = 128
    ch_mult: Sequence[int] = (1, 1, 2, 2, 4)
    num_res_blocks: int = 2  # encoder; the decoder has one more per level
    z_channels: int = 16
    embed_dim: int = 16
    in_channels: int = 3
    out_channels: int = 3
    encoder_attn_levels: Sequence[int] = (4,)  # the 16 x 16 level of a 256 px input
    decoder_attn_levels: Sequence[int] = ()
    scale: float = KL16_SCALE  # latent multiplier for the generator

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


VAE_CONFIGS: Dict[str, VAEConfig] = {
    "KL-16": VAEConfig(),
    # the tiny continuous default: 32 x 32 -> 8 x 8 x 16; its scale is measured on the training set
    "KL-tiny": VAEConfig(ch=32, ch_mult=(1, 2, 2), num_res_blocks=1, encoder_attn_levels=(), scale=1.0),
}


def _level(block_in: int, block_out: int, n_blocks: int, with_attn: bool) -> nn.Module:
    level = nn.Module()
    level.block = nn.ModuleList()
    level.attn = nn.ModuleList()
    for _ in range(n_blocks):
        level.block.append(ResnetBlock(block_in, block_out))
        block_in = block_out
        if with_attn:
            level.attn.append(AttnBlock(block_out))
    return level


def _run_level(level: nn.Module, h: torch.Tensor) -> torch.Tensor:
    for j, block in enumerate(level.block):
        h = block(h)
        if len(level.attn) > 0:
            h = level.attn[j](h)
    return h


def _mid(channels: int) -> nn.Module:
    mid = nn.Module()
    mid.block_1 = ResnetBlock(channels, channels)
    mid.attn_1 = AttnBlock(channels)
    mid.block_2 = ResnetBlock(channels, channels)
    return mid


class Encoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        ch, mult = cfg.ch, tuple(cfg.ch_mult)
        self.conv_in = nn.Conv2d(cfg.in_channels, ch, 3, 1, 1)
        in_mult = (1,) + mult
        self.down = nn.ModuleList()
        for i in range(len(mult)):
            level = _level(ch * in_mult[i], ch * mult[i], cfg.num_res_blocks, i in cfg.encoder_attn_levels)
            if i != len(mult) - 1:
                level.downsample = Downsample(ch * mult[i])
            self.down.append(level)
        block_in = ch * mult[-1]
        self.mid = _mid(block_in)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, 2 * cfg.z_channels, 3, 1, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(x)
        for level in self.down:
            h = _run_level(level, h)
            if hasattr(level, "downsample"):
                h = level.downsample(h)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        return self.conv_out(swish(self.norm_out(h)))


class Decoder(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        ch, mult = cfg.ch, tuple(cfg.ch_mult)
        block_in = ch * mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, block_in, 3, 1, 1)
        self.mid = _mid(block_in)
        levels = []
        for i in reversed(range(len(mult))):
            level = _level(block_in, ch * mult[i], cfg.num_res_blocks + 1, i in cfg.decoder_attn_levels)
            block_in = ch * mult[i]
            if i != 0:
                level.upsample = Upsample(block_in)
            levels.insert(0, level)
        self.up = nn.ModuleList(levels)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, cfg.out_channels, 3, 1, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        h = self.conv_in(z)
        h = self.mid.block_2(self.mid.attn_1(self.mid.block_1(h)))
        for level in reversed(self.up):
            h = _run_level(level, h)
            if hasattr(level, "upsample"):
                h = level.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class DiagonalGaussian:
    """The posterior: mean and log-variance [N, e, h, w], log-variance clamped to [-30, 20]."""

    def __init__(self, moments: torch.Tensor):
        self.mean, logvar = moments.chunk(2, dim=1)
        self.logvar = logvar.clamp(-30.0, 20.0)
        self.std = torch.exp(0.5 * self.logvar)

    def sample(self, generator: Optional[torch.Generator] = None) -> torch.Tensor:
        noise = torch.randn(self.mean.shape, generator=generator, dtype=self.mean.dtype).to(self.mean.device)
        return self.mean + self.std * noise

    def mode(self) -> torch.Tensor:
        return self.mean

    def kl(self) -> torch.Tensor:
        """KL to N(0, 1), summed over channels and positions -> [N]."""
        return 0.5 * (self.mean ** 2 + self.logvar.exp() - 1.0 - self.logvar).sum(dim=(1, 2, 3))


class AutoencoderKL(nn.Module):
    def __init__(self, cfg: VAEConfig):
        super().__init__()
        self.config = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.quant_conv = nn.Conv2d(2 * cfg.z_channels, 2 * cfg.embed_dim, 1)
        self.post_quant_conv = nn.Conv2d(cfg.embed_dim, cfg.z_channels, 1)

    @property
    def scale(self) -> float:
        return self.config.scale

    def encode(self, images: torch.Tensor) -> DiagonalGaussian:
        """images [N, 3, H, W] in [-1, 1] -> the posterior over [N, embed_dim, H/ds, W/ds] (unscaled)."""
        return DiagonalGaussian(self.quant_conv(self.encoder(images)))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """unscaled latents [N, embed_dim, h, w] -> images [N, 3, h*ds, w*ds], about [-1, 1]."""
        return self.decoder(self.post_quant_conv(latents))

    def decode_tokens(self, scaled_latents: torch.Tensor) -> torch.Tensor:
        """MAR's output (latents times ``scale``) -> images."""
        return self.decode(scaled_latents / self.scale)


def build_vae(name: str = "KL-16", **overrides) -> AutoencoderKL:
    """A randomly initialised autoencoder: "KL-16" or "KL-tiny"; overrides replace VAEConfig fields."""
    if name not in VAE_CONFIGS:
        raise ValueError(f"unknown VAE config {name!r}; choose from {sorted(VAE_CONFIGS)}")
    return AutoencoderKL(replace(VAE_CONFIGS[name], **overrides))
