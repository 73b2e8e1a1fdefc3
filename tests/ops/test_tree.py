"""ancestor_mask and build_tree against Python-loop brute force (tree walks, explicit sorting)."""
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import lantern
from op_cases import random_expansion, random_parents

# No backend implements ancestor_mask / build_tree yet: on every other backend the public ops would run this
# same reference code, so these tests narrow the shared ``backend`` fixture (tests/ops/conftest.py) to it.
BACKENDS = ["reference"]  # fused backends join this list once they implement ancestor_mask / build_tree


@pytest.fixture(params=BACKENDS)
def backend(request):
    with lantern.fused(request.param):
        yield request.param


# --- brute force ---------------------------------------------------------------------------------

def brute_force_mask(parents: torch.Tensor) -> torch.Tensor:
    """Walk each node up to the root, set bits in Python ints, wrap each 32-bit word to int32."""
    B, T = parents.shape
    W = (T + 31) // 32
    out = torch.zeros(B, T, W, dtype=torch.int32)
    for b in range(B):
        p = parents[b].tolist()
        for i in range(T):
            bits = 1 << i
            j = p[i]
            while j >= 0:
                bits |= 1 << j
                j = p[j]
            for w in range(W):
                word = (bits >> (32 * w)) & 0xFFFFFFFF
                out[b, i, w] = word - (1 << 32) if word >= 1 << 31 else word
    return out


def brute_force_build(tokens, parents, scores, root, n_nodes):
    B, M = tokens.shape
    out_tokens, out_parents = [], []
    for b in range(B):
        ranked = sorted(range(M), key=lambda m: (-float(scores[b, m]), m))
        chosen = sorted(ranked[:n_nodes])
        node_of = {m: n + 1 for n, m in enumerate(chosen)}
        out_tokens.append([int(root[b])] + [int(tokens[b, m]) for m in chosen])
        out_parents.append([-1] + [0 if parents[b, m] < 0 else node_of[int(parents[b, m])] for m in chosen])
    return torch.tensor(out_tokens, dtype=torch.int64), torch.tensor(out_parents, dtype=torch.int64)


# --- ancestor_mask -------------------------------------------------------------------------------

def test_small_tree_by_hand(backend):
    parents = torch.tensor([[-1, 0, 0, 1, -1, 3]])  # node 4 is padding
    expected = [0b1, 0b11, 0b101, 0b1011, 0b10000, 0b101011]
    assert lantern.ops.ancestor_mask(parents)[0, :, 0].tolist() == expected


