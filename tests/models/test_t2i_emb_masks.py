"""t2i caption padding (``emb_masks``): the cached forward (prefill, AR steps, chains, trees) and the
no-cache forward equal a literal re-derivation of LlamaGen's masked attention (dense boolean mask:
causal, times emb_masks on the caption columns, diagonal kept); left padding is the same as no padding
at all; all-ones masks are exactly no mask; bad masks raise."""
import pytest
import torch
import torch.nn.functional as F

import lantern
from gpt_testing import small_gpt
from lantern.models.gpt import apply_rope

C = 8  # caption positions
CAPTION_DIM = 12
ATOL = 1e-4
BACKENDS = ["reference", "cpu"]


def t2i_gpt(seed=0, caption_len=C, **overrides):
    return small_gpt(seed, model_type="t2i", caption_len=caption_len, caption_dim=CAPTION_DIM, **overrides)


def left_padded(n_real):
    """[B, C] int64 masks: row b has n_real[b] real positions at the end (LlamaGen pads on the left)."""
    return (torch.arange(C)[None, :] >= C - torch.tensor(n_real)[:, None]).to(torch.int64)


# masks per row: left padding of 0, 3, 7 and all 8 positions, right padding, holes
MASKS = torch.cat([left_padded([8, 5, 1, 0]), torch.tensor([[1, 1, 1, 1, 1, 0, 0, 0], [0, 1, 0, 1, 1, 0, 1, 1]])])


def captions_for(masks, seed=0):
    """Caption features zeroed at the padded positions, as LlamaGen's sampler feeds them."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(masks.shape[0], C, CAPTION_DIM, generator=gen) * masks[..., None]


@pytest.fixture(params=BACKENDS)
def backend(request):
    if request.param == "reference":
        yield request.param
        return
    with lantern.fused(request.param):
        yield request.param


def official_mask(emb_masks, n):
    """LlamaGen's generate(): a causal bool mask, the caption columns times emb_masks, then the diagonal set
    (mask * (1 - eye) + eye) -> [B, n, n] bool."""
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool)).unsqueeze(0).repeat(emb_masks.shape[0], 1, 1)
    mask[:, :, :C] = mask[:, :, :C] * emb_masks.unsqueeze(1)
    eye = torch.eye(n, n)
    return (mask * (1 - eye) + eye).bool()


@torch.no_grad()
def dense_logits(model, captions, tokens, emb_masks):
    """The whole sequence [C caption positions] + tokens through every layer with SDPA and an explicit
    boolean mask (no cache, no tree ops) -> logits [B, 1 + T, V] from the last caption position on."""
    x = torch.cat([model.embed_condition(captions), model.tok_embeddings(tokens)], dim=1)  # [B, n, dim]
    B, n, _ = x.shape
    mask = official_mask(emb_masks, n)[:, None]  # [B, 1, n, n]
    rope = model.freqs_cis[None, :n]
    for layer in model.layers:
        att = layer.attention
        H, Hkv, Dh = att.n_head, att.n_kv_head, att.head_dim
        q, k, v = att.wqkv(layer.attention_norm(x)).split([H * Dh, Hkv * Dh, Hkv * Dh], dim=-1)
        q = apply_rope(q.view(B, n, H, Dh), rope).transpose(1, 2)  # [B, H, n, Dh]
        k = apply_rope(k.view(B, n, Hkv, Dh), rope).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        v = v.view(B, n, Hkv, Dh).transpose(1, 2).repeat_interleave(H // Hkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, n, Dh]
        x = x + att.wo(out.transpose(1, 2).reshape(B, n, H * Dh))
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.output(model.norm(x[:, C - 1:])).float()


@pytest.fixture(scope="module")
def model():
    return t2i_gpt(0)


def test_the_condition_keys_are_zero_so_padding_can_be_dropped(model):
    """The premise of dropping padded keys from the cache (and of left-padding invariance): the caption
    positions' RoPE rows are zero, so their keys are zero at every layer whatever the position."""
    assert torch.equal(model.freqs_cis[:C], torch.zeros_like(model.freqs_cis[:C]))


