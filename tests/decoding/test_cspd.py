"""generate_cspd (continuous speculative decoding, docs/cspd.md): with the target as its own drafter and one
step per block it is target-only MAR token for token (both rules); a block's first step, whose context is the
target's, is always accepted; images do not depend on the batch; pre-fill, block and forward counts; the
stats count exactly what continuous_verify reports (capped residuals included); lantern.generate's dispatch;
bad arguments. Small random models (tests/mar_testing.py). The laws: tests/stats/test_cspd_laws.py."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import lantern
from lantern import ops
from lantern.decoding import CSpDConfig, generate_cspd, sample_mar
from lantern.decoding import cspd as cspd_module
from lantern.decoding.mar import tokens_per_step
from lantern.ops.reference.continuous_verify import ContinuousVerifyResult
from mar_testing import recording_head_inputs, small_mar
from rounding import shape_dependent_rounding

LABELS = torch.tensor([0, 3, 1, 4])


@pytest.fixture(scope="module")
def target():
    return small_mar(0, num_sampling_steps="6")


@pytest.fixture(scope="module")
def drafter():
    return small_mar(1, num_sampling_steps="6", decoder_embed_dim=16, decoder_depth=1, decoder_num_heads=2,
                     diffloss_w=16)


@pytest.mark.parametrize("rule,cfg", [("exact", 1.0), ("exact", 2.5), ("paper", 2.5)])
def test_self_drafting_one_step_per_block_is_target_only_mar(target, rule, cfg):
    """gamma = 1 and drafter = target: each draft is the target's own sample (same context, guidance, noise),
    so every draft is accepted and the images are target-only MAR's (with its last-step noise setting)."""
    config = CSpDConfig(gamma=1, rule=rule, bandwidth=1.0 if rule == "exact" else 42.0)
    out = generate_cspd(target, target, LABELS, num_iter=12, config=config, cfg=cfg, seed=5)
    want = sample_mar(target, LABELS, num_iter=12, cfg=cfg, seed=5, last_step_noise=rule == "exact")
    torch.testing.assert_close(out.tokens, want.tokens, rtol=0, atol=0)
    assert out.stats.accepted == out.stats.drafted > 0 and out.stats.residual_tries == 0


def _recording_heads(monkeypatch) -> list:
    """Every head run of generate_cspd, in order, as ({(b, p): row}, HeadSample)."""
    calls, real = [], cspd_module.predict_positions

    def recording(*args, **kwargs):
        (b, p), out = real(*args, **kwargs)
        calls.append(({(int(i), int(j)): row for row, (i, j) in enumerate(zip(b, p))}, out))
        return (b, p), out

    monkeypatch.setattr(cspd_module, "predict_positions", recording)
    return calls


def test_a_blocks_first_step_sees_the_targets_context(target, monkeypatch):
    """Without guidance, the drafter's first step of a block conditions on the verified tokens only, like the
    target: with the target as drafter, its first-step head statistics are the target's, and those drafts are
    always accepted; later steps condition on drafts (other statistics, rejections).

    float64 and one-ulp shape-dependent rounding in every product (tests/rounding.py): the drafter's step and
    the target's block forward compute with other row counts, so their statistics agree only to rounding
    (measured here: within 1e-13 relative). continuous_verify takes float32, so a first-step draft could be
    judged on other values only if a float32 rounding boundary fell between the two float64 values: at most
    ~2^24 x 1e-13 = 2e-6 per value, < 2e-3 over the test's 768 values, once per machine (the run is
    deterministic); in float32 one ulp of these tokens (up to ~6e4) exceeds the last step's std, and 1 to 3
    of the 16 drafts are rejected."""
    heads = _recording_heads(monkeypatch)
    model = copy.deepcopy(target).double()
    with shape_dependent_rounding():
        out = generate_cspd(model, model, LABELS, num_iter=16, config=CSpDConfig(gamma=4, prefill=0.0), seed=2)
    s = out.stats
    assert len(heads) == 4 * 5  # 4 blocks: 4 drafter steps, then the target
    for block in range(4):
        steps, (target_rows, target_out) = heads[5 * block: 5 * block + 4], heads[5 * block + 4]
        for index, (rows, drafted) in enumerate(steps):
            at = torch.tensor([target_rows[key] for key in rows])  # the target's rows of these tokens
            if index == 0:
                torch.testing.assert_close(drafted.mean0, target_out.mean0[at], rtol=1e-9, atol=1e-9)
                torch.testing.assert_close(drafted.std0, target_out.std0[at], rtol=1e-9, atol=1e-9)
            else:
                assert (drafted.mean0 - target_out.mean0[at]).abs().max() > 1e-3
    assert s.accepted_by_block_position[0] == s.drafted_by_block_position[0] == 4 * len(LABELS)
    assert s.accepted < s.drafted  # the later steps' contexts differ, and small random models notice


