"""Sampled speculative decoding at δ = 0 reproduces AR's law at the first positions, on the tiny default model
itself (the committed GPT-tiny-deep, V = 1024, its committed EAGLE drafter, CFG 2.0, temperature 1).

Each run generates the first two tokens (``length=2``) of ROWS images of one class. Calibrated G-tests per
tree kind (false-failure rate <= 1e-6 per assertion, see tests/stats/gtest.py):
- the joint law of (x0, x1) against P(x0) P(x1 | x0) (x0 is sampled at the prefill like AR; x1 is the first
  drafted position);
- the law of x1's rank bucket under P(. | x0) (its rank among the target's probabilities, ranks grouped
  by BUCKET_EDGES): a coarser function of the same draws, so it is as calibrated, and far more powerful
  against errors that move mass between likely and unlikely tokens than 10^6 mostly pooled (x0, x1) cells.
Position 2 is not tested here: too few (x0, x1) prefixes repeat in ROWS draws for a conditional test of x2
to have power (it did not reject the negative control below); tests/decoding/test_spec_statistics.py tests
whole (x0, x1) trees on a small model and tests/stats tests every tree depth of verify itself.
The exact laws come from ``forward_full`` (no cache, no drafter). The loop runs on the cpu kernels
(``lantern.fused("cpu")``, what ``enable_fused()`` picks on a CPU), which draw exactly what the reference ops draw
(tests/ops); on the reference ops these runs took twice as long. Negative control: both tests reject, by a
wide margin, a loop that verifies its trees without guidance (measured on the earlier 4-layer model: G = 873 on
116 df, threshold 213).
Subtler bugs are too small to see here with ROWS draws: a wrong residual (this drafter is close to the
target, so few rejections; measured G = 14 on 6 df against a threshold of 43) and a random stream reused
across steps; the small random model of tests/decoding/test_spec_statistics.py and the op-level harness
(tests/stats) catch the wrong residual widely.
"""
import numpy as np
import pytest
import torch

import lantern
from lantern import ops
from lantern.decoding import SpecConfig, generate_spec
from stats.gtest import assert_fails_widely, assert_fits, g_test

ROWS, LABEL, LENGTH = 3000, 3, 2
BUCKET_EDGES = (1, 2, 4, 8, 16, 32, 64, 128)  # rank buckets [0], [1], [2, 3], ..., [128, V)


@pytest.fixture(scope="module")
def tiny():
    from lantern.pretrained import load_tiny, load_tiny_drafter

    models = load_tiny()
    return models.gpt, load_tiny_drafter(models.gpt), models.meta["sampling"]["cfg_scale"]


@torch.no_grad()
def next_token_law(target, prefixes: torch.Tensor, cfg_scale: float) -> torch.Tensor:
    """prefixes [N, t] -> float64 [N, V]: the AR law of the next token (guidance, temperature 1, no filter)."""
    n = prefixes.shape[0]
    lab = torch.full((n,), LABEL)
    null = torch.full((n,), target.config.num_classes)
    lc = target.forward_full(prefixes, lab)[:, -1]
    lu = target.forward_full(prefixes, null)[:, -1]
    return ops.process_logits(lc, lu, cfg_scale=cfg_scale).double()


def first_tokens(tiny, config, seed=0):
    target, drafter, cfg_scale = tiny
    with lantern.fused("cpu"):
        out, _ = generate_spec(target, drafter, torch.full((ROWS,), LABEL), config=config, cfg_scale=cfg_scale,
                               seed=seed, length=LENGTH)
    return out  # [ROWS, 3]


def rank_buckets(laws: torch.Tensor):
    """laws [N, V] -> (bucket of each token [N, V] int64, each bucket's probability [N, nb] float64): tokens
    ranked by probability (ties by id), ranks grouped by BUCKET_EDGES."""
    order = torch.argsort(-laws, dim=1, stable=True)
    ranks = torch.empty_like(order).scatter_(1, order, torch.arange(laws.shape[1]).expand_as(order))
    bucket = torch.bucketize(ranks, torch.tensor(BUCKET_EDGES), right=True)
    nb = len(BUCKET_EDGES) + 1
    probs = torch.zeros(laws.shape[0], nb, dtype=torch.float64).scatter_add_(1, bucket, laws)
    return bucket, probs


@pytest.fixture(scope="module")
def laws(tiny):
    """The exact AR laws, the same for every test here (computed once): p0 [V] of x0, p1 [V (x0), V (x1)] of x1
    given x0, and x1's rank buckets under p1 (``rank_buckets``: [V, V] and [V, nb])."""
    target, _, cfg_scale = tiny
    V = target.config.vocab_size
    p0 = next_token_law(target, torch.zeros(1, 0, dtype=torch.int64), cfg_scale)[0]
    p1 = next_token_law(target, torch.arange(V)[:, None], cfg_scale)
    return p0, p1, *rank_buckets(p1)


def first_two_tests(laws, out):
    """(exact (x0, x1) test, test of x1's rank bucket)."""
    p0, p1, bucket, bucket_probs = laws
    V = p0.shape[0]
    counts = np.bincount((out[:, 0] * V + out[:, 1]).numpy(), minlength=V * V).astype(float)
    exact = g_test(counts, (p0[:, None] * p1).reshape(-1).numpy())
    nb = bucket_probs.shape[1]
    coarse = g_test(np.bincount(bucket[out[:, 0], out[:, 1]].numpy(), minlength=nb).astype(float),
                    (p0[:, None] * bucket_probs).sum(0).numpy())
    return exact, coarse


CONFIGS = [
    SpecConfig(method="spec", tree="static", static_widths=(3, 2)),
    SpecConfig(method="spec", tree="dynamic", depth=2, top_per_node=3, n_nodes=6),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"{c.tree}-{c.draft_kind()}")
def test_delta0_reproduces_ar_at_the_first_positions(tiny, laws, config):
    out = first_tokens(tiny, config)
    exact, coarse = first_two_tests(laws, out)
    assert_fits(exact, f"(x0, x1) under {config.tree}")
    assert_fits(coarse, f"rank bucket of x1 under {config.tree}")


def test_negative_control_unguided_verification_is_rejected(tiny, laws, monkeypatch):
    """A loop that verifies its trees without guidance (the first token is still guided)."""
    verify = ops.verify

    def unguided_trees(logits, tokens, *args, **kwargs):
        if tokens.shape[1] > 1:
            kwargs = {**kwargs, "uncond_logits": None, "cfg_scale": 1.0}
        return verify(logits, tokens, *args, **kwargs)

    monkeypatch.setattr(ops, "verify", unguided_trees)
    out = first_tokens(tiny, CONFIGS[0])
    exact, coarse = first_two_tests(laws, out)
    assert_fails_widely(exact, "unguided tree verification, (x0, x1)")
    assert_fails_widely(coarse, "unguided tree verification, rank bucket of x1")
