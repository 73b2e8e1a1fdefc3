"""Pinned semantics of lantern.ops.verify (SPEC §3-5 and the project's documented choices): edge cases
with exactly predictable outcomes. Uniforms and exponential races are predicted with the independent
scalar Philox in tests/stats/philox_ref.py (acceptance uniform of node c in row b: counter
(0x80000000, c, b, offset); race at node n: (token, n, b, offset))."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import backends

from stats import oracle, philox_ref
from stats.harness import backend_verify
from stats.random_trees import random_batch
from stats.target64 import target_distribution

NEG = -np.inf


@pytest.fixture
def verify(backend):
    """lantern.ops.verify on each backend (the ``backend`` fixture, tests/ops/conftest.py), taking and
    returning CPU tensors (stats.harness.backend_verify)."""
    return backend_verify(backend)


def tree_batch(logits, tokens, parents, B=1):
    """[T, V] logits and [T] tokens/parents repeated over B rows, as tensors."""
    logits = torch.as_tensor(np.asarray(logits, dtype=np.float64))
    return (logits.expand(B, *logits.shape).contiguous(), torch.tensor([tokens] * B), torch.tensor([parents] * B))


def race(P, seed, node, row, offset=0):
    return philox_ref.race_winner(P, seed, node, row, offset)


def no_nbrs(V, K=2):
    return torch.tensor([[(x + d) % V for d in range(1, K + 1)] for x in range(V)], dtype=torch.int32)


# ---- one-hot targets, rejection, bonus, residual ----------------------------------------------------

def test_one_hot_targets_accept_the_token_and_reject_others(verify):
    """P_0 = one-hot(2): child with token 2 is always accepted, a child with any other token never; a
    root whose every child is rejected emits 2."""
    row = [NEG, NEG, 0.0, NEG, NEG]
    logits, tokens, parents = tree_batch([row, row, row], [0, 2, 3], [-1, 0, 0], B=64)
    r = verify(logits, tokens, parents, seed=3)
    assert r.path[:, 0].eq(1).all() and r.accept_len.eq(1).all() and r.node_status[:, 2].eq(-1).all()
    logits, tokens, parents = tree_batch([row, row, row], [0, 4, 3], [-1, 0, 0], B=64)
    r = verify(logits, tokens, parents, seed=3)
    assert r.accept_len.eq(0).all() and r.next_token.eq(2).all()
    assert r.node_status[:, 1:].eq(0).all()


def test_one_hot_sampled_draft_always_accepted(verify):
    """Sampled drafts: u q'(x) < p~(x) = 1 holds for every u < 1."""
    row = [NEG, 0.0, NEG, NEG]
    logits, tokens, parents = tree_batch([row, row], [0, 1], [-1, 0], B=64)
    draft = torch.tensor([[0.1, 0.3, 0.5, 0.1]] * 2, dtype=torch.float64).expand(64, 2, 4).contiguous()
    assert verify(logits, tokens, parents, draft_probs=draft).accept_len.eq(1).all()


def test_all_children_rejected_samples_the_residual(verify):
    """Children whose tokens top-k filtered out (P = 0) are rejected; with delta = 0 the residual is P_0
    itself, sampled by the race keyed by node 0."""
    V, B, seed = 8, 200, 17
    rng = np.random.default_rng(0)
    logits = rng.normal(0, 1, (3, V))
    cut = np.argsort(logits[0])[:2].tolist()  # the two least likely tokens: removed by top_k = V - 2
    l, tok, par = tree_batch(logits, [0] + cut, [-1, 0, 0], B)
    r = verify(l, tok, par, top_k=V - 2, seed=seed)
    P0 = target_distribution(logits[0], top_k=V - 2)
    assert r.accept_len.eq(0).all() and r.node_status[:, 1:].eq(0).all()
    for b in range(B):
        winner, gap = race(P0, seed, 0, b)
        if gap > 1e-5:
            assert int(r.next_token[b]) == winner, b


