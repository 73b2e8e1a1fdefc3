"""continuous_verify (docs/cspd.md) on every backend: pinned cases re-derived from the test-side Philox
(the draft test, the first proposal, the cap keeping its last proposal), agreement with the reference on
random blocks of both rules (decisions and tries exactly, tokens within float32 rounding), the Philox keys
(rows / positions: a row's result does not depend on its batch), and bad input named in the error. The
laws are tested in tests/stats/test_continuous_laws.py."""
from __future__ import annotations

import math

import pytest
import torch

import backends
import lantern
from lantern.ops.reference.continuous_verify import continuous_verify as reference_continuous_verify
from lantern.ops.reference.noise import PURPOSE_ACCEPT, PURPOSE_RESIDUAL
from op_cases import assert_continuous_agree, continuous_block
from stats import philox_ref

SEED, OFFSET = 2**63 + 12345, 2**32 - 2  # the offset wraps: try k uses c3 = (offset + k) mod 2^32


def on(device, block: dict) -> dict:
    """The block's tensors moved to ``device`` (a meta tensor, the wrong-device input, stays)."""
    return {k: v.to(device) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v
            for k, v in block.items()}


def proposal(block, b, n, row, position, k, offset=OFFSET):
    """The residual sampler's proposal k for token (b, n), written out: mu_p + sigma_p xi (float64)."""
    C = block["draft"].shape[2]
    step = (offset + k) % 2**32
    xi = torch.tensor([philox_ref.gaussian(SEED, PURPOSE_RESIDUAL, row, position, step, c) for c in range(C)],
                      dtype=torch.float64)
    return block["mu_p"][b, n].double() + block["sigma_p"][b, n].double() * xi


def test_equal_laws_accept_and_far_drafts_take_the_first_proposal(backend, device):
    """p = q: log r = 0 > log u, every draft kept. A draft 50 target stds away under a drafter centred on it:
    rejected (log r ~ -1250 per channel), and the first proposal (q(y) ~ 0 there) is kept."""
    mu = torch.tensor([[0.5, -1.0, 2.0], [0.0, 0.25, -0.75]])  # [2, C = 3]
    sigma = torch.tensor([[0.5, 1.0, 0.25], [2.0, 0.125, 1.0]])
    far = mu + 50 * sigma
    block = dict(draft=torch.stack([mu + 0.3 * sigma, far]), mu_p=torch.stack([mu, mu]),
                 sigma_p=torch.stack([sigma, sigma]), mu_q=torch.stack([mu, far]), sigma_q=torch.stack([sigma, sigma]),
                 logsig_p=torch.zeros(2, 2), logsig_q=torch.zeros(2, 2))  # [B = 2, N = 2, C]
    rows, positions = torch.tensor([3, 2**32 - 1]), torch.tensor([[10, 11], [0, 4095]])
    out = lantern.ops.continuous_verify(**on(device, block), seed=SEED, offset=OFFSET, rows=rows.to(device),
                                        positions=positions.to(device))
    assert out.accepted.tolist() == [[True, True], [False, False]]
    assert out.tries.tolist() == [[0, 0], [1, 1]]
    torch.testing.assert_close(out.tokens[0].cpu(), block["draft"][0], rtol=0, atol=0)
    for n in range(2):
        want = proposal(block, 1, n, int(rows[1]), int(positions[1, n]), 1)
        torch.testing.assert_close(out.tokens[1, n].cpu().double(), want, rtol=1e-5, atol=1e-5)


def test_the_draft_test_uses_its_own_uniform(backend, device):
    """A one-channel token with log r = log 0.5 exactly (sigma_p = 2 sigma_q, x = mu): kept iff the try-0
    uniform of purpose PURPOSE_ACCEPT is below 0.5, for 16 keys."""
    n = 16
    ones = torch.ones(1, n, 1)
    block = dict(draft=0 * ones, mu_p=0 * ones, sigma_p=2 * ones, mu_q=0 * ones, sigma_q=ones,
                 logsig_p=torch.zeros(1, n), logsig_q=torch.zeros(1, n))
    out = lantern.ops.continuous_verify(**on(device, block), seed=SEED, offset=OFFSET,
                                        rows=torch.tensor([77], device=device))
    u = [float(philox_ref.uniform(SEED, PURPOSE_ACCEPT << 24, 77, p, OFFSET)) for p in range(n)]
    assert out.accepted[0].tolist() == [math.log(x) < math.log(0.5) for x in u]
    assert 0 < sum(out.accepted[0].tolist()) < n  # both outcomes occur


