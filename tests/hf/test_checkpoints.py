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


T2I = dict(block_size=16, n_layer=2, caption_dim=24, caption_len=6, norm_eps=EPS)


def their_t2i():
    """(their HF-converted LlamaGen T2I state dict, lantern's GPT loaded from it): caption_len 6."""
    cfg, g = build_gpt("GPT-tiny", "t2i", **T2I).config, torch.Generator().manual_seed(3)
    D, C = cfg.dim, cfg.caption_len
    sd = {"model.embed_tokens.weight": torch.randn(cfg.vocab_size, D, generator=g),
          "model.cls_embedding.cap_proj.fc1.weight": torch.randn(D, 24, generator=g) / 24 ** 0.5,
          "model.cls_embedding.cap_proj.fc2.weight": torch.randn(D, D, generator=g) / D ** 0.5,
          "model.cls_embedding.uncond_embedding": torch.randn(C, 24, generator=g),
          "model.norm.weight": 1 + 0.1 * torch.randn(D, generator=g),
          "lm_head.weight": torch.randn(cfg.vocab_size, D, generator=g) / D ** 0.5}
    for i in range(2):
        sd.update(layer_dict(f"model.layers.{i}.", D, cfg.ffn_hidden, g))
    return sd, load_llamagen_hf(sd, "GPT-tiny", "t2i", **T2I)


def their_t2i_hidden(sd, cfg, caption, tokens):
    """Their LlamaModel's post-norm hidden states over [caption; tokens]: caption features through cap_proj
    (GELU tanh MLP), image tokens through embed_tokens, zero RoPE rows for the caption positions, the layers,
    the final norm."""
    C, T = cfg.caption_len, tokens.shape[1]
    freqs = precompute_freqs_cis_2d(cfg.grid_size, cfg.head_dim, cfg.rope_base, C)[: C + T]
    cond = F.linear(F.gelu(F.linear(caption, sd["model.cls_embedding.cap_proj.fc1.weight"]), approximate="tanh"),
                    sd["model.cls_embedding.cap_proj.fc2.weight"])
    x = torch.cat([cond, sd["model.embed_tokens.weight"][tokens]], 1)
    for i in range(2):
        x = their_layer(sd, f"model.layers.{i}.", x, freqs, cfg.n_head, first_without_norm=False)
    return rms(x, sd["model.norm.weight"])


def test_their_llamagen_t2i_computes_what_their_code_computes():
    sd, model = their_t2i()
    cfg = model.config
    torch.manual_seed(4)
    caption, tokens = torch.randn(2, cfg.caption_len, 24), torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        theirs = F.linear(their_t2i_hidden(sd, cfg, caption, tokens), sd["lm_head.weight"])[:, cfg.caption_len - 1:]
        ours = model.forward_full(tokens, caption)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def their_t2i_drafter(sd, cfg, hidden, codes, n_layer):
    """Their T2I loop's drafter (``ea_model_llamagen.initialize_tree`` -> ``cnets_llamagen.Model``): input ids
    119 zeros then the image codes (here C - 1 zeros, C = caption_len), paired with the target's hidden states
    [caption; image tokens but the last], positions 0, 1, ... into their RoPE table of C - 1 zero rows
    (cls_token_num) then the grid; no attention mask but the causal one -> its layers' output at every
    position [R, C - 1 + n, D]."""
    R, n = codes.shape
    C = hidden.shape[1] - n + 1
    ids = torch.cat([torch.zeros(R, C - 1, dtype=torch.int64), codes], 1)
    freqs = precompute_freqs_cis_2d(cfg.grid_size, cfg.head_dim, cfg.rope_base, C - 1)[: C - 1 + n]
    x = F.linear(torch.cat([sd["embed_tokens.weight"][ids], hidden[:, : C - 1 + n]], -1), sd["fc.weight"],
                 sd["fc.bias"])
    for i in range(n_layer):
        x = their_layer(sd, f"layers.{i}.", x, freqs, cfg.n_head, first_without_norm=i == 0)
    return x


