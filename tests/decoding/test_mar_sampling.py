"""sample_mar: the noise stream's known answers (scalar Philox from tests/stats and Box-Muller written out),
the mask and guidance schedules, the same image at any batch size / order, identical noise for two models
at the same position, the head statistics, and lantern.generate's dispatch."""
import copy
import math
import time

import numpy as np
import pytest
import torch

import lantern
from lantern.decoding import mar as mar_loop
from lantern.decoding import sample_mar
from mar_testing import recording_head_inputs, small_mar
from rounding import shape_dependent_rounding
from stats import philox_ref
from threads import run_in_threads

CASES = [(0, mar_loop.PURPOSE_X_T, 0, 0, 0), (7, mar_loop.PURPOSE_EPS, 12, 63, 49),
         (2**40 + 5, mar_loop.PURPOSE_EPS_0, 999, 255, 0), (123, mar_loop.PURPOSE_EPS, 2**32 - 1, 5, 99)]


@pytest.mark.parametrize("seed,purpose,image,position,step", CASES)
def test_noise_known_answers(seed, purpose, image, position, step):
    got = mar_loop.gaussian(seed, purpose, torch.tensor([image]), torch.tensor([position]), step, 16)[0]
    expected = torch.tensor([philox_ref.gaussian(seed, purpose, image, position, step, c) for c in range(16)])
    torch.testing.assert_close(got.double(), expected.double(), rtol=1e-5, atol=1e-5)


def test_noise_pinned_values():
    """Values of the keying scheme pinned (computed once with the scalar reference above): a change of the
    counter layout, the purposes or the Box-Muller form changes them."""
    x_T = mar_loop.gaussian(0, mar_loop.PURPOSE_X_T, torch.tensor([0]), torch.tensor([0]), 0, 2)[0]
    assert x_T.tolist() == pytest.approx([-0.7404617174732453, 0.04528630265372792], abs=1e-5)
    eps = mar_loop.gaussian(7, mar_loop.PURPOSE_EPS, torch.tensor([12]), torch.tensor([63]), 49, 6)[0, 5]
    assert float(eps) == pytest.approx(-0.867830427867469, abs=1e-5)


def test_noise_keys_are_distinct_and_gaussian():
    img = torch.arange(64).repeat_interleave(32)
    pos = torch.arange(32).repeat(64)
    a = mar_loop.gaussian(3, mar_loop.PURPOSE_EPS, img, pos, 5, 16)  # [2048, 16]
    assert abs(float(a.mean())) < 0.03 and abs(float(a.std()) - 1) < 0.03
    for other in (mar_loop.gaussian(3, mar_loop.PURPOSE_EPS, img, pos, 6, 16),  # another step
                  mar_loop.gaussian(3, mar_loop.PURPOSE_X_T, img, pos, 5, 16),  # another purpose
                  mar_loop.gaussian(4, mar_loop.PURPOSE_EPS, img, pos, 5, 16),  # another seed
                  mar_loop.gaussian(3, mar_loop.PURPOSE_EPS, img + 1, pos, 5, 16)):  # another image
        assert abs(float(np.corrcoef(a.flatten(), other.flatten())[0, 1])) < 0.05
    steps = mar_loop.step_noise(3, img[:10], pos[:10], 8, 16, max_elements=300)  # chunked: one row per call
    torch.testing.assert_close(steps[5], a[:10], atol=0, rtol=0)


def test_orders_are_permutations_from_the_stream():
    ids = torch.tensor([0, 5, 2**31])
    orders = mar_loop.sample_orders(11, ids, 16)
    for row, image in zip(orders, ids.tolist()):
        u = [float(philox_ref.uniform(11, mar_loop.PURPOSE_ORDER << 24, image, p, 0)) for p in range(16)]
        assert row.tolist() == sorted(range(16), key=lambda p: (u[p], p))
    assert not torch.equal(orders[0], orders[1])