@pytest.mark.parametrize("T", [1, 31, 32, 33, 64, 65, 100])
def test_chain_sets_all_lower_bits_with_int32_wraparound(backend, T):
    parents = torch.arange(-1, T - 1).unsqueeze(0)  # chain: node i's parent is i - 1
    got = lantern.ops.ancestor_mask(parents)
    assert got.dtype == torch.int32 and tuple(got.shape) == (1, T, (T + 31) // 32)
    assert torch.equal(got, brute_force_mask(parents))
    if T >= 32:
        assert int(got[0, 31, 0]) == -1  # bits 0..31 all set: bit 31 makes the word negative
        assert int(got[0, 30, 0]) == 2**31 - 1


def test_all_padding_nodes_see_only_themselves(backend):
    parents = torch.full((2, 40), -1, dtype=torch.int64)
    got = lantern.ops.ancestor_mask(parents)
    assert torch.equal(got, brute_force_mask(parents))
    assert got[0, 39].tolist() == [0, 1 << 7] and got[0, 31].tolist() == [-(2**31), 0]


@settings(max_examples=60, deadline=None)
@given(B=st.integers(1, 3), T=st.integers(1, 70), pad=st.sampled_from([0.0, 0.2, 0.6]), seed=st.integers(0, 10**9))
def test_property_random_trees_match_walk(B, T, pad, seed):
    parents = random_parents(random.Random(seed), B, T, pad)
    expected = brute_force_mask(parents)
    for backend in BACKENDS:
        with lantern.fused(backend):
            assert torch.equal(lantern.ops.ancestor_mask(parents), expected)


@pytest.mark.parametrize("parents,exc", [
    ([[-1, 0]], TypeError),
    (torch.tensor([[-1.0, 0.0]]), TypeError),
    (torch.tensor([[-1, 0]], dtype=torch.int32), TypeError),
    (torch.tensor([-1, 0]), ValueError),
    (torch.zeros(1, 0, dtype=torch.int64), ValueError),
    (torch.tensor([[0, 0]]), ValueError),  # root must be -1
    (torch.tensor([[-1, 1]]), ValueError),  # parent not before the node
    (torch.tensor([[-1, 0, -2]]), ValueError),
    (torch.tensor([[-1, -1, 1]]), ValueError),  # child of a padding node
])
def test_ancestor_mask_bad_input(backend, parents, exc):
    with pytest.raises(exc, match="parents"):
        lantern.ops.ancestor_mask(parents)


# --- build_tree ----------------------------------------------------------------------------------

def check_tree_shape(tokens, parents, n_nodes):
    """Topological, ancestor-closed, root first: what every consumer of build_tree relies on."""
    B = tokens.shape[0]
    assert tuple(tokens.shape) == tuple(parents.shape) == (B, n_nodes + 1)
    assert tokens.dtype == parents.dtype == torch.int64
    assert bool((parents[:, 0] == -1).all())
    idx = torch.arange(n_nodes + 1)
    assert bool(((parents[:, 1:] >= 0) & (parents[:, 1:] < idx[1:])).all())


def test_build_tree_by_hand(backend):
    # candidates: 0 (root child, -0.1), 1 (root child, -2), 2 (child of 0, -0.5), 3 (child of 2, -0.6),
    # 4 (child of 1, -3); best 3: 0, 2, 3 -> nodes 1, 2, 3 with parents root, node 1, node 2
    tokens = torch.tensor([[10, 11, 12, 13, 14]])
    parents = torch.tensor([[-1, -1, 0, 2, 1]])
    scores = torch.tensor([[-0.1, -2.0, -0.5, -0.6, -3.0]])
    out_tokens, out_parents = lantern.ops.build_tree(tokens, parents, scores, torch.tensor([7]), 3)
    assert out_tokens.tolist() == [[7, 10, 12, 13]]
    assert out_parents.tolist() == [[-1, 0, 1, 2]]


def test_build_tree_ties_go_to_lower_index(backend):
    tokens = torch.tensor([[5, 6, 7, 8]])
    parents = torch.tensor([[-1, -1, 0, 1]])
    scores = torch.tensor([[-1.0, -1.0, -1.0, -1.0]])  # all tied: candidates 0, 1 win
    out_tokens, out_parents = lantern.ops.build_tree(tokens, parents, scores, torch.tensor([0]), 2)
    assert out_tokens.tolist() == [[0, 5, 6]] and out_parents.tolist() == [[-1, 0, 0]]


@pytest.mark.parametrize("n_nodes", [0, 1, 58, 60])
def test_build_tree_eagle2_sizes(backend, n_nodes):
    tokens, parents, scores, root = random_expansion(random.Random(n_nodes), 3, 60)
    got = lantern.ops.build_tree(tokens, parents, scores, root, n_nodes)
    check_tree_shape(*got, n_nodes)
    expected = brute_force_build(tokens, parents, scores, root, n_nodes)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@settings(max_examples=50, deadline=None)
@given(B=st.integers(1, 3), M=st.integers(0, 40), seed=st.integers(0, 10**9), data=st.data())
def test_property_build_tree_matches_brute_force(B, M, seed, data):
    n_nodes = data.draw(st.integers(0, M))
    tokens, parents, scores, root = random_expansion(random.Random(seed), B, M)
    expected = brute_force_build(tokens, parents, scores, root, n_nodes)
    for backend in BACKENDS:
        with lantern.fused(backend):
            got = lantern.ops.build_tree(tokens, parents, scores, root, n_nodes)
        check_tree_shape(*got, n_nodes)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        lantern.ops.ancestor_mask(got[1])  # a valid tree for the next op


def _good_build_args():
    return dict(cand_tokens=torch.tensor([[3, 4, 5]]), cand_parents=torch.tensor([[-1, 0, 1]]),
                cand_scores=torch.tensor([[-1.0, -2.0, -3.0]]), root_token=torch.tensor([9]), n_nodes=2)


@pytest.mark.parametrize("change,exc,name", [
    (dict(cand_tokens=[[3, 4, 5]]), TypeError, "cand_tokens"),
    (dict(cand_tokens=torch.tensor([[3.0, 4.0, 5.0]])), TypeError, "cand_tokens"),
    (dict(cand_tokens=torch.tensor([3, 4, 5])), ValueError, "cand_tokens"),
    (dict(cand_tokens=torch.tensor([[3, -4, 5]])), ValueError, "cand_tokens"),
    (dict(cand_parents=torch.tensor([[-1, 0]])), ValueError, "cand_parents"),
    (dict(cand_parents=torch.tensor([[-1, 0, 1]], dtype=torch.int32)), TypeError, "cand_parents"),
    (dict(cand_parents=torch.tensor([[-1, 1, 1]])), ValueError, "cand_parents"),
    (dict(cand_parents=torch.tensor([[-1, -2, 1]])), ValueError, "cand_parents"),
    (dict(cand_scores=torch.tensor([[-1, -2, -3]])), TypeError, "cand_scores"),
    (dict(cand_scores=torch.tensor([[-1.0, -2.0]])), ValueError, "cand_scores"),
    (dict(cand_scores=torch.tensor([[-1.0, float("nan"), -3.0]])), ValueError, "cand_scores"),
    (dict(cand_scores=torch.tensor([[-3.0, -2.0, -1.0]])), ValueError, "cand_scores"),  # child > parent
    (dict(root_token=torch.tensor(9)), ValueError, "root_token"),
    (dict(root_token=torch.tensor([-1])), ValueError, "root_token"),
    (dict(root_token=torch.tensor([9], dtype=torch.int32)), TypeError, "root_token"),
    (dict(n_nodes=4), ValueError, "n_nodes"),
    (dict(n_nodes=-1), ValueError, "n_nodes"),
    (dict(n_nodes=2.0), TypeError, "n_nodes"),
])
def test_build_tree_bad_input(backend, change, exc, name):
    args = {**_good_build_args(), **change}
    with pytest.raises(exc, match=name):
        lantern.ops.build_tree(**args)