def _noise_rows(records) -> torch.Tensor:
    """Every head row's noise (x_T and each step's eps) as one flat row [M, (T) C]."""
    return torch.cat([torch.cat([x_T, eps.permute(1, 0, 2).flatten(1)], dim=1) for x_T, eps in records])


@pytest.mark.parametrize("align", [True, False])
def test_trajectory_alignment(target, drafter, align):
    """Aligned, the target's head sees at every verified position the x_T and eps_t the drafter's head saw
    there; align=False (the measurement knob, and the negative control) gives the drafter other noise."""
    records = {"target": [], "drafter": []}
    config = CSpDConfig(gamma=4, prefill=0.0, align=align)
    with recording_head_inputs(target, records["target"]), recording_head_inputs(drafter, records["drafter"]):
        generate_cspd(target, drafter, LABELS[:1], num_iter=8, config=config, seed=6)
    assert len(records["target"]) == 2 and len(records["drafter"]) == 8  # 2 blocks of 4 drafted steps
    seen_by_target, seen_by_drafter = _noise_rows(records["target"]), _noise_rows(records["drafter"])
    assert seen_by_target.shape == seen_by_drafter.shape
    same = (torch.cdist(seen_by_drafter, seen_by_target) == 0).any(dim=1)  # [M]: found among the target's rows
    assert bool(same.all()) if align else not bool(same.any())


@pytest.mark.slow
def test_images_do_not_depend_on_the_batch(target, drafter):
    """An image's tokens depend on its id, not on the rows beside it; a row without its image id is another
    image (negative control).

    float64 models and one-ulp shape-dependent rounding in every product (tests/rounding.py), so the test does
    not rely on batch-invariant matrix products: the chains agree to ~1e-13 relative (tokens reach ~6e4);
    continuous_verify rounds its inputs to float32, and an accept decision could change only if a float32
    rounding boundary fell between two such values (< 2e-6 per value, < 2e-3 over the test). Tolerance 1e-9
    relative: four orders above the rounding, ten below the negative control's differences."""
    target64, drafter64 = copy.deepcopy(target).double(), copy.deepcopy(drafter).double()
    config = CSpDConfig(gamma=3)
    run = lambda labels, **kw: generate_cspd(target64, drafter64, labels, num_iter=10, config=config, cfg=2.0,  # noqa: E731
                                             seed=9, **kw).tokens
    with shape_dependent_rounding():
        together = run(LABELS)
        ids = torch.arange(4)
        for part in (ids[:1], ids[1:3], ids[3:]):
            torch.testing.assert_close(run(LABELS[part], image_ids=part), together[part], rtol=1e-9, atol=1e-9)
        reordered = run(LABELS.flip(0), image_ids=ids.flip(0))
        torch.testing.assert_close(reordered, together.flip(0), rtol=1e-9, atol=1e-9)
        unkeyed = run(LABELS[1:3])
    assert (unkeyed - together[1:3]).abs().max() > 0.1


