"""Randomly initialised transformers image generators built in-process (no download): tiny ones for the tests
and the CPU benchmark, and the decoder shapes of Janus-Pro-1B and Chameleon-7B for the GPU benchmark.

The weights are drawn N(0, std^2) (``std`` larger than HF's initialiser range, so that a tiny model's
next-token distributions are far from uniform and its greedy tokens vary), norms kept at one. Only the
parts image generation uses have the named shapes; vision encoders and VQ decoders stay small.
"""
from __future__ import annotations

from typing import Dict

import torch

SHAPES: Dict[str, dict] = {
    # decoder sizes (hidden, layers, heads, kv heads, ffn, text vocab) and the image's codes / tokens
    "tiny": dict(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64, vocab=64, codes=48, side=4),
    "janus-pro-1b": dict(hidden=2048, layers=24, heads=16, kv_heads=16, ffn=5632, vocab=102400, codes=16384,
                         side=24),
    "chameleon-7b": dict(hidden=4096, layers=32, heads=32, kv_heads=32, ffn=11008, vocab=65536, codes=8192,
                         side=32),
}


def _shape(shape: str, overrides: dict) -> dict:
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    unknown = set(overrides) - set(SHAPES[shape])
    if unknown:
        raise ValueError(f"unknown shape fields {sorted(unknown)}; known: {sorted(SHAPES[shape])}")
    return {**SHAPES[shape], **overrides}


def _text(s: dict, vocab: int, **extra) -> dict:
    return dict(vocab_size=vocab, hidden_size=s["hidden"], intermediate_size=s["ffn"], num_hidden_layers=s["layers"],
                num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], max_position_embeddings=8192,
                **extra)


def janus_config(shape: str = "tiny", **overrides):
    """A JanusConfig: text vocabulary s["vocab"], image codes s["codes"] on a side x side grid. Special ids
    (tiny): BOS 1, pad 0, BOI vocab - 2, image placeholder vocab - 1."""
    from transformers import JanusConfig

    s = _shape(shape, overrides)
    side, vocab, proj = s["side"], s["vocab"], s["hidden"]
    return JanusConfig(
        text_config=dict(model_type="llama", **_text(s, vocab)),
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=4, image_size=side * 8,
                           patch_size=8, num_image_tokens=side * side, projection_dim=s["hidden"],
                           intermediate_size=64),
        vq_config=dict(embed_dim=8, num_embeddings=s["codes"], latent_channels=32, base_channels=32,
                       channel_multiplier=[1, 1], num_res_blocks=1, projection_dim=proj,
                       image_token_embed_dim=s["hidden"], num_hidden_layers=2),
        image_token_id=vocab - 1)


def janus_tokens(config) -> dict:
    """The ids wrap needs for a model of ``janus_config``."""
    vocab = config.text_config.vocab_size
    return dict(bos_token_id=1, boi_token_id=vocab - 2, pad_token_id=0)


def emu3_config(shape: str = "tiny", **overrides):
    """An Emu3Config whose vocabulary holds s["vocab"] text tokens, then the codes' visual tokens, then
    <|extra_200|> (row end), <|extra_201|> (end of frame), <|image start|>, <|image token|>, <image>."""
    from transformers import Emu3Config

    s = _shape(shape, overrides)
    n_text, codes = s["vocab"], s["codes"]
    vmap = {f"t{i}": i for i in range(n_text)}
    vmap.update({f"<|visual token {c:06d}|>": n_text + c for c in range(codes)})
    for j, name in enumerate(["<|extra_200|>", "<|extra_201|>", "<|image start|>", "<|image token|>", "<image>"]):
        vmap[name] = n_text + codes + j
    return Emu3Config(
        text_config=_text(s, len(vmap), pad_token_id=0, bos_token_id=1, eos_token_id=2),
        vq_config=dict(codebook_size=codes, embed_dim=4, latent_channels=4, base_channels=32,
                       channel_multiplier=[1, 1], num_res_blocks=1, attn_resolutions=[], hidden_size=32,
                       temporal_downsample_factor=1),
        vocabulary_map=vmap)


def chameleon_config(shape: str = "tiny", **overrides):
    """A ChameleonConfig whose vocabulary holds s["vocab"] text tokens (t1 = <racm3:break>, t2 = <eoss>, t4 =
    Lumina-mGPT's end of row <reserved08799>, t5..t8 its size tokens <reserved08801..4>), then the codes' IMGIMG
    tokens, then <image>."""
    from transformers import ChameleonConfig

    s = _shape(shape, overrides)
    n_text, codes = s["vocab"], s["codes"]
    letters = {str(i): chr(ord("A") + i) for i in range(10)}
    vmap = {f"t{i}": i for i in range(n_text)}
    vmap["<racm3:break>"], vmap["<eoss>"] = 1, 2
    # Lumina-mGPT's end of row and size tokens (<reserved{8800 + 32-pixel grids}>) for grids 1..4
    vmap.update({"<reserved08799>": 4, **{f"<reserved{8800 + g:05d}>": 4 + g for g in range(1, 5)}})
    vmap.update({"IMGIMG" + "".join(letters[d] for d in str(c)) + "Z": n_text + c for c in range(codes)})
    vmap["<image>"] = n_text + codes
    return ChameleonConfig(
        **_text(s, n_text + codes + 1), vocabulary_map=vmap,
        vq_config=dict(embed_dim=8, num_embeddings=codes, latent_channels=32, base_channels=32, resolution=32,
                       channel_multiplier=[1, 1], num_res_blocks=1))


def random_model(kind: str, shape: str = "tiny", *, seed: int = 0, std: float = 0.2, dtype=torch.float32,
                 device="cpu", attn_implementation: str = "sdpa", **overrides):
    """kind "janus" | "emu3" | "chameleon" -> the model in eval mode, weights N(0, std^2) (norm weights 1);
    overrides replace fields of the shape (codes=5, side=8, ...)."""
    import transformers

    configs = {"janus": (janus_config, transformers.JanusForConditionalGeneration),
               "emu3": (emu3_config, transformers.Emu3ForConditionalGeneration),
               "chameleon": (chameleon_config, transformers.ChameleonForConditionalGeneration)}
    if kind not in configs:
        raise ValueError(f"kind must be one of {sorted(configs)}, got {kind!r}")
    make_config, cls = configs[kind]
    config = make_config(shape, **overrides)
    config._attn_implementation = attn_implementation
    for sub in ("text_config", "vision_config", "vq_config"):
        if getattr(config, sub, None) is not None:
            getattr(config, sub)._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config).to(dtype)
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                continue
            p.copy_(torch.randn(p.shape, generator=generator, device=device) * std)
    return model.eval()
