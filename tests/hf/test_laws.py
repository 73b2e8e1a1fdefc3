"""Sampled SJD through the adapter at δ = 0 reproduces the model's own AR law: the joint law of the first three
codes of a tiny random Janus (5 codes, guidance 2, temperature 1), computed exactly from the HF model's plain
forwards (no cache, the unconditional prompt by Janus's rule), against 6000 sampled images. The calibrated
G-test of tests/stats/gtest.py: false-failure rate <= 1e-6 per assertion. Negative control: the same run with
a verify whose residual distribution is wrong fails by a wide margin."""
import numpy as np
import pytest
import torch

import lantern
from hf_models import JANUS_BOI, model, wrap
from lantern import ops
from lantern.ops.reference import verify as reference_verify
from stats.gtest import assert_fails_widely, assert_fits, g_test

CFG = 2.0
ROWS = 6000
PROMPT = [1, 5, 6, JANUS_BOI]


@pytest.fixture(scope="module")
def janus5():
    return model("janus", torch.float64, codes=5, side=2)


@torch.no_grad()
def exact_first_three(m) -> np.ndarray:
    """P(x0, x1, x2) [V^3] from full forwards of the model's decoder over prompt + codes."""
    V = m.config.vq_config.num_embeddings
    lm, head = m.model.language_model, m.model.generation_head
    cond = torch.tensor(PROMPT)
    uncond = torch.where((cond == 1) | (cond == JANUS_BOI), cond, 0)  # Janus's unconditional prompt

    def next_law(prefix):  # prefix [N, n] codes -> [N, V]
        def logits(prompt):
            text = lm.embed_tokens(prompt).expand(prefix.shape[0], -1, -1)
            x = torch.cat([text, m.prepare_embeddings_for_image_generation(prefix)], 1)
            return head(lm(inputs_embeds=x).last_hidden_state[:, -1])

        c, u = logits(cond), logits(uncond)
        return torch.softmax(u + CFG * (c - u), -1)

    p0 = next_law(torch.zeros(1, 0, dtype=torch.int64))[0]
    p1 = next_law(torch.arange(V)[:, None])
    x01 = torch.stack(torch.meshgrid(torch.arange(V), torch.arange(V), indexing="ij"), -1).reshape(-1, 2)
    p2 = next_law(x01).reshape(V, V, V)
    return (p0[:, None, None] * p1[:, :, None] * p2).reshape(-1).numpy()


def sjd_counts(m) -> np.ndarray:
    V = m.config.vq_config.num_embeddings
    ids = torch.tensor([PROMPT]).expand(ROWS, -1)
    codes, _ = lantern.generate(wrap(m), ids, method="sjd", tree="chain", window=2, cfg_scale=CFG, seed=5,
                                length=3)
    return np.bincount((codes[:, 0] * V * V + codes[:, 1] * V + codes[:, 2]).numpy(), minlength=V ** 3).astype(float)


def test_delta0_sjd_reproduces_the_models_ar_law(janus5):
    assert_fits(g_test(sjd_counts(janus5), exact_first_three(janus5)), "(x0, x1, x2) under sjd through lantern.hf")


def test_negative_control_wrong_residual_fails(janus5, monkeypatch):
    def broken(*args, backend=None, **kwargs):  # ops.verify's signature; the faulty reference runs whatever backend
        return reference_verify.verify(*args, **kwargs, faults=("wrong_residual",))

    monkeypatch.setattr(ops, "verify", broken)
    assert_fails_widely(g_test(sjd_counts(janus5), exact_first_three(janus5)), "sjd with a wrong residual")