def test_the_cap_keeps_the_last_proposal_and_reports_it(backend, device):
    """q a hair wider than p and the draft 100 drafter stds out: always rejected, and the residual
    max(0, p - q) / p < 0.4 % everywhere, so with 3 tries most tokens hit the cap: they report tries = 4 and
    hold proposal 3 (a plain target sample, never a placeholder); the others hold the proposal they kept."""
    B, N, C, tries = 2, 8, 4, 3
    block = continuous_block(5, B, N, C)
    block["mu_q"] = block["mu_p"].clone()
    block["sigma_q"] = block["sigma_p"] * 1.001
    block["draft"] = block["mu_p"] + 100 * block["sigma_q"]
    out = lantern.ops.continuous_verify(**on(device, block), max_tries=tries, seed=SEED, offset=OFFSET)
    assert not out.accepted.any()
    assert ((out.tries >= 1) & (out.tries <= tries + 1)).all()
    capped = out.tries == tries + 1
    assert int(capped.sum()) >= B * N // 2
    for b in range(B):
        for n in range(N):
            k = min(int(out.tries[b, n]), tries)
            torch.testing.assert_close(out.tokens[b, n].cpu().double(), proposal(block, b, n, b, n, k),
                                       rtol=1e-5, atol=1e-5)


RULES = [dict(rule="exact"), dict(rule="paper"), dict(rule="paper", bandwidth=42.0, sigma_ratio="code"),
         dict(rule="paper", bandwidth=0.5, sigma_ratio="paper", max_tries=2)]
CASES = [(seed, shape, rule) for seed, shape in enumerate([(4, 16, 16), (1, 1, 1), (3, 37, 5), (8, 8, 33)])
         for rule in RULES]
SMALL_CASES = [(seed, (2, 3, 4), rule) for seed, rule in enumerate(RULES)]


@pytest.mark.parametrize("backend,case", backends.case_params(backends.NAMES, CASES, SMALL_CASES), indirect=["backend"])
def test_agrees_with_the_reference(backend, device, case):
    seed, (B, N, C), rule = case
    block = continuous_block(100 + seed, B, N, C, gap=[0.1, 0.5, 2.0][seed % 3])
    g = torch.Generator().manual_seed(seed)
    keys = dict(rows=torch.randint(0, 2**32, (B,), generator=g), positions=torch.randint(0, 4096, (B, N), generator=g),
                seed=2**64 - 1 - seed, offset=OFFSET)
    want = reference_continuous_verify(**block, **rule, **keys)
    got = lantern.ops.continuous_verify(**on(device, block), **rule, **on(device, keys))
    assert_continuous_agree(got, want)
    assert want.accepted.any() or B * N < 4  # the cases exercise both branches
    assert (want.tries > 0).any() or B * N < 4


def test_a_row_does_not_depend_on_its_batch(backend, device):
    """Keyed by (rows[b], positions[b, n], try): a row verified alone equals the same row in a batch."""
    block = continuous_block(9, 3, 5, 4, gap=1.0)
    rows, positions = torch.tensor([4, 0, 9]), torch.randperm(64)[:15].view(3, 5)
    together = lantern.ops.continuous_verify(**on(device, block), seed=SEED, rows=rows.to(device),
                                             positions=positions.to(device))
    for b in range(3):
        alone = lantern.ops.continuous_verify(**on(device, {k: v[b:b + 1] for k, v in block.items()}), seed=SEED,
                                              rows=rows[b:b + 1].to(device), positions=positions[b:b + 1].to(device))
        assert_continuous_agree(alone, type(together)(*(t[b:b + 1] for t in together)), rtol=0, atol=0)


def test_default_keys_are_row_and_block_index(backend, device):
    block = on(device, continuous_block(11, 2, 6, 3, gap=1.0))
    default = lantern.ops.continuous_verify(**block, seed=7)
    explicit = lantern.ops.continuous_verify(**block, seed=7, rows=torch.arange(2, device=device),
                                             positions=torch.arange(6, device=device).repeat(2, 1))
    assert_continuous_agree(default, explicit, rtol=0, atol=0)