@torch.no_grad()
def test_cached_prefill_and_ar_steps_equal_the_dense_masked_attention(model, backend):
    B, L = MASKS.shape[0], 15
    captions = captions_for(MASKS)
    tokens = torch.randint(0, 64, (B, L))
    want = dense_logits(model, captions, tokens, MASKS)  # [B, 1 + L, V]
    model.setup_cache(B, C + 16)
    first = model(None, captions, cache_len=torch.zeros(B, dtype=torch.int64), emb_masks=MASKS)
    torch.testing.assert_close(first, want[:, :1], atol=ATOL, rtol=0)
    assert model.cond_keys.tolist() == MASKS.sum(1).tolist()  # padded caption K/V left the cache
    cache_len = model.cond_keys.clone()
    for t in range(L):
        step = model(tokens[:, t:t + 1], cache_len=cache_len + t)  # default positions: cache_len - cond_keys
        torch.testing.assert_close(step[:, 0], want[:, t + 1], atol=ATOL, rtol=0)
    # the no-cache forward applies the same mask
    torch.testing.assert_close(model.forward_full(tokens, captions, emb_masks=MASKS), want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_prefill_with_tokens_then_chain_and_tree_steps(model, backend):
    B = MASKS.shape[0]
    captions = captions_for(MASKS, seed=1)
    tokens = torch.randint(0, 64, (B, 9))
    want = dense_logits(model, captions, tokens, MASKS)
    model.setup_cache(B, C + 16)
    first = model(tokens[:, :3], captions, cache_len=torch.zeros(B, dtype=torch.int64), emb_masks=MASKS)
    torch.testing.assert_close(first, want[:, :4], atol=ATOL, rtol=0)
    cache_len = MASKS.sum(1) + 3
    # a chain of three tokens in one forward
    chain = lantern.ops.ancestor_mask(torch.tensor([-1, 0, 1]).expand(B, 3).contiguous())
    out = model(tokens[:, 3:6], cache_len=cache_len, positions=(3 + torch.arange(3)).expand(B, 3),
                tree_mask=chain)
    torch.testing.assert_close(out, want[:, 4:7], atol=ATOL, rtol=0)
    # a tree after them: node 0 = token 6, nodes 1 and 2 its two children (tokens 7 and a rival)
    cache_len = cache_len + 3
    rival = (tokens[:, 7] + 1) % 64
    tree_tokens = torch.stack([tokens[:, 6], tokens[:, 7], rival], dim=1)
    parents = torch.tensor([-1, 0, 0]).expand(B, 3).contiguous()
    positions = torch.tensor([6, 7, 7]).expand(B, 3)
    out = model(tree_tokens, cache_len=cache_len, positions=positions, tree_mask=lantern.ops.ancestor_mask(parents))
    torch.testing.assert_close(out[:, :2], want[:, 7:9], atol=ATOL, rtol=0)
    rival_want = dense_logits(model, captions, torch.cat([tokens[:, :7], rival[:, None]], 1), MASKS)[:, -1]
    torch.testing.assert_close(out[:, 2], rival_want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_a_smaller_batch_than_the_cache_and_gqa():
    m = t2i_gpt(3, n_head=4, n_kv_head=2)
    masks = MASKS[:4]
    captions = captions_for(masks, seed=2)
    tokens = torch.randint(0, 64, (4, 5))
    want = dense_logits(m, captions, tokens, masks)
    m.setup_cache(6, C + 16)  # two cache rows more than the batch: they stay untouched
    m.kv_cache[:, :, 4:].fill_(7.0)
    out = m(tokens, captions, cache_len=torch.zeros(4, dtype=torch.int64), emb_masks=masks)
    torch.testing.assert_close(out, want, atol=ATOL, rtol=0)
    assert bool((m.kv_cache[:, :, 4:] == 7.0).all())
    assert m.cond_keys.tolist() == masks.sum(1).tolist() + [C, C]


@torch.no_grad()
def test_left_padding_equals_the_caption_without_its_padding(model, backend):
    """Caption positions have zero RoPE and image positions depend on the raster index alone, so a
    left-padded caption gives the logits of a model whose caption is just the real positions."""
    tokens = torch.randint(0, 64, (1, 10))
    for n_real in (1, 5, 8):
        masks = left_padded([n_real])
        captions = captions_for(masks, seed=n_real)
        short = t2i_gpt(0, caption_len=n_real)
        state = {k: v for k, v in model.state_dict().items() if k != "cls_embedding.uncond_embedding"}
        short.load_state_dict(state, strict=False)
        short_want = short.forward_full(tokens, captions[:, C - n_real:])  # no mask: nothing is padded
        torch.testing.assert_close(model.forward_full(tokens, captions, emb_masks=masks), short_want, atol=ATOL,
                                   rtol=0)
        model.setup_cache(1, C + 16)
        got = model(tokens, captions, cache_len=torch.zeros(1, dtype=torch.int64), emb_masks=masks)
        torch.testing.assert_close(got, short_want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_all_ones_is_exactly_no_mask(model, backend):
    B = 3
    captions = captions_for(torch.ones(B, C))
    tokens = torch.randint(0, 64, (B, 6))
    ones = torch.ones(B, C, dtype=torch.bool)
    runs = []
    for masks in (None, ones, ones.to(torch.int32)):
        model.setup_cache(B, C + 16)
        first = model(tokens[:, :2], captions, cache_len=torch.zeros(B, dtype=torch.int64), emb_masks=masks)
        step = model(tokens[:, 2:3], cache_len=model.cond_keys + 2)
        runs.append((first, step, model.kv_cache.clone(), model.cond_keys.clone(),
                     model.forward_full(tokens, captions, emb_masks=masks)))
    for run in runs[1:]:
        for got, want in zip(run, runs[0]):
            assert torch.equal(got, want)


@torch.no_grad()
def test_ignoring_the_mask_changes_padded_captions(model):
    """Negative control: the padded positions matter when the mask is not applied."""
    B = MASKS.shape[0]
    captions = captions_for(MASKS)
    tokens = torch.randint(0, 64, (B, 6))
    masked = model.forward_full(tokens, captions, emb_masks=MASKS)
    unmasked = model.forward_full(tokens, captions)
    padded = ~MASKS.bool().all(1)  # rows with padding differ, the unpadded row does not
    diff = (masked - unmasked).abs().amax(dim=(1, 2))
    assert bool((diff[padded] > 1e-2).all()) and bool((diff[~padded] < 1e-5).all())
    assert not torch.allclose(dense_logits(model, captions, tokens, torch.ones_like(MASKS)), masked, atol=1e-2)


def test_bad_masks_raise(model):
    B = 2
    captions = captions_for(torch.ones(B, C))
    zero = torch.zeros(B, dtype=torch.int64)
    model.setup_cache(B, C + 16)
    with pytest.raises(ValueError, match=r"emb_masks must have shape \[2, 8\]"):
        model(None, captions, cache_len=zero, emb_masks=torch.ones(B, C - 1, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"emb_masks must have shape"):
        model(None, captions, cache_len=zero, emb_masks=torch.ones(B + 1, C, dtype=torch.bool))
    with pytest.raises(TypeError, match="emb_masks must be bool or an integer dtype"):
        model(None, captions, cache_len=zero, emb_masks=torch.ones(B, C))
    with pytest.raises(TypeError, match="emb_masks must be a tensor"):
        model(None, captions, cache_len=zero, emb_masks=[[1] * C] * B)
    with pytest.raises(ValueError, match="emb_masks values must be 0"):
        model(None, captions, cache_len=zero, emb_masks=torch.full((B, C), 2))
    with pytest.raises(ValueError, match="emb_masks must be on cpu"):
        model(None, captions, cache_len=zero, emb_masks=torch.ones(B, C, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="emb_masks belongs to the condition"):
        model(torch.zeros(B, 1, dtype=torch.int64), cache_len=zero + C, emb_masks=torch.ones(B, C, dtype=torch.bool))
    with pytest.raises(ValueError, match="emb_masks must have shape"):
        model.forward_full(torch.zeros(B, 2, dtype=torch.int64), captions, emb_masks=torch.ones(B, 3, dtype=torch.bool))
    c2i = small_gpt(0)
    c2i.setup_cache(B, 17)
    with pytest.raises(ValueError, match="emb_masks .* is for t2i models"):
        c2i(None, torch.tensor([1, 2]), cache_len=zero, emb_masks=torch.ones(B, 1, dtype=torch.bool))