def test_leaf_bonus_token_is_raced_at_the_leaf(verify):
    """A chain of one-hot targets is accepted to the leaf (node 3); the bonus token is the race over
    P_3 keyed by node 3."""
    V, B, seed, offset = 6, 200, 5, 77
    hot = lambda t: [0.0 if v == t else NEG for v in range(V)]
    leaf = np.random.default_rng(1).normal(0, 1, V)
    l, tok, par = tree_batch([hot(1), hot(2), hot(3), leaf], [0, 1, 2, 3], [-1, 0, 1, 2], B)
    r = verify(l, tok, par, seed=seed, offset=offset)
    assert r.accept_len.eq(3).all() and r.path.tolist() == [[1, 2, 3]] * B
    P3 = target_distribution(leaf)
    for b in range(B):
        winner, gap = race(P3, seed, 3, b, offset)
        if gap > 1e-5:
            assert int(r.next_token[b]) == winner, b


def test_zero_mass_residual_falls_back_to_the_node_distribution(verify):
    """Sampled drafts with q' = P_0 exactly (P_0 = 1/4 on four tokens, exact in binary) and a drafted
    token x with P_0(x) = q'(x) = 0: x is rejected (u * 0 < 0 is false) and max(0, p - q') is zero
    everywhere, so next_token comes from P_0: the race over P_0 at node 0."""
    V, B, seed = 6, 100, 9
    row = [0.0, 0.0, 0.0, 0.0, NEG, NEG]
    P0 = np.array([0.25, 0.25, 0.25, 0.25, 0, 0])
    l, tok, par = tree_batch([row, row], [0, 5], [-1, 0], B)
    draft = torch.as_tensor(np.stack([P0, P0])).expand(B, 2, V).contiguous()
    r = verify(l, tok, par, draft_probs=draft, seed=seed)
    assert r.accept_len.eq(0).all() and r.node_status[:, 1].eq(0).all()
    for b in range(B):
        assert int(r.next_token[b]) == race(P0, seed, 0, b)[0], b


# ---- the acceptance uniform ----------------------------------------------------------------------

def test_acceptance_uses_the_node_uniform_deterministic(verify):
    """One child (node 1): accepted iff u < P_0(x), u = Philox(seed, (0x80000000, 1, row, offset))."""
    V, B, seed, offset = 5, 300, 1234, 6
    rng = np.random.default_rng(2)
    logits = rng.normal(0, 1, (B, 2, V))
    tokens = torch.tensor([[0, 3]] * B)
    r = verify(torch.as_tensor(logits), tokens, torch.tensor([[-1, 0]] * B), seed=seed, offset=offset)
    for b in range(B):
        p = target_distribution(logits[b, 0])[3]
        u = float(philox_ref.accept_uniform(seed, 1, b, offset))
        if abs(u - p) > 1e-6:
            assert int(r.accept_len[b]) == int(u < p), b


def test_acceptance_uses_the_node_uniform_sampled(verify):
    """Sampled drafts, second child (node 2) after the first is rejected: accept iff u_2 q'(x) < p'(x),
    with p' = normalise(max(0, P_0 - q)) and q' = q without the first token, renormalised."""
    V, B, seed = 5, 300, 99
    rng = np.random.default_rng(3)
    logits = rng.normal(0, 1, (B, 3, V))
    q = np.exp(rng.normal(0, 1, (B, 3, V)))
    q /= q.sum(-1, keepdims=True)
    tokens, parents = torch.tensor([[0, 1, 4]] * B), torch.tensor([[-1, 0, 0]] * B)
    r = verify(torch.as_tensor(logits), tokens, parents, draft_probs=torch.as_tensor(q), seed=seed)
    checked = 0
    for b in range(B):
        P = target_distribution(logits[b, 0])
        u1 = float(philox_ref.accept_uniform(seed, 1, b, 0))
        if abs(u1 * q[b, 0, 1] - P[1]) < 1e-6:
            continue
        if u1 * q[b, 0, 1] < P[1]:
            assert int(r.path[b, 0]) == 1
            continue
        p2 = np.maximum(0, P - q[b, 0])
        p2 /= p2.sum()
        q2 = q[b, 0].copy()
        q2[1] = 0
        q2 /= q2.sum()
        u2 = float(philox_ref.accept_uniform(seed, 2, b, 0))
        if abs(u2 * q2[4] - p2[4]) > 1e-6:
            assert int(r.node_status[b, 2]) == int(u2 * q2[4] < p2[4]), b
            checked += 1
    assert checked > 50


