"""t2i caption padding through the decoding loops: greedy AR with ``emb_masks`` is the greedy loop over the
no-cache masked forward; greedy speculative decoding (every drafter, every tree kind, tree="auto") gives
the AR tokens; all-ones masks are exactly no masks; bad masks raise before anything runs."""
import copy

import pytest
import torch

from lantern.decoding import SpecConfig, generate, generate_ar, generate_spec
from lantern.guidance import guide_halves
from lantern.models import build_gpt
from lantern.models.drafter import EagleDrafter, GPTDrafter
from planner_models import synthetic_costs

C, CAPTION_DIM = 8, 12
SWITCHING = synthetic_costs(dispatch=0.01, per_token=2e-5, drafter=1e-3)  # trees, chains and AR steps
# per row: left padding of 0, 3, 6 and all 8 positions, right padding, holes
MASKS = torch.tensor([[1] * 8, [0] * 3 + [1] * 5, [0] * 6 + [1] * 2, [0] * 8, [1] * 5 + [0] * 3,
                      [0, 1, 0, 1, 1, 0, 1, 1]])


def t2i(n_layer, seed):
    """A random t2i GPT whose caption and logits matter (greedy tokens follow the caption)."""
    torch.manual_seed(seed)
    model = build_gpt("GPT-tiny", model_type="t2i", block_size=16, n_layer=n_layer, caption_len=C,
                      caption_dim=CAPTION_DIM)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():
        model.cls_embedding.cap_proj.fc1.weight.mul_(10)
        model.cls_embedding.cap_proj.fc2.weight.mul_(40)
        model.output.weight.mul_(20)
    return model.eval()


@pytest.fixture(scope="module")
def target():
    return t2i(2, 0)


@pytest.fixture(scope="module")
def captions():
    gen = torch.Generator().manual_seed(5)
    return torch.randn(MASKS.shape[0], C, CAPTION_DIM, generator=gen) * MASKS[..., None]


def drafter_named(target, name):
    if name == "self":
        return GPTDrafter(copy.deepcopy(target))
    if name == "small":
        return GPTDrafter(t2i(1, 1))
    torch.manual_seed(1)
    return EagleDrafter(target.config).bind(target).eval()


@torch.no_grad()
def greedy_without_cache(model, captions, masks, cfg_scale):
    """Greedy tokens from the no-cache forward over the whole prefix at every step, guided as LlamaGen:
    rows [cond; uncond], the uncond rows with the uncond caption embedding and the caption's mask."""
    B = captions.shape[0]
    cond, rows_masks = torch.cat([captions, model.cls_embedding.null_condition(captions)]), torch.cat([masks, masks])
    tokens = torch.zeros(B, 0, dtype=torch.int64)
    for _ in range(model.config.block_size):
        logits = model.forward_full(tokens.repeat(2, 1), cond, emb_masks=rows_masks)[:, -1]  # [2B, V]
        tokens = torch.cat([tokens, guide_halves(logits, cfg_scale).argmax(-1, keepdim=True)], dim=1)
    return tokens


def test_greedy_ar_with_masks_is_the_masked_no_cache_loop(target, captions):
    got = generate_ar(target, captions, cfg_scale=3.0, temperature=0.0, emb_masks=MASKS)
    assert torch.equal(got, greedy_without_cache(target, captions, MASKS, 3.0))
    # negative control: the rows with padding change when the mask is ignored
    unmasked = generate_ar(target, captions, cfg_scale=3.0, temperature=0.0)
    padded = ~MASKS.bool().all(1)
    assert torch.equal(unmasked[~padded], got[~padded])
    assert all(not torch.equal(unmasked[b], got[b]) for b in torch.nonzero(padded).flatten().tolist())


TREES = [SpecConfig(method="spec", tree="chain", depth=4),
         SpecConfig(method="spec", tree="static", static_widths=(3, 2, 1)),
         SpecConfig(method="spec", tree="dynamic", depth=3, top_per_node=4, n_nodes=12),
         SpecConfig(method="spec", cost_model=SWITCHING)]


@pytest.mark.slow
@pytest.mark.parametrize("drafter_name", ["self", "small", "eagle"])
@pytest.mark.parametrize("config", TREES, ids=lambda c: c.tree)
def test_greedy_spec_with_masks_reproduces_greedy_ar(target, captions, drafter_name, config):
    want = generate_ar(target, captions, cfg_scale=3.0, temperature=0.0, emb_masks=MASKS)
    got, stats = generate_spec(target, drafter_named(target, drafter_name), captions, config=config, cfg_scale=3.0,
                               temperature=0.0, emb_masks=MASKS)
    assert torch.equal(got, want)
    assert stats.emitted == captions.shape[0] * (target.config.block_size - 1)


def test_the_self_drafter_sees_the_masked_caption(target, captions):
    """A copy of the target as drafter accepts whole chains only if its prefill applies the mask too."""
    config = SpecConfig(method="spec", tree="chain", depth=4)
    _, stats = generate_spec(target, drafter_named(target, "self"), captions, config=config, cfg_scale=3.0,
                             temperature=0.0, emb_masks=MASKS)
    assert all(bool((a == 4).all()) for a in stats.accept_lens[:-1])


@pytest.mark.slow
def test_all_ones_is_exactly_no_mask(target, captions):
    ones = torch.ones(captions.shape[0], C, dtype=torch.int64)
    sampling = dict(cfg_scale=3.0, temperature=1.0, top_k=20, seed=3)
    assert torch.equal(generate_ar(target, captions, emb_masks=ones, **sampling),
                       generate_ar(target, captions, **sampling))
    config = SpecConfig(method="spec", tree="dynamic", depth=3, top_per_node=4, n_nodes=12)
    with_ones, _ = generate_spec(target, drafter_named(target, "small"), captions, config=config, emb_masks=ones,
                                 **sampling)
    without, _ = generate_spec(target, drafter_named(target, "small"), captions, config=config, **sampling)
    assert torch.equal(with_ones, without)


def test_generate_passes_the_masks(target, captions):
    want = generate_ar(target, captions, cfg_scale=3.0, temperature=0.0, emb_masks=MASKS)
    ar, _ = generate(target, captions, method="ar", cfg_scale=3.0, temperature=0.0, emb_masks=MASKS)
    spec, _ = generate(target, captions, method="spec", drafter=drafter_named(target, "eagle"), cfg_scale=3.0,
                       temperature=0.0, emb_masks=MASKS, cost_model=SWITCHING)
    assert torch.equal(ar, want) and torch.equal(spec, want)


def test_bad_masks_raise_before_decoding(target, captions):
    B = captions.shape[0]
    eagle = drafter_named(target, "eagle")
    config = SpecConfig(method="spec", tree="chain", depth=2)
    for run in (lambda m: generate_ar(target, captions, cfg_scale=3.0, emb_masks=m),
                lambda m: generate_spec(target, eagle, captions, config=config, cfg_scale=3.0, emb_masks=m)):
        with pytest.raises(ValueError, match=rf"emb_masks must have shape \[{B}, {C}\]"):
            run(torch.cat([MASKS, MASKS]))  # the doubled rows are the loop's business
        with pytest.raises(TypeError, match="emb_masks must be bool or an integer dtype"):
            run(MASKS.float())
        with pytest.raises(ValueError, match="emb_masks values must be 0"):
            run(MASKS * 2)
    c2i = build_gpt("GPT-tiny", block_size=16, n_layer=1).eval()
    with pytest.raises(ValueError, match="emb_masks .* is for t2i models"):
        generate_ar(c2i, torch.tensor([1, 2]), emb_masks=torch.ones(2, 1, dtype=torch.bool))