@pytest.mark.parametrize("L,num_iter", [(64, 64), (256, 256), (256, 64), (256, 32), (64, 16), (16, 40), (64, 1)])
def test_mask_schedule(L, num_iter):
    counts = mar_loop.tokens_per_step(L, num_iter)
    assert sum(counts) == L and len(counts) == num_iter
    if num_iter == L:
        assert counts == [1] * L
    expected, masked = [], L  # the reference's rule written out
    for step in range(num_iter):
        keep = max(1, min(masked - 1, int(np.floor(L * np.cos(math.pi / 2.0 * (step + 1) / num_iter)))))
        expected.append(masked if step == num_iter - 1 else masked - keep)
        masked = keep
    assert counts == [max(c, 0) for c in expected]
    if (L, num_iter) == (256, 64):
        assert counts[0] == 1 and set(counts[-4:]) <= {6, 7}
    if (L, num_iter) == (256, 32):
        assert max(counts) == 13


def test_cfg_schedules():
    assert mar_loop.cfg_scale_at(3.0, "linear", 256, 255) == 1 + 2.0 / 256
    assert mar_loop.cfg_scale_at(3.0, "linear", 256, 1) == 1 + 2.0 * 255 / 256  # never the full scale
    assert mar_loop.cfg_scale_at(3.0, "constant", 256, 200) == 3.0
    with pytest.raises(ValueError, match="cfg_schedule"):
        mar_loop.cfg_scale_at(3.0, "cosine", 256, 1)


@pytest.fixture(scope="module")
def model():
    return small_mar(4, num_sampling_steps="5")


def test_same_image_at_any_batch_size_and_order(model):
    """An image's tokens depend on its id, not on its batch or its place in it. float64 and one-ulp
    shape-dependent rounding in every product (tests/rounding.py), so the test does not rely on
    batch-invariant matrix products: the parts agree with the whole to ~1e-13 relative (tokens reach ~1e5);
    tolerance 1e-9 relative, ten orders below the negative controls' differences."""
    model64 = copy.deepcopy(model).double()
    labels = torch.tensor([0, 3, 1, 4, 2])
    run = lambda labels, **kw: sample_mar(model64, labels, num_iter=4, cfg=2.5, **kw).tokens  # noqa: E731
    parts = [torch.tensor([3, 0]), torch.tensor([4]), torch.tensor([2, 1])]
    with shape_dependent_rounding():
        full = run(labels, seed=7)
        for ids in parts:
            torch.testing.assert_close(run(labels[ids], seed=7, image_ids=ids), full[ids], atol=1e-9, rtol=1e-9)
        # negative controls: another seed, or the same rows without their image ids, give other images
        assert (run(labels, seed=8) - full).abs().max() > 0.1
        assert (run(labels[parts[0]], seed=7) - full[parts[0]]).abs().max() > 0.1


def test_drafter_and_target_see_the_same_noise(model):
    drafter = small_mar(9, num_sampling_steps="5", encoder_embed_dim=8, decoder_embed_dim=12, diffloss_w=16)
    labels = torch.tensor([1, 2])
    records = {}
    for name, m in (("target", model), ("drafter", drafter)):
        records[name] = []
        with recording_head_inputs(m, records[name]):
            out = sample_mar(m, labels, num_iter=4, cfg=1.0, seed=21)
        assert not torch.equal(out.tokens, torch.zeros_like(out.tokens))
    assert len(records["target"]) == len(records["drafter"]) == 4
    for (xt_a, eps_a), (xt_b, eps_b) in zip(records["target"], records["drafter"]):
        assert torch.equal(xt_a, xt_b) and torch.equal(eps_a, eps_b)
    other = []
    with recording_head_inputs(drafter, other):
        sample_mar(drafter, labels, num_iter=4, seed=22)
    assert not torch.equal(other[0][0], records["target"][0][0])  # negative control: another seed