# ---- exact reductions: k = 0, delta = 0, lambda = 1 -------------------------------------------------

@pytest.mark.parametrize("sampled", [False, True])
def test_k0_delta0_and_lambda1_are_all_the_same_walk(verify, sampled):
    """k = 0 (any delta), delta = 0 (any k), lambda = 1 and k = 0 with lambda > 1: identical results."""
    variants = [oracle.Relaxation(k=0, delta=0.5), oracle.Relaxation(k=4), oracle.Relaxation(k=4, lam=1.0),
                oracle.Relaxation(k=0, lam=3.0), oracle.Relaxation(k=4, budget="node")]
    results = []
    for relax in variants:
        batch = random_batch(21, B=400, T=8, V=10, K=4, relax=relax, sampled=sampled)
        results.append(verify(*batch.tensors(), **batch.kwargs(seed=8)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
    relaxed = random_batch(21, B=400, T=8, V=10, K=4, relax=oracle.Relaxation(k=4, delta=0.3), sampled=sampled)
    assert not torch.equal(verify(*relaxed.tensors(), **relaxed.kwargs(seed=8)).accept_len, results[0].accept_len)


@pytest.mark.no_kernel_check("bad input: rejected before any kernel runs")
def test_lambda_with_node_budget_is_rejected(verify):
    l, tok, par = tree_batch(np.zeros((2, 4)), [0, 1], [-1, 0])
    with pytest.raises(ValueError, match="budget"):
        verify(l, tok, par, no_nbrs(4), k=1, lam=2.0, budget="node")


def test_candidate_budget_merges_neighbours_into_acceptance(verify):
    """P_0 uniform over 8 tokens, x = 0 with neighbours 1, 2, 3: delta = 0.25 merges two (p~ = 3/8),
    so the child is accepted iff u < 3/8; delta = 0.2 merges one (p~ = 1/4)."""
    V, B, seed = 8, 400, 4
    nbrs = torch.tensor([[(x + d) % V for d in (1, 2, 3)] for x in range(V)], dtype=torch.int32)
    l, tok, par = tree_batch(np.zeros((2, V)), [0, 0], [-1, 0], B)
    for delta, p_tilde in ((0.25, 3 / 8), (0.2, 2 / 8)):
        r = verify(l, tok, par, nbrs, k=3, delta=delta, seed=seed)
        want = [int(float(philox_ref.accept_uniform(seed, 1, b, 0)) < p_tilde) for b in range(B)]
        assert r.accept_len.tolist() == want


def test_rejection_zeroes_exactly_the_merged_set(verify):
    """After rejecting x = 0 with A(x) = {0, 1} (delta = 0.25 on P uniform over 4: c_1 = 1/4 <= delta,
    c_2 = 1/2 > delta), the residual is uniform on {2, 3}: neighbour 2 (the (m*+1)-th, which upstream
    LANTERN also zeroed) keeps its mass."""
    V, B, seed = 4, 400, 12
    nbrs = torch.tensor([[1, 2], [2, 3], [3, 0], [0, 1]], dtype=torch.int32)
    l, tok, par = tree_batch(np.zeros((2, V)), [0, 0], [-1, 0], B)
    r = verify(l, tok, par, nbrs, k=2, delta=0.25, seed=seed)
    rejected = r.accept_len.eq(0)
    assert 0 < int(rejected.sum()) < B
    residual = np.array([0.0, 0.0, 0.5, 0.5])
    for b in np.flatnonzero(rejected.numpy()):
        assert int(r.next_token[b]) == race(residual, seed, 0, int(b))[0]


# ---- padding, ties, guidance, settings, seed/offset -------------------------------------------------

@pytest.mark.parametrize("sampled", [False, True])
def test_padding_nodes_change_nothing(verify, sampled):
    """Padding nodes (parent -1, token -1) anywhere: never tested, status -1, never on the path; their
    logits and draft rows do not matter; trailing padding leaves every decision unchanged."""
    batch = random_batch(31, B=300, T=6, V=8, K=4, relax=oracle.Relaxation(k=2, delta=0.1), sampled=sampled)
    base = verify(*batch.tensors(), **batch.kwargs(seed=2))
    B, T, V = batch.shape
    padded_logits = np.concatenate([batch.logits, np.random.default_rng(0).normal(0, 5, (B, 3, V))], 1)
    padded = random_batch(31, B=300, T=6, V=8, K=4, relax=batch.relax, sampled=sampled)
    padded.logits = padded_logits
    padded.uncond = np.concatenate([batch.uncond, np.zeros((B, 3, V))], 1)
    padded.tokens = np.concatenate([batch.tokens, np.full((B, 3), -1)], 1)
    padded.parents = np.concatenate([batch.parents, np.full((B, 3), -1)], 1)
    if sampled:
        padded.draft = np.concatenate([batch.draft, np.full((B, 3, V), 1.0 / V)], 1)
    out = verify(*padded.tensors(), **padded.kwargs(seed=2))
    assert torch.equal(out.accept_len, base.accept_len) and torch.equal(out.next_token, base.next_token)
    assert torch.equal(out.path[:, :T - 1], base.path) and out.path[:, T - 1:].eq(-1).all()
    assert torch.equal(out.node_status[:, :T], base.node_status) and out.node_status[:, T:].eq(-1).all()
    assert (batch.parents[:, 1:] < 0).any(), "the generator should produce interior padding too"
    interior = torch.as_tensor(batch.parents < 0)
    interior[:, 0] = False
    assert base.node_status[interior].eq(-1).all()


def test_greedy_ties_go_to_the_lower_index(verify):
    """Greedy, P_0 with tokens 1 and 2 tied at the top: child token 2 fails, child token 1 passes, and
    with no child the next token is 1."""
    row = [0.0, 3.0, 3.0, 1.0]
    l, tok, par = tree_batch([row, row, row], [0, 2, 1], [-1, 0, 0])
    r = verify(l, tok, par, temperature=0.0)
    assert r.node_status.tolist() == [[-1, 0, 1]] and r.path.tolist() == [[2, -1]]
    l, tok, par = tree_batch([row], [0], [-1])
    assert int(verify(l, tok, par, temperature=0.0).next_token) == 1


def test_greedy_path_ties_go_to_the_lower_node(verify):
    """Two passing leaves at the same depth: the lower node index is the path."""
    row = [0.0, 3.0, 3.0, 1.0]
    l, tok, par = tree_batch([row] * 5, [0, 1, 1, 1, 1], [-1, 0, 0, 1, 2])
    r = verify(l, tok, par, temperature=0.0)
    assert r.path.tolist() == [[1, 3, -1, -1]]


def test_exponential_race_ties_go_to_the_lower_index(verify):
    """Find two tokens whose Philox uniforms coincide exactly (likely among V = 16384 tokens: about 8 equal
    pairs per row), give both the same weight and nothing else any: the lower index must win."""
    V, seed = 16384, 0
    for row in range(64):
        u = lantern_uniforms(seed, V, row)
        values, first = np.unique(u, return_index=True)
        dup = np.flatnonzero(np.bincount(np.searchsorted(values, u)) > 1)
        if dup.size:
            pair = np.flatnonzero(u == values[dup[0]])[:2]
            break
    else:
        pytest.fail("no equal uniforms found")
    lo, hi = int(pair[0]), int(pair[1])
    assert philox_ref.uniform(seed, lo, 0, row, 0) == philox_ref.uniform(seed, hi, 0, row, 0)
    logits = np.full((1, V), NEG)
    logits[0, [lo, hi]] = 0.0
    B = row + 1  # the tie is in row `row`; fill the batch up to it
    l, tok, par = tree_batch(logits, [0], [-1], B)
    assert int(verify(l, tok, par, seed=seed).next_token[row]) == lo


def lantern_uniforms(seed, V, row):
    import lantern
    with lantern.fused("reference"):
        return lantern.ops.philox_uniform(seed, torch.arange(V), 0, row, 0).numpy()


def test_guidance_formula(verify):
    """verify(lc, uncond=lu, s) equals verify on the precomputed lu + s (lc - lu) (same float64 ops)."""
    batch = random_batch(41, B=300, T=6, V=8, K=4, relax=oracle.Relaxation(k=2, delta=0.1), guidance=True)
    guided = batch.uncond + batch.cfg_scale * (batch.logits - batch.uncond)
    with_guidance = verify(*batch.tensors(), **batch.kwargs(seed=3))
    plain = random_batch(41, B=300, T=6, V=8, K=4, relax=batch.relax, guidance=True)
    plain.logits, plain.uncond, plain.cfg_scale = guided, None, 1.0
    without = verify(*plain.tensors(), **plain.kwargs(seed=3))
    assert batch.cfg_scale != 1.0
    for a, b in zip(with_guidance, without):
        assert torch.equal(a, b)


def test_per_row_settings_equal_scalar_settings(verify, backend):
    """Per-row temperature / top_k / top_p tensors give each row what the scalar setting would (every
    setting present; the 6 most used ones under the interpreter, one scalar call each)."""
    batch = random_batch(51, B=240, T=6, V=8, K=4, relax=oracle.Relaxation(k=2, delta=0.1), greedy_rate=0.3)
    mixed = verify(*batch.tensors(), **batch.kwargs(seed=4))
    settings = list(zip(batch.temperature.tolist(), batch.top_k.tolist(), batch.top_p.tolist()))
    combos = sorted(set(settings), key=lambda c: -settings.count(c))
    assert len(combos) > 5
    for t, k, p in combos[:6] if backends.interpreted(backend) else combos:
        rows = np.flatnonzero((batch.temperature == t) & (batch.top_k == k) & (batch.top_p == p))
        uniform = random_batch(51, B=240, T=6, V=8, K=4, relax=batch.relax, greedy_rate=0.3)
        uniform.temperature, uniform.top_k, uniform.top_p = (np.full(240, t), np.full(240, k), np.full(240, p))
        scalar = verify(*uniform.tensors(), **uniform.kwargs(per_row_tensors=False, seed=4))
        for a, b in zip(mixed, scalar):
            assert torch.equal(a[rows], b[rows]), (t, k, p)


@pytest.mark.parametrize("sampled", [False, True])
def test_seed_and_offset_change_the_draws(verify, sampled):
    """Another seed or offset gives other decisions (in some of 300 rows: the chance that all 300 rows
    agree by luck is far below 1e-9 here); a seed/offset given as a tensor equals the int."""
    batch = random_batch(61, B=300, T=6, V=8, K=4, relax=oracle.Relaxation(k=2, delta=0.1), sampled=sampled)
    args = batch.tensors()
    base = verify(*args, **batch.kwargs(seed=1, offset=0))
    for kw in (dict(seed=2, offset=0), dict(seed=1, offset=1), dict(seed=1 + 2**32, offset=0)):
        other = verify(*args, **batch.kwargs(**kw))
        assert not torch.equal(base.next_token, other.next_token), kw
    as_tensor = verify(*args, **batch.kwargs(seed=torch.tensor(1), offset=torch.tensor(0)))
    for a, b in zip(base, as_tensor):
        assert torch.equal(a, b)
