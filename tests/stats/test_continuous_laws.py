"""The laws of continuous_verify (docs/cspd.md), per backend, against exact laws (tests/stats/continuous.py):
- rule "exact": drafts x ~ q come out distributed as the target's N(mu_p, sigma_p^2) (2 channels, 64 cells);
- the residual sampler alone (every draft rejected): its outputs follow max(0, p - q) / Z, nothing lands where
  p <= q, and its tries are geometric with success Z, capped;
- the acceptance probability of a fixed draft: min(1, r) for both rules (the paper rule with its std ratio).
Each assertion is a G-test with false-failure rate <= 1e-6 (tests/stats/gtest.py); each has a negative
control, the reference with a deliberate fault, that fails it widely."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import backends
import lantern
from lantern.ops.reference.continuous_verify import continuous_verify as reference_continuous_verify

from .continuous import Residual, cells, gaussian_edges, geometric_tries
from .gtest import assert_fails_widely, assert_fits, g_test

DRAWS = 100_000  # tokens per call: [1000 rows, 100 positions], each keyed on its own
ROWS, POSITIONS = 1000, 100
SEED = 77


@pytest.fixture(params=backends.params(backends.NAMES))
def run(request):
    """continuous_verify under ``lantern.fused(name)`` on the backend's device, on and to CPU tensors."""
    device = backends.device_for(request.param)

    def call(**kwargs):
        moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        with lantern.fused(request.param):
            out = lantern.ops.continuous_verify(**moved)
        return type(out)(*(t.cpu() for t in out))

    return call


def faulty(*faults):
    return lambda **kwargs: reference_continuous_verify(**kwargs, faults=faults)


def block(mu_p, sigma_p, mu_q, sigma_q, draft=None, logsig_p=0.0, logsig_q=0.0, draft_seed=5) -> dict:
    """DRAWS copies of one token (per-channel lists), as [ROWS, POSITIONS, C]; drafts drawn from q (a torch
    generator, independent of the op's stream) unless given."""
    C = len(mu_p)
    full = lambda v: torch.tensor(v, dtype=torch.float32).expand(ROWS, POSITIONS, C).contiguous()
    mp, sp, mq, sq = full(mu_p), full(sigma_p), full(mu_q), full(sigma_q)
    if draft is None:
        g = torch.Generator().manual_seed(draft_seed)
        x = mq + sq * torch.randn(ROWS, POSITIONS, C, generator=g)
    else:
        x = full(draft)
    sums = lambda v: torch.full((ROWS, POSITIONS), v, dtype=torch.float32)
    return dict(draft=x, mu_p=mp, sigma_p=sp, mu_q=mq, sigma_q=sq, logsig_p=sums(logsig_p), logsig_q=sums(logsig_q),
                seed=SEED)


# ---- rule "exact": the output is the target's law ---------------------------------------------------------

EXACT = dict(mu_p=[0.3, -1.0], sigma_p=[0.5, 2.0], mu_q=[0.8, -0.2], sigma_q=[0.7, 1.5])
K = 8  # equiprobable cells per channel under p


def exact_law_test(verify):
    out = verify(**block(**EXACT), rule="exact")
    tokens = out.tokens.reshape(-1, 2).double().numpy()
    index = sum(cells(tokens[:, c], gaussian_edges(EXACT["mu_p"][c], EXACT["sigma_p"][c], K)) * K ** c
                for c in range(2))
    counts = np.bincount(index, minlength=K * K)
    return g_test(counts, np.full(K * K, 1.0 / K ** 2)), out


def test_exact_rule_outputs_the_targets_law(run):
    result, out = exact_law_test(run)
    assert_fits(result, "exact rule, 2 channels, 64 cells")
    accepted = float(out.accepted.float().mean())
    assert 0.2 < accepted < 0.8  # both branches carry weight in this case


@pytest.mark.parametrize("fault", ["first_proposal", "swapped_residual"])
def test_exact_rule_negative_controls(fault):
    assert_fails_widely(exact_law_test(faulty(fault))[0], f"exact rule with fault {fault}")


# ---- the residual sampler alone --------------------------------------------------------------------------

RESIDUAL = dict(mu_p=0.0, sigma_p=1.0, mu_q=0.7, sigma_q=1.5)  # p > q on one interval around p's mode
FAR = 40.0  # the draft, 40 target stds out: log r ~ -460, always rejected
RESIDUAL_CELLS = 30


def residual_block(**law):
    return block([law["mu_p"]], [law["sigma_p"]], [law["mu_q"]], [law["sigma_q"]], draft=[FAR])


