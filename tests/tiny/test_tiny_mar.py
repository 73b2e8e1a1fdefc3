"""The tiny MAR trainer's pieces on a few steps (the full run is `python -m lantern.tiny_mar.train`), and the
shipped weights once they exist."""
import json
from dataclasses import replace

import pytest
import torch

import lantern.tiny_mar
from lantern.tiny.data import make_dataset
from lantern.tiny_mar import train


def test_budget_scales_training_steps_only():
    plan = train.Plan()
    half = plan.scaled(0.5)
    steps = lambda p: (p.vae_steps, p.mar_steps, p.drafter_steps)
    assert steps(half) == tuple(n // 2 for n in steps(plan))
    assert (half.eval_per_class, half.num_iter, half.sweep) == (plan.eval_per_class, plan.num_iter, plan.sweep)


def test_latent_scale_is_inverse_std():
    mean = torch.randn(200, 16, 8, 8) * 3
    std = torch.full_like(mean, 4.0)
    assert train.latent_scale(mean, std, 0) == pytest.approx(1 / 5.0, rel=0.01)


def test_few_steps_of_each_stage():
    plan = replace(train.Plan(), vae_steps=2, vae_batch=4, mar_batch=4)
    images, labels = make_dataset(20, 0)
    vae, figures = train.train_vae(plan, images, images[:8], log=lambda *_: None)
    assert figures["val_psnr_db_mode"] > 0
    mean, std = train.posteriors(vae, images)
    assert mean.shape == (20, 16, 8, 8) and bool((std > 0).all())
    model, figures = train.train_mar(plan, "MAR-tiny-drafter", 2, mean, std, labels, 1.0, 20, log=lambda *_: None)
    assert figures["steps"] == 2 and torch.isfinite(torch.tensor(figures["train_loss_smoothed"]))
    assert not model.training


@pytest.mark.skipif(not (lantern.tiny_mar.TINY_MAR_DIR / lantern.tiny_mar.META_FILE).exists(),
                    reason="the tiny MAR weights are not trained yet (python -m lantern.tiny_mar.train)")
def test_shipped_tiny_mar():
    tiny = lantern.tiny_mar.load_tiny_mar()
    meta = json.loads((lantern.tiny_mar.TINY_MAR_DIR / lantern.tiny_mar.META_FILE).read_text())
    assert tiny.vae.scale == meta["vae_scale"] and tiny.mar.config.seq_len == 64
    assert tiny.drafter.config.token_embed_dim == tiny.mar.config.token_embed_dim
    assert sum(p.numel() for p in tiny.drafter.parameters()) < sum(p.numel() for p in tiny.mar.parameters())
    samples = meta["figures"]["samples"]
    assert samples["target"]["n"] == 1000 and samples["drafter"]["n"] == 1000
