"""State-dict names and shapes of every GPT size and the VQ-16 tokenizer, built on the meta device."""
import pytest
import torch

from lantern.models import GPT_CONFIGS, build_gpt, build_vq

SIZES = {"GPT-B": (12, 12, 768), "GPT-L": (24, 16, 1024), "GPT-XL": (36, 20, 1280),
         "GPT-XXL": (48, 24, 1536), "GPT-3B": (24, 32, 3200)}


def meta_state(name, **kw):
    with torch.device("meta"):
        model = build_gpt(name, **kw)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}, model


def round_up(x, m):
    return -(-x // m) * m


def expected_gpt_keys(n_layer, dim, vocab, hidden, cond_keys):
    keys = dict(cond_keys)
    keys["tok_embeddings.weight"] = (vocab, dim)
    for i in range(n_layer):
        keys[f"layers.{i}.attention.wqkv.weight"] = (3 * dim, dim)
        keys[f"layers.{i}.attention.wo.weight"] = (dim, dim)
        keys[f"layers.{i}.feed_forward.w1.weight"] = (hidden, dim)
        keys[f"layers.{i}.feed_forward.w3.weight"] = (hidden, dim)
        keys[f"layers.{i}.feed_forward.w2.weight"] = (dim, hidden)
        keys[f"layers.{i}.attention_norm.weight"] = (dim,)
        keys[f"layers.{i}.ffn_norm.weight"] = (dim,)
    keys["norm.weight"] = (dim,)
    keys["output.weight"] = (vocab, dim)
    return keys


def test_gpt_b_c2i_exact_keys():
    state, model = meta_state("GPT-B")
    assert len(state) == 88
    assert state["cls_embedding.embedding_table.weight"] == (1001, 768)
    assert state["tok_embeddings.weight"] == (16384, 768)
    assert state["layers.0.attention.wqkv.weight"] == (2304, 768)
    assert state["layers.11.feed_forward.w1.weight"] == (2048, 768)
    assert state["layers.11.feed_forward.w2.weight"] == (768, 2048)
    assert state == expected_gpt_keys(12, 768, 16384, 2048, {"cls_embedding.embedding_table.weight": (1001, 768)})
    assert model.config.ffn_hidden == 2048
    assert not any(p.dim() == 1 and "norm" not in n for n, p in model.named_parameters())  # no biases


@pytest.mark.parametrize("name", sorted(SIZES))
def test_every_size_c2i(name):
    n_layer, n_head, dim = SIZES[name]
    cfg = GPT_CONFIGS[name]
    assert (cfg.n_layer, cfg.n_head, cfg.dim, cfg.vocab_size) == (n_layer, n_head, dim, 16384)
    hidden = round_up(int(8 * dim / 3), 256)
    state, model = meta_state(name)
    assert len(state) == 7 * n_layer + 4
    assert state == expected_gpt_keys(n_layer, dim, 16384, hidden,
                                      {"cls_embedding.embedding_table.weight": (1001, dim)})
    assert model.freqs_cis.shape == (1 + 256, dim // n_head // 2, 2)


def test_3b_head_dim_and_hidden():
    state, model = meta_state("GPT-3B")
    assert model.config.head_dim == 100
    assert state["layers.0.feed_forward.w1.weight"] == (8704, 3200)


def test_t2i_xl_keys():
    state, model = meta_state("GPT-XL", model_type="t2i")
    cond = {"cls_embedding.cap_proj.fc1.weight": (1280, 2048), "cls_embedding.cap_proj.fc2.weight": (1280, 1280),
            "cls_embedding.uncond_embedding": (120, 2048)}
    assert state == expected_gpt_keys(36, 1280, 16384, 3584, cond)
    assert model.cond_len == 120 and model.freqs_cis.shape == (120 + 256, 32, 2)


def test_block_size_and_tiny():
    _, model = meta_state("GPT-L", block_size=576)
    assert model.freqs_cis.shape == (1 + 576, 32, 2)
    state, tiny = meta_state("GPT-tiny")
    cfg = tiny.config
    assert cfg.block_size == 64 and cfg.vocab_size == 1024
    assert state["cls_embedding.embedding_table.weight"] == (11, 256)
    with pytest.raises(ValueError):
        build_gpt("GPT-tiny", block_size=60)  # not a square grid
    with pytest.raises(ValueError):
        build_gpt("GPT-nope")


def test_buffers_never_in_state_dict():
    model = build_gpt("GPT-tiny", n_layer=1)
    model.setup_cache(2, 80)
    keys = set(model.state_dict())
    assert not any("freqs_cis" in k or "kv_cache" in k for k in keys)
    assert model.kv_cache.shape == (1, 2, 2, 4, 80, 64)


def test_vq16_keys_and_channel_plan():
    with torch.device("meta"):
        vq = build_vq("VQ-16")
    state = {k: tuple(v.shape) for k, v in vq.state_dict().items()}
    assert state["quantize.embedding.weight"] == (16384, 8)
    assert state["quantize.codebook_used"] == (65536,)
    assert state["post_quant_conv.weight"] == (256, 8, 1, 1) and state["post_quant_conv.bias"] == (256,)
    assert state["quant_conv.weight"] == (8, 256, 1, 1)
    assert state["decoder.conv_in.weight"] == (512, 256, 3, 3)
    for m in ("0", "2"):
        assert state[f"decoder.mid.{m}.conv1.weight"] == (512, 512, 3, 3)
    for p in ("norm", "q", "k", "v", "proj_out"):
        assert f"decoder.mid.1.{p}.weight" in state and f"decoder.mid.1.{p}.bias" in state
    plan = [(512, 512, True, True), (512, 256, False, True), (256, 256, False, True), (256, 128, False, True),
            (128, 128, False, False)]  # (in, out, attn, upsample) of decoder.conv_blocks.{i}
    for i, (c_in, c_out, attn, up) in enumerate(plan):
        pre = f"decoder.conv_blocks.{i}"
        assert state[f"{pre}.res.0.conv1.weight"] == (c_out, c_in, 3, 3)
        assert (f"{pre}.res.0.nin_shortcut.weight" in state) == (c_in != c_out)
        for j in range(3):
            assert state[f"{pre}.res.{j}.conv2.weight"] == (c_out, c_out, 3, 3)
            assert state[f"{pre}.res.{j}.norm1.bias"] == ((c_in if j == 0 else c_out),)
            assert (f"{pre}.attn.{j}.q.weight" in state) == attn
        assert f"{pre}.res.3.conv1.weight" not in state
        assert (f"{pre}.upsample.conv.weight" in state) == up
    assert state["decoder.norm_out.weight"] == (128,)
    assert state["decoder.conv_out.weight"] == (3, 128, 3, 3) and state["decoder.conv_out.bias"] == (3,)
    # encoder mirror (official vq_model.py layout)
    assert state["encoder.conv_in.weight"] == (128, 3, 3, 3)
    assert state["encoder.conv_blocks.2.res.0.nin_shortcut.weight"] == (256, 128, 1, 1)
    assert state["encoder.conv_blocks.4.attn.1.proj_out.weight"] == (512, 512, 1, 1)
    assert [f"encoder.conv_blocks.{i}.downsample.conv.weight" in state for i in range(5)] == [True] * 4 + [False]
    assert state["encoder.conv_out.weight"] == (256, 512, 3, 3)
    assert sum(1 for k in state if k.startswith("decoder.")) == 6 + (8 + 10 + 8) + sum(
        3 * 8 + (2 if c_in != c_out else 0) + (2 if up else 0) + (3 * 10 if attn else 0)
        for c_in, c_out, attn, up in plan)
    n_params = sum(v.numel() for k, v in vq.state_dict().items() if k != "quantize.codebook_used")
    assert 71e6 < n_params < 73e6  # the paper's 72M
