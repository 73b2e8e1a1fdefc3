"""LlamaGen's VQ tokenizer (VQ-16: 16x downsampling, 16384 x 8 codebook), official key names, plus a
tiny configuration that shares the code. Stays float32. Key names: tests/models/test_gpt_state_dict.py.

Key layout (VQ-16): encoder.{conv_in, conv_blocks.{0..4}.{res.{j}, attn.{j}, downsample.conv}, mid.{0,1,2},
norm_out, conv_out}; decoder.{conv_in, mid.{0,1,2}, conv_blocks.{0..4}.{res.{j}, attn.{j}, upsample.conv},
norm_out, conv_out}; quantize.embedding.weight, quantize.codebook_used; quant_conv; post_quant_conv.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Dict, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class VQConfig:
    ch: int = 128
    ch_mult: Sequence[int] = (1, 1, 2, 2, 4)  # encoder and decoder; len - 1 downsamplings by 2
    z_channels: int = 256
    codebook_size: int = 16384
    codebook_embed_dim: int = 8
    num_res_blocks: int = 2  # encoder; the decoder has one more per level
    in_channels: int = 3
    out_channels: int = 3
    codebook_usage_len: int = 65536  # length of the persistent quantize.codebook_used buffer

    @property
    def downsample(self) -> int:
        return 2 ** (len(self.ch_mult) - 1)


VQ_CONFIGS: Dict[str, VQConfig] = {
    "VQ-16": VQConfig(),
    # 32x32 images -> 8x8 codes of a 1024 x 8 codebook (the GPT-tiny vocabulary).
    "VQ-tiny": VQConfig(ch=32, ch_mult=(1, 2, 2), z_channels=32, codebook_size=1024, num_res_blocks=1),
}


def swish(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(x)


def group_norm(channels: int) -> nn.GroupNorm:
    return nn.GroupNorm(num_groups=32, num_channels=channels, eps=1e-6, affine=True)


class ResnetBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int):
        super().__init__()
        self.norm1 = group_norm(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, 1, 1)
        self.norm2 = group_norm(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1)
        if in_channels != out_channels:
            self.nin_shortcut = nn.Conv2d(in_channels, out_channels, 1, 1, 0)

    def forward(self, x):
        h = self.conv1(swish(self.norm1(x)))
        h = self.conv2(swish(self.norm2(h)))
        if hasattr(self, "nin_shortcut"):
            x = self.nin_shortcut(x)
        return x + h


class AttnBlock(nn.Module):
    """Single-head self-attention over the h*w positions, 1x1 conv projections."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = group_norm(channels)
        self.q = nn.Conv2d(channels, channels, 1)
        self.k = nn.Conv2d(channels, channels, 1)
        self.v = nn.Conv2d(channels, channels, 1)
        self.proj_out = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        B, C, H, W = x.shape
        h = self.norm(x)
        q = self.q(h).reshape(B, C, H * W).permute(0, 2, 1)  # [B, HW, C]
        k = self.k(h).reshape(B, C, H * W)  # [B, C, HW]
        v = self.v(h).reshape(B, C, H * W)  # [B, C, HW]
        attn = torch.softmax(torch.bmm(q, k) * (int(C) ** -0.5), dim=2)  # [B, HW(q), HW(k)]
        out = torch.bmm(v, attn.permute(0, 2, 1)).reshape(B, C, H, W)
        return x + self.proj_out(out)


class Upsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 1, 1)

    def forward(self, x):
        x = F.interpolate(x.float(), scale_factor=2.0, mode="nearest").to(x.dtype)
        return self.conv(x)


class Downsample(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, 2, 0)

    def forward(self, x):
        return self.conv(F.pad(x, (0, 1, 0, 1), mode="constant", value=0))


class Encoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        ch, ch_mult, n_levels = cfg.ch, cfg.ch_mult, len(cfg.ch_mult)
        self.conv_in = nn.Conv2d(cfg.in_channels, ch, 3, 1, 1)
        in_ch_mult = (1,) + tuple(ch_mult)
        self.conv_blocks = nn.ModuleList()
        block_in = ch
        for level in range(n_levels):
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            block_in, block_out = ch * in_ch_mult[level], ch * ch_mult[level]
            for _ in range(cfg.num_res_blocks):
                block.res.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if level == n_levels - 1:
                    block.attn.append(AttnBlock(block_in))
            if level != n_levels - 1:
                block.downsample = Downsample(block_in)
            self.conv_blocks.append(block)
        self.mid = nn.ModuleList([ResnetBlock(block_in, block_in), AttnBlock(block_in),
                                  ResnetBlock(block_in, block_in)])
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, cfg.z_channels, 3, 1, 1)

    def forward(self, x):
        h = self.conv_in(x)
        for block in self.conv_blocks:
            h = _res_attn(block, h)
            if hasattr(block, "downsample"):
                h = block.downsample(h)
        for mid_block in self.mid:
            h = mid_block(h)
        return self.conv_out(swish(self.norm_out(h)))


