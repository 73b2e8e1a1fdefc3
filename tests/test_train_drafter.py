"""lantern.train_drafter on a t2i target: a drafter that attends to the condition (EagleDrafter(attend_condition=
True), the LANTERN authors' T2I layout) trains on the target's hidden states over the caption, the same ones the
target's prefill keeps for it at decoding time, and they reach it: trained on other captions' hidden states it
learns other weights. Negative control: hidden states that differ only at the last caption position (which the
drafter's prefix does not hold; it enters through the image side's features, unchanged here) give the same
weights."""
import pytest
import torch

from lantern.models import build_gpt
from lantern.train_drafter import drafter_loss, self_generated, target_features, top1_agreement, train

N, C, CAPTION_DIM = 6, 5, 16
TRAIN = dict(batch=4, lr=3e-3, seed=0)


@pytest.fixture(scope="module")
def t2i():
    """(a tiny random t2i target, its captions [N, C, caption_dim], their padding masks [N, C])."""
    torch.manual_seed(0)
    target = build_gpt("GPT-tiny", "t2i", block_size=16, n_layer=2, dim=32, vocab_size=64, multiple_of=32,
                       caption_dim=CAPTION_DIM, caption_len=C)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if not name.endswith("norm.weight"):
                p.normal_(0, 0.2)  # far from HF-style init: captions change the hidden states visibly
    captions = torch.randn(N, C, CAPTION_DIM)
    masks = torch.ones(N, C, dtype=torch.int64)
    masks[::2, :2] = 0  # every other caption padded on the left
    return target.eval(), captions, masks


@pytest.fixture(scope="module")
def data(t2i):
    """(rows [2N, L], hidden [2N, 1 + L, dim], condition hidden [2N, C, dim]) of the target's own images."""
    target, captions, masks = t2i
    tokens, conditions = self_generated(target, N, cfg_scale=2.0, temperature=1.0, top_k=0, seed=1,
                                        conditions=captions, emb_masks=masks)
    assert tokens.shape == (N, 16) and conditions is captions
    return target_features(target, tokens, captions, emb_masks=masks, condition_hidden=True)


def test_condition_hidden_states_are_what_the_prefill_keeps_for_the_drafter(t2i, data):
    target, captions, masks = t2i
    rows, hidden, condition = data
    assert rows.shape == (2 * N, 16) and hidden.shape == (2 * N, 17, 32) and condition.shape == (2 * N, C, 32)
    target.keep_condition_hidden = True
    try:
        with torch.no_grad():
            target.setup_cache(2 * N, C + 17)
            target(None, target.double_for_cfg(captions), cache_len=torch.zeros(2 * N, dtype=torch.int64),
                   emb_masks=torch.cat([masks, masks]))
        torch.testing.assert_close(condition, target.condition_hidden, rtol=1e-5, atol=1e-5)
    finally:
        target.keep_condition_hidden = False
        target.free_cache()
    # the features pair the last caption position's hidden state with image token 0, as decoding does
    torch.testing.assert_close(hidden[:, 0], condition[:, -1], rtol=1e-5, atol=1e-5)


def weights(drafter):
    return torch.cat([p.detach().flatten() for p in drafter.parameters()])


def test_the_trainer_feeds_the_caption_to_an_attending_drafter(t2i, data):
    target, _, _ = t2i
    rows, hidden, condition = data
    trained = train(target, rows, hidden, steps=3, attend_condition=True, condition_hidden=condition, **TRAIN)
    assert trained.attend_condition and trained.prefix_len == C - 1
    other_captions = condition.roll(1, 0)  # each row trained on another caption's hidden states
    other = train(target, rows, hidden, steps=3, attend_condition=True, condition_hidden=other_captions, **TRAIN)
    assert (weights(trained) - weights(other)).abs().max() > 1e-4
    last_only = condition.clone()
    last_only[:, -1] = other_captions[:, -1]  # outside the prefix: not read by the drafter
    same = train(target, rows, hidden, steps=3, attend_condition=True, condition_hidden=last_only, **TRAIN)
    assert torch.equal(weights(trained), weights(same))  # negative control


def test_an_attending_drafter_learns_from_its_training(t2i, data):
    target, _, _ = t2i
    rows, hidden, condition = data
    options = dict(attend_condition=True, condition_hidden=condition, **TRAIN)
    losses = {}
    for steps in (1, 40):
        drafter = train(target, rows, hidden, steps=steps, **options)
        with torch.no_grad():
            losses[steps] = drafter_loss(drafter, target, rows, hidden, condition)[0].item()
    assert losses[40] < 0.8 * losses[1]
    assert 0.0 <= top1_agreement(drafter, target, rows, hidden, condition) <= 1.0


def test_condition_hidden_is_checked(t2i, data):
    target, _, _ = t2i
    rows, hidden, condition = data
    with pytest.raises(ValueError, match="condition_hidden"):
        train(target, rows, hidden, steps=1, attend_condition=True, **TRAIN)
    with pytest.raises(ValueError, match="condition_hidden"):
        train(target, rows, hidden, steps=1, attend_condition=True, condition_hidden=condition[:, 1:], **TRAIN)
    with pytest.raises(ValueError, match="condition_hidden is for attend_condition=True"):
        train(target, rows, hidden, steps=1, condition_hidden=condition, **TRAIN)
    c2i = build_gpt("GPT-tiny", "c2i", block_size=16, n_layer=2, dim=32, vocab_size=64, multiple_of=32).eval()
    with pytest.raises(ValueError, match="more than one position"):
        train(c2i, rows, hidden, steps=1, attend_condition=True, condition_hidden=condition[:, :1], **TRAIN)
