"""SPEC §1 (process_logits against the independent float64 definition in target64.py) and SPEC §5
(philox_uniform against the five known answers and the independent scalar Philox in philox_ref.py)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import lantern

from . import philox_ref
from .target64 import target_distribution

SETTINGS = [  # (cfg_scale, temperature, top_k, top_p)
    (1.0, 1.0, 0, 1.0), (3.0, 1.0, 0, 1.0), (1.5, 0.7, 0, 1.0), (1.0, 1.0, 5, 1.0), (1.0, 1.0, 0, 0.8),
    (2.0, 1.3, 6, 0.9), (4.0, 0.5, 3, 0.5), (1.0, 1.0, 15, 0.99), (2.0, 0.0, 4, 0.5),  # last: greedy
]


def near_top_p_boundary(l: np.ndarray, temperature: float, top_k: int, top_p: float, tol: float) -> bool:
    """True if a token's 'mass strictly above it' is within tol of top_p (rounding could flip it)."""
    if top_p >= 1 or temperature == 0:
        return False
    p = target_distribution(l, None, 1.0, temperature, top_k, 1.0)
    above = np.array([p[p > x].sum() for x in p])
    return bool(np.any(np.abs(above - top_p) < tol))


@pytest.mark.parametrize("cfg, temperature, top_k, top_p", SETTINGS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_process_logits_matches_float64_definition(cfg, temperature, top_k, top_p, dtype):
    rng = np.random.default_rng(int(cfg * 100 + temperature * 10 + top_k + top_p * 1000))
    V, N = 16, 64
    cond, uncond = rng.normal(0, 2, (N, V)), rng.normal(0, 2, (N, V))
    if dtype == torch.float32:  # the op's float32 math must see the same inputs as the oracle
        cond, uncond = cond.astype(np.float32).astype(np.float64), uncond.astype(np.float32).astype(np.float64)
    got = lantern.ops.process_logits(torch.as_tensor(cond, dtype=dtype), torch.as_tensor(uncond, dtype=dtype),
                                     cfg, temperature, top_k, top_p).double().numpy()
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    checked = 0
    for i in range(N):
        guided = uncond[i] + cfg * (cond[i] - uncond[i])
        if near_top_p_boundary(guided, temperature, top_k, top_p, 1e-5):
            continue
        want = target_distribution(cond[i], uncond[i], cfg, temperature, top_k, top_p)
        assert np.array_equal(got[i] > 0, want > 0), (i, got[i], want)
        np.testing.assert_allclose(got[i], want, rtol=0, atol=tol)
        checked += 1
    assert checked >= N - 4


def probs_of(logits, **kw) -> np.ndarray:
    return lantern.ops.process_logits(torch.tensor([logits], dtype=torch.float64), **kw)[0].double().numpy()


def test_top_k_keeps_every_tie_at_the_threshold():
    p = probs_of([3.0, 2.0, 2.0, 2.0, 1.0, 0.0], top_k=2)
    assert (p > 0).tolist() == [True, True, True, True, False, False]


def test_top_p_ties_kept_together():
    """pi of logits [2, 1, 1, 0]: tokens 1 and 2 have pi_0 strictly above them."""
    logits = [2.0, 1.0, 1.0, 0.0]
    pi = target_distribution(logits)
    assert (probs_of(logits, top_p=pi[0] + 1e-3) > 0).tolist() == [True, True, True, False]
    assert (probs_of(logits, top_p=pi[0] - 1e-3) > 0).tolist() == [True, False, False, False]


def test_top_p_all_tied_tokens_survive_any_threshold():
    """Nothing is strictly more probable than a tied maximum, so equal logits are never cut (a sorted
    cumulative rule would keep only one)."""
    p = probs_of([0.0, 0.0, 0.0, 0.0, -1.0], top_p=0.1)
    assert (p > 0).tolist() == [True, True, True, True, False]
    np.testing.assert_allclose(p[:4], 0.25, rtol=0, atol=1e-15)


def test_top_p_boundary_is_inclusive():
    """keep i iff mass strictly above <= top_p: logits [ln 2, 0, 0] give pi = [1/2, 1/4, 1/4] exactly
    in binary; with top_p = 1/2 the tied pair has exactly 1/2 above it and is kept (top_p just below
    1/2 drops it)."""
    logits = [np.log(2.0), 0.0, 0.0]
    assert probs_of(logits).tolist() == [0.5, 0.25, 0.25]  # precondition: exact binary fractions
    assert (probs_of(logits, top_p=0.5) > 0).tolist() == [True, True, True]
    assert (probs_of(logits, top_p=0.4999) > 0).tolist() == [True, False, False]


def test_greedy_rows_are_unfiltered_softmax_of_guided_logits():
    cond, uncond = np.array([1.0, 0.5, -1.0, 2.0]), np.array([0.0, 1.0, 0.0, 0.0])
    p = lantern.ops.process_logits(torch.tensor(cond[None]), torch.tensor(uncond[None]), 3.0, 0.0, 1, 0.1)[0]
    guided = uncond + 3.0 * (cond - uncond)
    np.testing.assert_allclose(p.double().numpy(), np.exp(guided) / np.exp(guided).sum(), rtol=0, atol=1e-12)


def test_per_row_settings_equal_scalar_settings():
    rng = np.random.default_rng(3)
    logits = torch.as_tensor(rng.normal(0, 2, (4, 10)))
    temps, ks, ps = [0.0, 0.5, 1.0, 2.0], [0, 3, 5, 9], [1.0, 0.5, 0.9, 0.7]
    rows = lantern.ops.process_logits(logits, None, 1.0, torch.tensor(temps, dtype=torch.float64),
                                      torch.tensor(ks), torch.tensor(ps, dtype=torch.float64))
    for i in range(4):
        single = lantern.ops.process_logits(logits[i:i + 1], None, 1.0, temps[i], ks[i], ps[i])
        assert torch.equal(rows[i], single[0])


# ---- §5 -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed, counter, word, u, e", philox_ref.KNOWN_ANSWERS)
def test_philox_known_answers(seed, counter, word, u, e):
    assert philox_ref.philox4x32_10(seed, counter)[0] == word  # the test-side Philox itself
    got = lantern.ops.philox_uniform(seed, *counter)
    assert got.dtype == torch.float32
    assert float(got) == u
    assert float(-torch.log1p(-got)) == e


def test_philox_matches_independent_implementation_on_random_counters():
    rng = np.random.default_rng(11)
    n = 300
    counters = [rng.integers(0, 2**32, n, dtype=np.uint64).astype(np.int64) for _ in range(4)]
    for seed in (0, 7, 2**40 + 3, 2**64 - 1):
        got = lantern.ops.philox_uniform(seed, *(torch.as_tensor(c) for c in counters))
        want = np.array([philox_ref.uniform(seed, *(int(c[i]) for c in counters)) for i in range(n)])
        assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)


def test_philox_broadcasts_and_takes_tensor_seed():
    tokens, rows = torch.arange(5)[None, :], torch.arange(3)[:, None]
    got = lantern.ops.philox_uniform(torch.tensor(42), tokens, 9, rows, 1000)
    assert got.shape == (3, 5)
    for r in range(3):
        for t in range(5):
            assert float(got[r, t]) == float(philox_ref.uniform(42, t, 9, r, 1000))
    assert torch.equal(got, lantern.ops.philox_uniform(42, tokens, 9, rows, 1000))
