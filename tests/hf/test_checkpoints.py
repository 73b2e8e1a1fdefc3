"""The LANTERN authors' LlamaGen checkpoints in lantern's classes (lantern.hf.checkpoints): state dicts built
with their key names and shapes, and a forward written from their model code (Hugging Face Llama names,
LlamaGen's interleaved 2D RoPE, the EAGLE-1 drafter with no input norm in its first layer and no final norm),
against lantern's GPT and ``EagleDrafter(layout="eagle1")``. Negative control: the same drafter weights in
lantern's own layout compute something else. Unknown, missing and misshapen keys are named."""
import math

import pytest
import torch
import torch.nn.functional as F

from lantern.hf.checkpoints import load_lantern_drafter, load_llamagen_hf
from lantern.models import build_gpt
from lantern.models.drafter import EagleDrafter
from lantern.models.gpt import precompute_freqs_cis_2d

EPS = 1e-6


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def rope(x, freqs):  # x [B, T, H, hd], freqs [T, hd/2, 2]: LlamaGen's apply_rotary_emb
    xs = x.reshape(*x.shape[:-1], -1, 2)
    f = freqs[None, :, None]
    return torch.stack([xs[..., 0] * f[..., 0] - xs[..., 1] * f[..., 1],
                        xs[..., 1] * f[..., 0] + xs[..., 0] * f[..., 1]], -1).flatten(3)


