"""Small random GPT targets with their EAGLE drafters for the decoding and CLI tests, and a VQ stand-in."""
from __future__ import annotations

import torch

from lantern.models import build_gpt
from lantern.models.drafter import EagleDrafter


def small_models(seed: int = 0, dtype: torch.dtype = torch.float32):
    """(target, drafter): a 2-layer GPT (vocab 64, 5 classes, 16 tokens) and its bound EAGLE drafter, weights
    drawn from N(0, 0.1^2) in float32 under ``seed``, then cast to ``dtype``; both in eval mode."""
    torch.manual_seed(seed)
    target = build_gpt("GPT-tiny", n_layer=2, n_head=2, dim=64, vocab_size=64, num_classes=5, block_size=16)
    drafter = EagleDrafter(target.config).bind(target)
    for p in (*target.parameters(), *drafter.parameters()):
        torch.nn.init.normal_(p, std=0.1)
    return target.to(dtype).eval(), drafter.to(dtype).eval()


class StubVQ:
    """decode_codes / to_uint8 of a VQ, enough for the CLI to write its grid."""

    def decode_codes(self, tokens, h, w):
        return torch.zeros(tokens.shape[0], 3, 4 * h, 4 * w)

    def to_uint8(self, images):
        return images.permute(0, 2, 3, 1).to(torch.uint8)  # [B, H, W, 3]