def test_head_statistics(model):
    labels = torch.tensor([0, 1, 2])
    out = sample_mar(model, labels, num_iter=3, cfg=1.0, seed=5, temperature=0.8, head_stats=True)
    assert out.std0.shape == out.tokens.shape and out.logstd_sum.shape == out.tokens.shape[:2]
    torch.testing.assert_close(out.tokens, out.mean0)  # MAR adds no noise at the last step
    assert bool((out.std0 > 0).all()) and bool((out.logstd_sum < 0).all())
    # with last_step_noise the tokens are mean0 + std0 * eps_0 (one MAR step: the means stay the same)
    out = sample_mar(model, labels, num_iter=1, cfg=1.0, seed=5, temperature=0.8, head_stats=True)
    noisy = sample_mar(model, labels, num_iter=1, cfg=1.0, seed=5, temperature=0.8, head_stats=True,
                       last_step_noise=True)
    torch.testing.assert_close(noisy.mean0, out.mean0)
    L = model.config.seq_len
    ids = torch.arange(3).repeat_interleave(L)
    pos = torch.arange(L).repeat(3)
    eps0 = mar_loop.gaussian(5, mar_loop.PURPOSE_EPS_0, ids, pos, 0, 4).view(3, L, 4)
    torch.testing.assert_close(noisy.tokens, out.mean0 + out.std0 * eps0, atol=1e-6, rtol=1e-5)


def test_stats_and_progress(model):
    calls = []
    out = sample_mar(model, torch.tensor([1, 2]), num_iter=5, cfg=2.0, seed=1, on_step=lambda s, n: calls.append(n))
    assert calls == out.stats.tokens_per_step == mar_loop.tokens_per_step(16, 5)
    assert out.stats.head_evaluations == 5 * 5 and out.stats.transformer_forwards == 5
    assert out.stats.transformer_s > 0 and out.stats.head_s > 0


def test_lantern_generate_dispatches_on_family(model):
    labels = torch.tensor([3, 1])
    tokens, stats = lantern.generate(model, labels, cfg_scale=2.0, seed=4, num_iter=3)
    torch.testing.assert_close(tokens, sample_mar(model, labels, cfg=2.0, seed=4, num_iter=3).tokens, atol=0, rtol=0)
    assert stats.steps == 3
    with pytest.raises(ValueError, match="method='cspd'"):
        lantern.generate(model, labels, drafter=model)


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="num_iter"):
        sample_mar(model, torch.tensor([1]), num_iter=0)
    with pytest.raises(ValueError, match="temperature"):
        sample_mar(model, torch.tensor([1]), temperature=0.0)
    with pytest.raises(ValueError, match="image_ids"):
        sample_mar(model, torch.tensor([1, 2]), image_ids=torch.tensor([0]))
    with pytest.raises(ValueError, match="cfg_schedule"):
        sample_mar(model, torch.tensor([1]), cfg=2.0, cfg_schedule="cosine")


def test_threads_sampling_one_model_get_the_images_they_get_alone(model):
    """A MAR model holds no decoding state (no cache): concurrent calls need no guard. One intra-op thread, so
    that every run's matrix products round alike."""

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        runs = [dict(labels=torch.tensor([1, 2, 3]), seed=1, cfg=2.0), dict(labels=torch.tensor([0]), seed=2),
                dict(labels=torch.tensor([4, 4]), seed=3, temperature=0.7)]
        sample = lambda run: sample_mar(model, run["labels"], num_iter=4, seed=run["seed"], cfg=run.get("cfg", 1.0),
                                        temperature=run.get("temperature", 1.0),
                                        on_step=lambda s, n: time.sleep(0.002)).tokens


        calls = [lambda run=run: sample(run) for run in runs]
        alone = run_in_threads(calls, together=False)
        for want, got in zip(alone, run_in_threads(calls, together=True)):
            assert torch.equal(got, want)
    finally:
        torch.set_num_threads(before)