def test_their_t2i_drafter_attends_to_the_caption_as_their_loop_feeds_it():
    """lantern's loop interface (the target's prefill, drafter.reset, commit of the first image codes) against
    their code's drafter over the whole sequence: the caption prefix (the target's hidden states over C - 1
    caption positions with code 0's embedding, zero RoPE) and the image positions. The root state depends on
    the caption through that prefix: a second caption with the same image-side features changes it, and the
    same weights without attend_condition ignore the caption (negative control)."""
    sd, target = their_t2i()
    cfg = target.config
    dsd = drafter_dict(target, 2)
    drafter = load_lantern_drafter(dsd, target, norm_eps=EPS)
    assert drafter.attend_condition and drafter.prefix_len == cfg.caption_len - 1
    torch.manual_seed(5)
    R, C, n = 2, cfg.caption_len, 4
    codes = torch.randint(0, cfg.vocab_size, (R, n))

    def drafter_root(d, caption, features=None):
        """-> (root state [R, D] after committing the codes, the hidden states their code sees)."""
        with torch.no_grad():
            target.setup_cache(R, C + cfg.block_size)
            target(None, caption, cache_len=torch.zeros(R, dtype=torch.int64))
            theirs = their_t2i_hidden(sd, cfg, caption, codes[:, :-1])  # [R, C + n - 1, D]
            torch.testing.assert_close(target.condition_hidden, theirs[:, :C], rtol=1e-4, atol=1e-4)
            feats = theirs[:, C - 1:] if features is None else features  # the hidden state before each code
            d.reset(caption, R, 32)
            positions = torch.arange(n).expand(R, n)
            _, root = d.commit(codes, feats, torch.full((R,), n), positions)
            target.free_cache()
        return root, theirs

    caption = torch.randn(R, C, 24)
    root, theirs = drafter_root(drafter, caption)
    with torch.no_grad():
        expected = their_t2i_drafter(dsd, cfg, theirs, codes, 2)[:, -1]  # no final norm (EAGLE-1)
    torch.testing.assert_close(root, expected, rtol=1e-4, atol=1e-4)
    with torch.no_grad():  # training sees the same sequence
        trained = drafter.forward_train(codes, theirs[:, C - 1:], condition_hidden=theirs[:, :C])
        whole = their_t2i_drafter(dsd, cfg, theirs, codes, 2)[:, C - 1:]
    torch.testing.assert_close(trained, whole, rtol=1e-4, atol=1e-4)

    other_root, _ = drafter_root(drafter, torch.randn(R, C, 24), features=theirs[:, C - 1:])
    assert (other_root - root).abs().max() > 1e-3  # the caption reaches the drafter through the prefix

    blind = load_lantern_drafter(dsd, target, norm_eps=EPS, attend_condition=False)
    blind_root, _ = drafter_root(blind, caption)
    blind_other, _ = drafter_root(blind, torch.randn(R, C, 24), features=theirs[:, C - 1:])
    torch.testing.assert_close(blind_other, blind_root, rtol=0, atol=0)  # without it: no caption dependence
    assert (blind_root - expected).abs().max() > 1e-3


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


def test_a_caption_attending_drafter_keeps_speculative_decoding_exact():
    """Greedy exact speculative decoding with their T2I drafter (caption prefix, ragged caption padding)
    equals greedy AR: the drafter changes how many tokens a step accepts, never which."""
    import lantern

    _, target = their_t2i()
    drafter = load_lantern_drafter(drafter_dict(target, 1), target, norm_eps=EPS)
    torch.manual_seed(6)
    caption = torch.randn(2, target.config.caption_len, 24)
    masks = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
    kw = dict(cfg_scale=2.0, temperature=0, emb_masks=masks, compile=False)
    ar, _ = lantern.generate(target, caption, method="ar", **kw)
    spec, stats = lantern.generate(target, caption, method="spec", drafter=drafter, tree="chain", depth=3, **kw)
    assert spec.tolist() == ar.tolist() and stats.draft_forwards > 0