@pytest.mark.parametrize("num_iter,gamma,prefill", [(16, 4, 0.05), (16, 5, 0.25), (7, 8, 0.0), (12, 3, 0.5)])
def test_schedule_and_counts(target, drafter, num_iter, gamma, prefill):
    calls = []
    out = generate_cspd(target, drafter, LABELS, num_iter=num_iter, config=CSpDConfig(gamma=gamma, prefill=prefill),
                        cfg=1.5, seed=1, on_step=lambda step, n: calls.append((step, n)))
    s, B, L = out.stats, len(LABELS), target.config.seq_len
    n_prefill = math.ceil(prefill * num_iter)
    n_blocks = math.ceil((num_iter - n_prefill) / gamma)
    per_step = tokens_per_step(L, num_iter)
    assert s.prefill_steps == n_prefill and s.blocks == n_blocks and s.steps == num_iter
    assert s.target_forwards == n_prefill + n_blocks and s.drafter_forwards == num_iter - n_prefill
    T = target.diffloss.gen_diffusion.num_timesteps
    assert s.target_head_evaluations == T * (n_prefill + n_blocks)
    assert s.drafter_head_evaluations == T * (num_iter - n_prefill)
    assert s.prefill_tokens == B * sum(per_step[:n_prefill]) and s.drafted == B * sum(per_step[n_prefill:])
    assert s.prefill_tokens + s.drafted == B * L
    assert s.drafted_by_step == [0] * n_prefill + [B * c for c in per_step[n_prefill:]]
    assert sum(s.drafted_by_block_position) == s.drafted and sum(s.accepted_by_block_position) == s.accepted
    assert all(math.isnan(a) for a in s.acceptance_by_step()[:n_prefill])
    assert s.residual_tries >= s.rejected and s.residual_fallbacks == 0
    assert s.tokens_per_target_forward(B) == pytest.approx(L / (n_prefill + n_blocks))
    assert min(s.target_transformer_s, s.drafter_transformer_s, s.target_head_s, s.drafter_head_s, s.verify_s) > 0
    assert [n for _, n in calls] == per_step[:n_prefill] + [sum(per_step[i:i + gamma]) for i in
                                                           range(n_prefill, num_iter, gamma)]
    assert out.tokens.shape == (B, L, target.config.token_embed_dim) and bool(torch.isfinite(out.tokens).all())


def test_stats_count_what_the_op_reports(target, drafter, monkeypatch):
    """Accepted drafts, proposals and capped residuals are summed from the op's results: a wrapper that marks
    some rejected tokens as capped (tries = max_tries + 1) sees them counted as fallbacks."""
    results, real, max_tries = [], ops.continuous_verify, 7

    def marking(*args, **kwargs):
        r = real(*args, **kwargs)
        every_other = torch.arange(r.tries.shape[1]) % 2 == 0
        tries = torch.where(~r.accepted & every_other, max_tries + 1, r.tries).to(torch.int32)
        results.append(ContinuousVerifyResult(r.tokens, r.accepted, tries))
        return results[-1]

    monkeypatch.setattr(ops, "continuous_verify", marking)
    s = generate_cspd(target, drafter, LABELS, num_iter=12, config=CSpDConfig(gamma=4, max_tries=max_tries),
                      seed=4).stats
    accepted = sum(int(r.accepted.sum()) for r in results)
    capped = sum(int((r.tries > max_tries).sum()) for r in results)
    proposals = sum(int(r.tries[~r.accepted].clamp(max=max_tries).sum()) for r in results)
    assert capped > 0 and s.residual_fallbacks == capped
    assert s.accepted == accepted and s.residual_tries == proposals and s.residual_tries_max == max_tries


def test_lantern_generate_dispatches_cspd(target, drafter):
    tokens, stats = lantern.generate(target, LABELS, method="cspd", drafter=drafter, cfg_scale=2.0, seed=3, num_iter=8,
                                     gamma=3, rule="paper", bandwidth=42.0, sigma_ratio="code")
    want = generate_cspd(target, drafter, LABELS, num_iter=8, cfg=2.0, seed=3,
                         config=CSpDConfig(gamma=3, rule="paper", bandwidth=42.0, sigma_ratio="code"))
    torch.testing.assert_close(tokens, want.tokens, rtol=0, atol=0)
    assert stats.drafted == want.stats.drafted and stats.accepted == want.stats.accepted
    with pytest.raises(ValueError, match="MAR drafter"):
        lantern.generate(target, LABELS, method="cspd")


@pytest.mark.parametrize("config,match", [
    (dict(gamma=0), "gamma"), (dict(prefill=1.0), "prefill"), (dict(rule="lossy"), "rule"),
    (dict(max_tries=0), "max_tries"), (dict(last_step_noise=False), "last_step_noise"),
    (dict(bandwidth=42.0), "bandwidth"), (dict(rule="paper", bandwidth=-1.0), "bandwidth"),
])
def test_bad_settings_are_named(target, drafter, config, match):
    with pytest.raises(ValueError, match=match):
        generate_cspd(target, drafter, LABELS, num_iter=4, config=CSpDConfig(**config))


def test_a_drafter_must_match_the_target(target):
    with pytest.raises(ValueError, match="diffusion steps"):
        generate_cspd(target, small_mar(2, num_sampling_steps="5"), LABELS, num_iter=4)
    with pytest.raises(ValueError, match="seq_len"):
        generate_cspd(target, small_mar(2, num_sampling_steps="6", img_size=8), LABELS, num_iter=4)
    with pytest.raises(ValueError, match="labels"):
        generate_cspd(target, target, torch.tensor([99]), num_iter=4)