def test_numpy_scalar_settings_mean_their_python_numbers(backend, device):
    """np.float32 bandwidth, np.int64 max_tries, np.uint64 seed, np.int32 offset: read as the Python numbers
    they hold (lantern.ops' rule for every op), not refused."""
    import numpy as np

    block = on(device, continuous_block(4, 2, 5, 3, gap=2.0))
    plain = dict(rule="paper", bandwidth=2.5, sigma_ratio="code", max_tries=3, seed=2**63 + 7, offset=2**32 - 2)
    numpy = dict(plain, bandwidth=np.float32(2.5), max_tries=np.int64(3), seed=np.uint64(2**63 + 7),
                 offset=np.uint32(2**32 - 2))
    want = lantern.ops.continuous_verify(**block, **plain)
    assert_continuous_agree(lantern.ops.continuous_verify(**block, **numpy), want, rtol=0, atol=0)
    assert want.accepted.any() and (want.tries > 0).any()
    with pytest.raises(ValueError, match="max_tries"):
        lantern.ops.continuous_verify(**block, max_tries=np.bool_(True))


def _bad(block: dict, name: str, value) -> dict:
    return dict(block, **{name: value})


BAD = [
    ("NaN mean", lambda b: _bad(b, "mu_p", b["mu_p"].index_fill(2, torch.tensor([0]), float("nan"))), ValueError,
     "mu_p"),
    ("inf draft", lambda b: _bad(b, "draft", b["draft"].index_fill(1, torch.tensor([1]), float("inf"))), ValueError,
     "draft"),
    ("zero std", lambda b: _bad(b, "sigma_q", b["sigma_q"].index_fill(2, torch.tensor([1]), 0.0)), ValueError,
     "sigma_q"),
    ("negative std", lambda b: _bad(b, "sigma_p", -b["sigma_p"]), ValueError, "sigma_p"),
    ("NaN log-std sum", lambda b: _bad(b, "logsig_q", b["logsig_q"] * float("nan")), ValueError, "logsig_q"),
    ("shape", lambda b: _bad(b, "mu_q", b["mu_q"][:, :1]), ValueError, "mu_q"),
    ("sums shape", lambda b: _bad(b, "logsig_p", b["logsig_p"][:, :, None]), ValueError, "logsig_p"),
    ("dtype", lambda b: _bad(b, "sigma_p", b["sigma_p"].double()), TypeError, "sigma_p"),
    ("draft rank", lambda b: _bad(b, "draft", b["draft"][0]), ValueError, "draft"),
    ("device", lambda b: _bad(b, "mu_q", torch.empty(b["mu_q"].shape, device="meta")), ValueError, "mu_q"),
    ("rule", lambda b: _bad(b, "rule", "lossy"), ValueError, "rule"),
    ("sigma_ratio", lambda b: _bad(b, "sigma_ratio", "sideways"), ValueError, "sigma_ratio"),
    ("bandwidth", lambda b: _bad(_bad(b, "rule", "paper"), "bandwidth", 0.0), ValueError, "bandwidth"),
    ("bandwidth for exact", lambda b: _bad(b, "bandwidth", 42.0), ValueError, "bandwidth"),
    ("max_tries", lambda b: _bad(b, "max_tries", 0), ValueError, "max_tries"),
    ("seed", lambda b: _bad(b, "seed", -1), ValueError, "seed"),
    ("rows range", lambda b: _bad(b, "rows", torch.tensor([0, 2**32])), ValueError, "rows"),
    ("positions shape", lambda b: _bad(b, "positions", torch.zeros(2, 1, dtype=torch.int64)), ValueError,
     "positions"),
]


@pytest.mark.parametrize("label,mutate,error,name", BAD, ids=[b[0] for b in BAD])
@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_bad_input_is_named(backend, device, label, mutate, error, name):
    block = on(device, mutate(continuous_block(3, 2, 4, 3)))
    with pytest.raises(error, match=name):
        lantern.ops.continuous_verify(**block)


@pytest.mark.skipif(backends.why_unavailable("cpu") is not None, reason="lantern._C is not built")
def test_the_cpu_kernel_checks_its_arguments_when_called_directly():
    from lantern.ops import continuous_verify_op

    block = continuous_block(3, 2, 4, 3)
    args = list(continuous_verify_op.to_schema("cpu", *block.values(), "exact", 1.0, "paper", 10, 0, 0))
    args[3] = args[3][:, :2]  # mu_q
    with pytest.raises(ValueError, match="mu_q"):
        torch.ops.lantern.continuous_verify(*args)
    args = list(continuous_verify_op.to_schema("cpu", *block.values(), "sideways", 1.0, "paper", 10, 0, 0))
    with pytest.raises(ValueError, match="rule"):
        torch.ops.lantern.continuous_verify(*args)
