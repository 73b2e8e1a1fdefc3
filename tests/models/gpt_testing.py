"""Helpers shared by the model tests: small random GPTs with non-trivial weights."""
import torch

from lantern.models import build_gpt

SMALL = dict(n_layer=2, n_head=2, dim=64, vocab_size=64, num_classes=5, block_size=16)  # 4x4 image, Dh 32


def randomize(model, seed=0, std=0.1):
    """Every parameter and persistent buffer random (the official init zeroes the output head)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("norm.weight") or ".attention_norm." in name or ".ffn_norm." in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
            else:
                t.copy_(std * torch.randn(t.shape, generator=gen))
    return model


def small_gpt(seed=0, model_type="c2i", **overrides):
    cfg = dict(SMALL, **overrides)
    torch.manual_seed(seed)
    return randomize(build_gpt("GPT-tiny", model_type=model_type, **cfg), seed).eval()