def _res_attn(block: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """One resolution level: each res block, followed by its attention block where the level has them."""
    for j, res in enumerate(block.res):
        h = res(h)
        if len(block.attn) > 0:
            h = block.attn[j](h)
    return h


class Decoder(nn.Module):
    def __init__(self, cfg: VQConfig):
        super().__init__()
        ch, ch_mult, n_levels = cfg.ch, cfg.ch_mult, len(cfg.ch_mult)
        block_in = ch * ch_mult[-1]
        self.conv_in = nn.Conv2d(cfg.z_channels, block_in, 3, 1, 1)
        self.mid = nn.ModuleList([ResnetBlock(block_in, block_in), AttnBlock(block_in),
                                  ResnetBlock(block_in, block_in)])
        self.conv_blocks = nn.ModuleList()
        for level in reversed(range(n_levels)):  # conv_blocks.0 is the lowest resolution
            block = nn.Module()
            block.res, block.attn = nn.ModuleList(), nn.ModuleList()
            block_out = ch * ch_mult[level]
            for _ in range(cfg.num_res_blocks + 1):
                block.res.append(ResnetBlock(block_in, block_out))
                block_in = block_out
                if level == n_levels - 1:
                    block.attn.append(AttnBlock(block_in))
            if level != 0:
                block.upsample = Upsample(block_in)
            self.conv_blocks.append(block)
        self.norm_out = group_norm(block_in)
        self.conv_out = nn.Conv2d(block_in, cfg.out_channels, 3, 1, 1)

    def forward(self, z):
        h = self.conv_in(z)
        for mid_block in self.mid:
            h = mid_block(h)
        for block in self.conv_blocks:
            h = _res_attn(block, h)
            if hasattr(block, "upsample"):
                h = block.upsample(h)
        return self.conv_out(swish(self.norm_out(h)))


class VectorQuantizer(nn.Module):
    """Nearest L2-normalised codebook row. Only the lookups (no training losses)."""

    def __init__(self, codebook_size: int, embed_dim: int, usage_len: int = 65536):
        super().__init__()
        self.embedding = nn.Embedding(codebook_size, embed_dim)
        self.embedding.weight.data.uniform_(-1.0 / codebook_size, 1.0 / codebook_size)
        self.embedding.weight.data = F.normalize(self.embedding.weight.data, p=2, dim=-1)
        self.register_buffer("codebook_used", torch.zeros(usage_len))

    def codebook(self) -> torch.Tensor:
        return F.normalize(self.embedding.weight, p=2, dim=-1)  # [V, d]

    def nearest(self, z: torch.Tensor) -> torch.Tensor:
        """z [B, d, h, w] -> codes [B, h*w] int64 (raster order), nearest normalised row to normalised z."""
        B, d, h, w = z.shape
        flat = F.normalize(z.permute(0, 2, 3, 1).reshape(-1, d), p=2, dim=-1)  # [B*h*w, d]
        book = self.codebook()
        dist = (flat ** 2).sum(1, keepdim=True) + (book ** 2).sum(1) - 2 * flat @ book.t()  # [B*h*w, V]
        return dist.argmin(dim=1).view(B, h * w)

    def lookup(self, codes: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """codes [B, h*w] -> [B, d, h, w] normalised codebook rows."""
        B = codes.shape[0]
        rows = self.codebook()[codes.reshape(-1)]  # [B*h*w, d]
        return rows.view(B, h, w, -1).permute(0, 3, 1, 2).contiguous()


class VQModel(nn.Module):
    def __init__(self, cfg: VQConfig, decoder_only: bool = False):
        super().__init__()
        self.config = cfg
        self.decoder_only = decoder_only
        if not decoder_only:
            self.encoder = Encoder(cfg)
            self.quant_conv = nn.Conv2d(cfg.z_channels, cfg.codebook_embed_dim, 1)
        self.decoder = Decoder(cfg)
        self.quantize = VectorQuantizer(cfg.codebook_size, cfg.codebook_embed_dim, cfg.codebook_usage_len)
        self.post_quant_conv = nn.Conv2d(cfg.codebook_embed_dim, cfg.z_channels, 1)

    def encode_codes(self, images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] in [-1, 1] -> codes [B, (H/ds)*(W/ds)] int64 in raster order."""
        if self.decoder_only:
            raise RuntimeError("this VQ model was built decoder_only; it cannot encode")
        z = self.quant_conv(self.encoder(images))  # [B, d, h, w]
        return self.quantize.nearest(z)

    def decode(self, quant: torch.Tensor) -> torch.Tensor:
        """quant [B, d, h, w] -> images [B, 3, h*ds, w*ds], about [-1, 1]"""
        return self.decoder(self.post_quant_conv(quant))

    def decode_codes(self, codes: torch.Tensor, h: int, w: int) -> torch.Tensor:
        """codes [B, h*w] (raster order) -> images [B, 3, h*ds, w*ds], about [-1, 1]"""
        return self.decode(self.quantize.lookup(codes, h, w))

    @staticmethod
    def to_uint8(images: torch.Tensor) -> torch.Tensor:
        """images [B, 3, H, W] about [-1, 1] -> uint8 [B, H, W, 3] (LlamaGen: clamp(127.5 x + 128))."""
        return to_uint8(images)


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """images [B, 3, H, W] about [-1, 1] -> uint8 [B, H, W, 3] = clamp(127.5 x + 128, 0, 255), truncated."""
    return torch.clamp(127.5 * images + 128.0, 0, 255).permute(0, 2, 3, 1).to(torch.uint8)


def build_vq(name: str, decoder_only: bool = False, **overrides) -> VQModel:
    """A randomly initialised VQ tokenizer: name "VQ-16" or "VQ-tiny"; overrides replace VQConfig fields."""
    if name not in VQ_CONFIGS:
        raise ValueError(f"unknown VQ config {name!r}; choose from {sorted(VQ_CONFIGS)}")
    return VQModel(replace(VQ_CONFIGS[name], **overrides), decoder_only=decoder_only)
