"""draft_sample (SPEC §5, "Sampled drafts"): the cpu kernel against the reference over shapes x dtypes x settings
x draws; what the reference's definition says (greedy rows one-hot, draws distinct, +inf keys in token order,
row keys follow their rows); the draws' law (calibrated, with a negative control); bad input."""
from __future__ import annotations

import math

import pytest
import torch

import backends
import lantern
from lantern import ops
from lantern.ops.reference.draft_sample import draft_sample as reference
from lantern.ops.reference.process_logits import process_logits

pytest.importorskip("lantern._C", reason="lantern._C is not built (pip install --no-build-isolation -e .)")

SHAPES = [(1, 1, 7), (3, 2, 64), (4, 3, 1024)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
SETTINGS = {
    "plain": dict(),
    "temperature, top-k": dict(temperature=0.7, top_k=5),
    "top-p": dict(top_p=0.8),
    "per row, a greedy row": dict(temperature="rows", top_k="rows", top_p="rows"),
    "guided": dict(uncond=True, cfg_scale=2.5),
}


def _case(B, N, V, dtype, setting: dict, draws: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(B, N, V, generator=g)).to(dtype)
    kwargs = dict(draws=min(draws, V), seed=2**63 + seed, offset=seed + 11,
                  node_ids=torch.randint(0, 2**32, (B, N), generator=g),
                  rows=torch.randint(0, 2**32, (B,), generator=g))
    for name, value in setting.items():
        if name == "uncond":
            kwargs["uncond_logits"] = (3 * torch.randn(B, N, V, generator=g)).to(dtype)
        elif value == "rows":
            kwargs[name] = {"temperature": torch.tensor([0.0, 1.3, 0.6, 1.0][:B]),
                            "top_k": torch.tensor([0, 4, 0, 2][:B]),
                            "top_p": torch.tensor([1.0, 1.0, 0.7, 0.9][:B])}[name]
        else:
            kwargs[name] = value
    return logits, kwargs


@pytest.mark.parametrize("backend", backends.params(["cpu"]), indirect=True)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
@pytest.mark.parametrize("setting", list(SETTINGS), ids=list(SETTINGS))
@pytest.mark.parametrize("draws", [1, 3])
def test_the_kernel_draws_the_references_tokens(backend, shape, dtype, setting, draws):
    """Tokens exactly, probabilities within a few float32 ulps (the kernel sums in double, SPEC §5: a token may
    differ only where two keys tie to rounding, which these fixed cases do not)."""
    logits, kwargs = _case(*shape, dtype, SETTINGS[setting], draws)
    got = ops.draft_sample(logits, **kwargs)
    want = reference(logits, **kwargs)
    assert got.tokens.dtype == torch.int64 and got.probs.dtype == want.probs.dtype
    assert torch.equal(got.tokens, want.tokens)
    tol = 1e-12 if dtype == torch.float64 else 2e-6
    torch.testing.assert_close(got.probs, want.probs, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", backends.params(["reference", "cpu"]), indirect=True)
def test_a_greedy_row_drafts_its_top_token(backend):
    logits, kwargs = _case(3, 2, 50, torch.float32, dict(uncond=True, cfg_scale=1.5), 2)
    kwargs["temperature"] = torch.tensor([0.0, 1.0, 0.0])
    out = ops.draft_sample(logits, **kwargs)
    top = (kwargs["uncond_logits"] + 1.5 * (logits - kwargs["uncond_logits"])).argmax(-1)  # [B, N]
    for b in (0, 2):
        assert torch.equal(out.probs[b], torch.nn.functional.one_hot(top[b], 50).float())
        assert torch.equal(out.tokens[b, :, 0], top[b])
        for n in range(2):  # the second draw: +inf keys in token order, the top token excepted
            assert out.tokens[b, n, 1] == (1 if top[b, n] == 0 else 0)
    assert not torch.equal(out.probs[1], torch.nn.functional.one_hot(top[1], 50).float())


@pytest.mark.parametrize("backend", backends.params(["reference", "cpu"]), indirect=True)
def test_draws_are_distinct_and_the_top_k_set_comes_first(backend):
    logits, kwargs = _case(2, 3, 40, torch.float32, dict(top_k=3), 6)
    out = ops.draft_sample(logits, **kwargs)
    kept = logits.topk(3, dim=-1).indices.sort(-1).values  # [B, N, 3]
    assert torch.equal(out.tokens[..., :3].sort(-1).values, kept)
    for b in range(2):
        for n in range(3):
            rest = [t for t in range(40) if t not in kept[b, n].tolist()][:3]  # q = 0: token order
            assert out.tokens[b, n, 3:].tolist() == rest
            assert len(set(out.tokens[b, n].tolist())) == 6


@pytest.mark.parametrize("backend", backends.params(["reference", "cpu"]), indirect=True)
def test_a_row_keeps_its_draws_wherever_it_sits_with_its_key(backend):
    logits, kwargs = _case(4, 2, 300, torch.float32, {}, 2)
    out = ops.draft_sample(logits, **kwargs)
    order = torch.tensor([2, 0, 3, 1])
    moved = ops.draft_sample(logits[order], **dict(kwargs, node_ids=kwargs["node_ids"][order],
                                                   rows=kwargs["rows"][order]))
    assert torch.equal(moved.tokens, out.tokens[order])
    keyless = ops.draft_sample(logits, **dict(kwargs, rows=None))
    assert not torch.equal(keyless.tokens, out.tokens)  # the keys are in the counter (negative control)


CHI2_CRITICAL_7DF = 35.26  # P(chi2 with 7 d.o.f. > 35.26) = 1e-5: this test's false-failure rate


def _chi2(tokens: torch.Tensor, q: torch.Tensor) -> float:
    counts = torch.bincount(tokens, minlength=q.numel()).double()
    expected = q.double() * tokens.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("backend", backends.params(["cpu"]), indirect=True)
def test_the_first_draw_follows_q_and_the_second_the_rest(backend):
    """20 000 rows of one node (row keys 0..19 999): the first draw's counts against q, and the second draw's
    against q renormalised without the first, by Pearson's chi-square at a false-failure rate of 1e-5 each;
    negative control: the same counts against q with two tokens' masses swapped."""
    R, V = 20_000, 8
    logits = torch.tensor([0.0, 0.3, -0.5, 1.0, 0.2, -1.0, 0.7, 0.1]).expand(R, 1, V).contiguous()
    out = ops.draft_sample(logits, draws=2, seed=99, node_ids=torch.zeros(R, 1, dtype=torch.int64), offset=5,
                           rows=torch.arange(R))
    q = torch.softmax(logits[0, 0].double(), -1)
    first, second = out.tokens[:, 0, 0], out.tokens[:, 0, 1]
    assert _chi2(first, q) < CHI2_CRITICAL_7DF
    assert _chi2(first, q[[3, 1, 2, 0, 4, 5, 6, 7]]) > 10 * CHI2_CRITICAL_7DF
    # second draw given the first: sum over the first's outcomes of P(first = a) q_b / (1 - q_a), b != a
    pair = q[:, None] * q[None, :] / (1 - q[:, None])
    pair.fill_diagonal_(0)
    assert (first != second).all()
    assert _chi2(second, pair.sum(0)) < CHI2_CRITICAL_7DF
    assert _chi2(second, q) > 3 * CHI2_CRITICAL_7DF  # the second draw is not a fresh draw from q


BAD = [
    (dict(draws=0), ValueError, "draws"),
    (dict(draws=9), ValueError, "draws"),
    (dict(draws=1.0), TypeError, "draws"),
    (dict(node_ids=torch.zeros(2, dtype=torch.int64)), ValueError, "node_ids"),
    (dict(node_ids=torch.zeros(2, 3)), TypeError, "node_ids"),
    (dict(node_ids=torch.full((2, 3), 2**32)), ValueError, "node_ids"),
    (dict(rows=torch.zeros(3, dtype=torch.int64)), ValueError, "rows"),
    (dict(logits=torch.zeros(2, 8)), ValueError, "logits"),
    (dict(logits=torch.full((2, 3, 8), math.nan)), ValueError, "logits"),
    (dict(temperature=-1.0), ValueError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(offset=2**32), ValueError, "offset"),
]


@pytest.mark.parametrize("backend", backends.params(["reference", "cpu"]), indirect=True)
@pytest.mark.parametrize("override,exc,fragment", BAD, ids=[f"{i}-{e[2]}" for i, e in enumerate(BAD)])
@pytest.mark.no_kernel_check("bad input: refused before any kernel runs")
def test_bad_input_is_refused_naming_the_argument(backend, override, exc, fragment):
    kwargs = dict(logits=torch.zeros(2, 3, 8), draws=2, seed=1, node_ids=torch.zeros(2, 3, dtype=torch.int64))
    kwargs.update(override)
    with pytest.raises(exc, match=fragment):
        ops.draft_sample(**kwargs)


def test_the_reference_is_process_logits_and_the_race():
    """The reference's q is process_logits' wherever the row is not greedy (the definition it names)."""
    logits, kwargs = _case(3, 2, 64, torch.float32, dict(top_k=9, top_p=0.9, temperature=0.8), 1)
    with lantern.fused("reference"):
        out = ops.draft_sample(logits, **kwargs)
    assert torch.equal(out.probs, process_logits(logits, None, 1.0, 0.8, 9, 0.9))
