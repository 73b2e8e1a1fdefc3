"""AR sampling (lantern.decoding.generate_ar) against an independent uncached loop over forward_full."""
import pytest
import torch

import lantern
from lantern import _backend, ops
from lantern.decoding import generate_ar
from lantern.models import build_gpt


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = build_gpt("GPT-tiny", block_size=16, n_layer=2).eval()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.05)
    with torch.no_grad():  # make the class and the logits matter, so guidance changes the samples
        m.cls_embedding.embedding_table.weight.mul_(40)
        m.output.weight.mul_(20)
    return m


def reference_loop(model, labels, *, cfg_scale, temperature, top_k, seed, cfg_interval=-1):
    """Uncached: recompute the whole sequence each step, guide, then sample with the §5 race."""
    B, L = labels.shape[0], model.config.block_size
    tokens = torch.zeros(B, 0, dtype=torch.int64)
    null = torch.full_like(labels, model.config.num_classes)
    for step in range(L):
        with torch.no_grad():
            lc = model.forward_full(tokens, labels)[:, -1]
            lu = model.forward_full(tokens, null)[:, -1]
        use_cfg = cfg_scale != 1.0 and not (0 <= cfg_interval < step)
        probs = ops.process_logits(lc, lu if use_cfg else None, cfg_scale=cfg_scale if use_cfg else 1.0,
                                   temperature=temperature, top_k=top_k)
        if temperature == 0:
            logits = lu + cfg_scale * (lc - lu) if use_cfg else lc
            nxt = logits.argmax(-1)
        else:
            u = ops.philox_uniform(seed, torch.arange(probs.shape[1])[None], 0, torch.arange(B)[:, None], step)
            keys = -torch.log1p(-u) / probs
            nxt = torch.where(probs > 0, keys, float("inf")).argmin(-1)
        tokens = torch.cat([tokens, nxt[:, None]], 1)
    return tokens


@pytest.mark.parametrize("cfg_scale,temperature,top_k,cfg_interval", [
    (1.0, 1.0, 0, -1), (3.0, 1.0, 20, -1), (3.0, 0.0, 0, -1), (2.0, 0.7, 0, 5)])
def test_generate_ar_matches_uncached_loop(model, cfg_scale, temperature, top_k, cfg_interval):
    labels = torch.tensor([0, 4, 9])
    got = generate_ar(model, labels, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, seed=11,
                      cfg_interval=cfg_interval)
    want = reference_loop(model, labels, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, seed=11,
                          cfg_interval=cfg_interval)
    assert torch.equal(got, want)


def test_same_seed_same_tokens_and_other_seed_differs(model):
    labels = torch.tensor([1, 2])
    a = generate_ar(model, labels, cfg_scale=3.0, seed=5)
    b = generate_ar(model, labels, cfg_scale=3.0, seed=5)
    c = generate_ar(model, labels, cfg_scale=3.0, seed=6)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_cfg_interval_changes_only_later_steps(model):
    labels = torch.tensor([3])
    always = generate_ar(model, labels, cfg_scale=4.0, seed=2)
    limited = generate_ar(model, labels, cfg_scale=4.0, seed=2, cfg_interval=6)
    assert torch.equal(always[:, :7], limited[:, :7])  # steps 0..6 use guidance in both
    assert not torch.equal(always, limited)


def test_length_stops_at_a_prefix_of_the_full_image(model):
    labels = torch.tensor([0, 1])
    full = generate_ar(model, labels, cfg_scale=2.0, seed=3)
    assert torch.equal(generate_ar(model, labels, cfg_scale=2.0, seed=3, length=3), full[:, :3])
    for bad in (0, model.config.block_size + 1, 2.0, True):
        with pytest.raises(ValueError, match="length"):
            generate_ar(model, labels, length=bad)


@pytest.mark.skipif(not lantern.fused_ops("cpu").get("verify", False), reason="lantern._C is not built")
def test_a_run_keeps_the_backend_it_started_with(model):
    """generate_ar resolves verify's backend once: a per-token callback that switches the default to cpu after
    the first token leaves the run on the reference (no cpu kernel runs) and the tokens unchanged; a run
    started under cpu runs its verify kernel once per token (the count is not vacuous)."""
    labels = torch.tensor([0, 4])
    calls = lambda: _backend.kernel_calls()["ran"].get(("cpu", "verify"), 0)
    want = generate_ar(model, labels, cfg_scale=3.0, seed=7)
    before = calls()
    with lantern.fused("reference"):
        got = generate_ar(model, labels, cfg_scale=3.0, seed=7, on_token=lambda _: lantern.enable_fused("cpu"))
    assert calls() == before and torch.equal(got, want)
    with lantern.fused("cpu"):
        generate_ar(model, labels, cfg_scale=3.0, seed=7, on_token=lambda _: lantern.disable_fused())
    assert calls() == before + model.config.block_size