def residual_test(verify):
    out = verify(**residual_block(**RESIDUAL), rule="exact")
    residual = Residual.of(**RESIDUAL, k=RESIDUAL_CELLS)
    counts, probs = residual.cells(out.tokens.flatten().double().numpy(), margin=1e-3)
    return g_test(counts, probs), out, residual


def test_residual_sampler_samples_max_p_minus_q(run):
    result, out, _ = residual_test(run)
    assert not out.accepted.any()
    assert_fits(result, "residual max(0, p - q) / Z: 30 equiprobable cells and 2 impossible ones")


@pytest.mark.parametrize("fault", ["first_proposal", "swapped_residual"])
def test_residual_negative_controls(fault):
    assert_fails_widely(residual_test(faulty(fault))[0], f"residual sampler with fault {fault}")


NEAR = dict(mu_p=0.0, sigma_p=1.0, mu_q=0.2, sigma_q=1.15)  # Z ~ 0.11: the cap of 6 tries is hit ~ 50 %
CAP = 6


def tries_test(verify):
    out = verify(**residual_block(**NEAR), rule="exact", max_tries=CAP)
    mass = Residual.of(**NEAR, k=2).mass
    counts = np.bincount(out.tries.flatten().numpy() - 1, minlength=CAP + 1)  # tries 1 .. CAP, CAP + 1 = capped
    return g_test(counts, geometric_tries(mass, CAP)), out


def test_residual_tries_are_geometric_and_capped(run):
    """Each proposal is kept with probability Z = TV(p, q), independently, up to the cap; a capped token holds
    its last proposal (tests/ops) and reports tries = max_tries + 1."""
    result, out = tries_test(run)
    assert_fits(result, f"tries 1..{CAP} and capped, geometric with the residual's mass")
    assert 0.3 < float((out.tries > CAP).float().mean()) < 0.7


def test_tries_negative_control():
    assert_fails_widely(tries_test(faulty("first_proposal"))[0], "tries with every first proposal kept")


# ---- the acceptance probability of a fixed draft ---------------------------------------------------------

def log_gaussian(x, mu, sigma, bandwidth=1.0):
    return -math.log(sigma) - 0.5 * ((x - mu) / (bandwidth * sigma)) ** 2


FIXED = dict(mu_p=0.0, sigma_p=1.0, mu_q=0.5, sigma_q=1.2, x=0.9)
ACCEPTANCE_CASES = {  # name: (op settings, logsig_p, logsig_q)
    "exact": (dict(rule="exact"), 0.0, 0.0),
    "paper, bandwidth 3, paper ratio": (dict(rule="paper", bandwidth=3.0, sigma_ratio="paper"), 0.4, -0.3),
    "paper, bandwidth 1, code ratio": (dict(rule="paper", bandwidth=1.0, sigma_ratio="code"), -0.5, 0.3),
}


def written_log_r(settings: dict, logsig_p: float, logsig_q: float) -> float:
    """docs/cspd.md for FIXED, in float64."""
    x, f = FIXED["x"], FIXED
    if settings["rule"] == "exact":
        return log_gaussian(x, f["mu_p"], f["sigma_p"]) - log_gaussian(x, f["mu_q"], f["sigma_q"])
    b = settings["bandwidth"]
    log_sigma = logsig_q - logsig_p if settings["sigma_ratio"] == "paper" else logsig_p - logsig_q
    return log_sigma + log_gaussian(x, f["mu_p"], f["sigma_p"], b) - log_gaussian(x, f["mu_q"], f["sigma_q"], b)


def acceptance_test(verify, name):
    settings, logsig_p, logsig_q = ACCEPTANCE_CASES[name]
    b = block([FIXED["mu_p"]], [FIXED["sigma_p"]], [FIXED["mu_q"]], [FIXED["sigma_q"]], draft=[FIXED["x"]],
              logsig_p=logsig_p, logsig_q=logsig_q)
    out = verify(**b, **settings)
    a = min(1.0, math.exp(written_log_r(settings, logsig_p, logsig_q)))
    accepted = int(out.accepted.sum())
    return g_test(np.array([accepted, DRAWS - accepted]), np.array([a, 1 - a])), a


@pytest.mark.parametrize("name", sorted(ACCEPTANCE_CASES))
def test_a_fixed_draft_is_accepted_with_probability_min_1_r(run, name):
    result, a = acceptance_test(run, name)
    assert 0.05 < a < 0.95
    assert_fits(result, f"acceptance of a fixed draft ({name}), P = {a:.4f}")


@pytest.mark.parametrize("name", [n for n in sorted(ACCEPTANCE_CASES) if n.startswith("paper")])
def test_acceptance_negative_control_dropped_std_ratio(name):
    assert_fails_widely(acceptance_test(faulty("dropped_std_ratio"), name)[0],
                        f"acceptance without the std ratio ({name})")