def their_layer(sd, prefix, x, freqs, heads, first_without_norm):
    """One decoder layer of their code: [input_layernorm], attention, residual, post_attention_layernorm, MLP."""
    B, T, D = x.shape
    h = x if first_without_norm else rms(x, sd[f"{prefix}input_layernorm.weight"])
    q, k, v = (F.linear(h, sd[f"{prefix}self_attn.{n}_proj.weight"]).view(B, T, heads, -1) for n in "qkv")
    q, k = rope(q, freqs), rope(k, freqs)
    scores = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(D // heads)
    scores = scores.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
    att = torch.einsum("bhts,bshd->bthd", scores.softmax(-1), v).reshape(B, T, D)
    x = x + F.linear(att, sd[f"{prefix}self_attn.o_proj.weight"])
    h = rms(x, sd[f"{prefix}post_attention_layernorm.weight"])
    gate = F.silu(F.linear(h, sd[f"{prefix}mlp.gate_proj.weight"]))
    mlp = F.linear(gate * F.linear(h, sd[f"{prefix}mlp.up_proj.weight"]), sd[f"{prefix}mlp.down_proj.weight"])
    return x + mlp


def layer_dict(prefix, D, ffn, g, first_without_norm=False):
    sd = {f"{prefix}self_attn.{n}_proj.weight": torch.randn(D, D, generator=g) / D ** 0.5 for n in "qkvo"}
    sd.update({f"{prefix}mlp.gate_proj.weight": torch.randn(ffn, D, generator=g) / D ** 0.5,
               f"{prefix}mlp.up_proj.weight": torch.randn(ffn, D, generator=g) / D ** 0.5,
               f"{prefix}mlp.down_proj.weight": torch.randn(D, ffn, generator=g) / ffn ** 0.5,
               f"{prefix}post_attention_layernorm.weight": 1 + 0.1 * torch.randn(D, generator=g)})
    if not first_without_norm:
        sd[f"{prefix}input_layernorm.weight"] = 1 + 0.1 * torch.randn(D, generator=g)
    return sd


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    model = build_gpt("GPT-tiny", block_size=16, n_layer=2)
    with torch.no_grad():
        model.output.weight.normal_(0, 0.05)
    return model.eval()


def drafter_dict(target, n_layer):
    cfg, g = target.config, torch.Generator().manual_seed(1)
    D = cfg.dim
    sd = {"fc.weight": torch.randn(D, 2 * D, generator=g) / (2 * D) ** 0.5,
          "fc.bias": 0.1 * torch.randn(D, generator=g),
          "embed_tokens.weight": target.tok_embeddings.weight.detach().clone()}
    for i in range(n_layer):
        sd.update(layer_dict(f"layers.{i}.", D, cfg.ffn_hidden, g, first_without_norm=i == 0))
    return sd


@pytest.mark.parametrize("n_layer", [1, 2])
def test_their_drafter_computes_what_their_code_computes(target, n_layer):
    sd = drafter_dict(target, n_layer)
    drafter = load_lantern_drafter(sd, target)
    cfg = target.config
    torch.manual_seed(2)
    tokens = torch.randint(0, cfg.vocab_size, (3, 16))
    features = torch.randn(3, 16, cfg.dim)
    freqs = precompute_freqs_cis_2d(cfg.grid_size, cfg.head_dim, cfg.rope_base, 0)[:16]
    with torch.no_grad():
        x = F.linear(torch.cat([sd["embed_tokens.weight"][tokens], features], -1), sd["fc.weight"], sd["fc.bias"])
        for i in range(n_layer):
            x = their_layer(sd, f"layers.{i}.", x, freqs, cfg.n_head, first_without_norm=i == 0)
        ours = drafter.forward_train(tokens, features)
    torch.testing.assert_close(ours, x, rtol=1e-5, atol=1e-5)  # no final norm: the layers' output
    assert "norm.weight" not in drafter.state_dict() and "layers.0.attention_norm.weight" not in drafter.state_dict()

    lantern_layout = EagleDrafter(cfg, n_layer=n_layer)  # negative control: input norm everywhere, a final norm
    mapped = {k: v for k, v in drafter.state_dict().items()}
    mapped.update({"norm.weight": torch.ones(cfg.dim), "layers.0.attention_norm.weight": torch.ones(cfg.dim)})
    lantern_layout.load_state_dict(mapped)
    with torch.no_grad():
        other = lantern_layout.bind(target).forward_train(tokens, features)
    assert (other - x).abs().max() > 1e-2


def test_their_llamagen_t2i_computes_what_their_code_computes():
    """Their LlamaModel: caption features through cap_proj (GELU tanh MLP), image tokens through
    embed_tokens, zero RoPE rows for the caption positions, the layers, the final norm, lm_head."""
    lantern_gpt = build_gpt("GPT-tiny", "t2i", block_size=16, n_layer=2, caption_dim=24, caption_len=6, norm_eps=EPS)
    cfg, g = lantern_gpt.config, torch.Generator().manual_seed(3)
    D, C = cfg.dim, cfg.caption_len
    sd = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, D, generator=g),
          "model.cls_embedding.cap_proj.fc1.weight": torch.randn(D, 24, generator=g) / 24 ** 0.5,
          "model.cls_embedding.cap_proj.fc2.weight": torch.randn(D, D, generator=g) / D ** 0.5,
          "model.cls_embedding.uncond_embedding": torch.randn(C, 24, generator=g),
          "model.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
          "lm_head.weight": torch.randn(cfg.vocab_size, D, generator=g) / D ** 0.5}
    for i in range(2):
        sd.update(layer_dict(f"model.layers.{i}.", D, cfg.ffn_hidden, g))
    model = load_llamagen_hf(sd, "GPT-tiny", "t2i", block_size=16, n_layer=2, caption_dim=24, caption_len=6,
                             norm_eps=EPS)
    torch.manual_seed(4)
    caption, tokens = torch.randn(2, C, 24), torch.randint(0, cfg.vocab_size, (2, 10))
    freqs = precompute_freqs_cis_2d(cfg.grid_size, cfg.head_dim, cfg.rope_base, C)[: C + 10]
    with torch.no_grad():
        cond = F.linear(F.gelu(F.linear(caption, sd["model.cls_embedding.cap_proj.fc1.weight"]), approximate="tanh"),
                        sd["model.cls_embedding.cap_proj.fc2.weight"])
        x = torch.cat([cond, sd["model.embed_tokens.weight"][tokens]], 1)
        for i in range(2):
            x = their_layer(sd, f"model.layers.{i}.", x, freqs, cfg.n_head, first_without_norm=False)
        theirs = F.linear(rms(x, sd["model.norm.weight"]), sd["lm_head.weight"])[:, C - 1:]
        ours = model.forward_full(tokens, caption)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_other_layouts_are_named(target):
    sd = drafter_dict(target, 1)
    with pytest.raises(ValueError, match="medusa_head"):
        load_lantern_drafter({**sd, "medusa_head.0.weight": torch.zeros(1)}, target)
    partial = {k: v for k, v in sd.items() if k != "layers.0.self_attn.k_proj.weight"}
    with pytest.raises(ValueError, match="k_proj"):
        load_lantern_drafter(partial, target)
    with pytest.raises(ValueError, match="another checkpoint"):
        load_lantern_drafter({**sd, "embed_tokens.weight": torch.zeros_like(sd["embed_tokens.weight"])}, target)
    misshapen = {**sd, "fc.bias": torch.zeros(3)}
    with pytest.raises(ValueError, match="fc.bias"):
        load_lantern_drafter(misshapen, target)
    with pytest.raises(ValueError, match="tok_embeddings|missing"):
        load_llamagen_hf({"lm_head.weight": torch.zeros(2, 2)}, "GPT-tiny")
    with pytest.raises(ValueError, match="layout"):
        EagleDrafter(target.config, layout="eagle3")
