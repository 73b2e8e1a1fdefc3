"""Draft-tree growth helpers (python/lantern/decoding/trees.py) against their readable definitions."""
from __future__ import annotations

import itertools

import pytest
import torch

import lantern
from lantern.decoding.trees import (
    _own_bits,
    depths_from_mask,
    draft_exponentials,
    draw_without_replacement,
    grow_partial_mask,
    sample_without_replacement,
)
from lantern.models.drafter import partial_tree_mask


@pytest.mark.parametrize("B, k, levels", list(itertools.product((1, 3), (1, 4, 10, 17), (2, 4, 6))))
def test_grown_partial_mask_is_the_closure_of_the_grown_tree(B, k, levels):
    """Level by level, as grow_dynamic grows its beams (each new node's parent in the level before), the
    incremental mask equals partial_tree_mask of the whole partial tree, across word boundaries (k = 17,
    6 levels: 102 nodes, 4 words)."""
    g = torch.Generator().manual_seed(B * 1000 + k * 10 + levels)
    parents = torch.full((B, k), -1)
    mask = _own_bits(k, torch.device("cpu")).expand(B, k, -1).contiguous()
    assert torch.equal(mask, partial_tree_mask(parents))
    for d in range(1, levels):
        new = (d - 1) * k + torch.randint(0, k, (B, k), generator=g)
        mask = grow_partial_mask(mask, new)
        parents = torch.cat([parents, new], 1)
        assert torch.equal(mask, partial_tree_mask(parents)), d


def test_grown_mask_differs_when_a_parent_is_wrong():
    """Negative control: the comparison above sees a node attached to another parent."""
    parents = torch.full((1, 4), -1)
    first = _own_bits(4, torch.device("cpu")).expand(1, 4, -1).contiguous()
    mask = grow_partial_mask(first, torch.tensor([[0, 1, 2, 3]]))
    wrong = torch.cat([parents, torch.tensor([[0, 1, 3, 2]])], 1)
    assert not torch.equal(mask, partial_tree_mask(wrong))


def test_dynamic_tree_drafts_pass_the_grown_mask_to_the_drafter(monkeypatch):
    """grow_dynamic hands the drafter the incremental mask (else the drafter would rebuild the closure each
    level), and the drafter's masks equal the closure of the trees it was given."""
    import tiny_random_models
    from lantern.models import drafter as drafter_module

    target, drafter = tiny_random_models.small_models(dtype=torch.float64)
    seen = []
    expand = type(drafter).expand

    def checked_expand(self, tokens, parents, parent_state, positions, tree_mask=None):
        seen.append(tree_mask is not None and torch.equal(tree_mask, partial_tree_mask(parents)))
        return expand(self, tokens, parents, parent_state, positions, tree_mask=tree_mask)

    monkeypatch.setattr(type(drafter), "expand", checked_expand)
    closures = []
    monkeypatch.setattr(drafter_module, "partial_tree_mask",
                        lambda parents: closures.append(1) or partial_tree_mask(parents))
    lantern.generate(target, torch.tensor([1, 2]), method="spec", drafter=drafter, tree="dynamic", depth=4, n_nodes=8,
                     top_per_node=3, seed=0, compile=False, length=6)
    assert seen and all(seen)
    assert not closures  # the drafter never rebuilt a mask


def walked_depths(parents: torch.Tensor) -> torch.Tensor:
    """[B, T] depth of each node by walking its parents one by one (root and padding 0)."""
    depth = torch.zeros_like(parents)
    for b, i in itertools.product(range(parents.shape[0]), range(parents.shape[1])):
        j = int(parents[b, i])
        while j >= 0:
            depth[b, i] += 1
            j = int(parents[b, j])
    return depth


@pytest.mark.parametrize("T", [1, 2, 16, 31, 32, 33, 70])
@pytest.mark.parametrize("chain_rate", [0.0, 0.9])
def test_depths_from_the_mask_are_the_walked_depths(T, chain_rate):
    """Padding nodes (parent -1) included; T past 32 spans several mask words; deep chains past one word."""
    import numpy as np

    from op_cases import random_tree

    rng = np.random.default_rng(T)
    parents = torch.as_tensor(np.stack([random_tree(rng, T, pad_rate=0.2, chain_rate=chain_rate) for _ in range(6)]))
    want = walked_depths(parents)
    assert torch.equal(depths_from_mask(lantern.ops.ancestor_mask(parents), T), want)
    if T > 2:  # a negative control: one parent moved changes the depths
        moved = parents.clone()
        moved[:, -1] = -1 if int(parents[0, -1]) >= 0 and want[0, -1] > 0 else 0
        assert not torch.equal(depths_from_mask(lantern.ops.ancestor_mask(moved), T), want)


def test_a_trees_exponentials_drawn_at_once_are_each_levels_own():
    """A tree's exponential keys made in one call, sliced per level, draw what each level's own call draws;
    another offset's do not (negative control)."""
    B, N, V, seed, offset = 3, 5, 40, 11, 7
    rows = torch.tensor([4, 0, 9])
    probs = torch.softmax(torch.randn(B, N, V, generator=torch.Generator().manual_seed(0)), -1)
    probs[:, :, :3] = 0  # impossible tokens are never drawn
    node_ids = torch.arange(N).expand(B, -1)
    at_once = draft_exponentials(seed, V, node_ids, offset, rows)  # [B, N, V]
    for level in (slice(0, 1), slice(1, 3), slice(3, 5)):
        own = sample_without_replacement(probs[:, level], 3, seed, node_ids[:, level], offset, rows)
        given = draw_without_replacement(probs[:, level], 3, at_once[:, level])
        assert torch.equal(own, given) and bool((own >= 3).all())
    other = draft_exponentials(seed, V, node_ids, offset + 1, rows)
    assert not torch.equal(draw_without_replacement(probs, 3, other),
                           sample_without_replacement(probs, 3, seed, node_ids, offset, rows))



@pytest.mark.parametrize("tree", [dict(tree="chain", depth=3), dict(tree="static", static_widths=(2, 2, 1))],
                         ids=["chain3", "static2-2-1"])
def test_sampled_drafts_come_from_the_draft_sample_kernel_with_the_references_tokens(monkeypatch, tree):
    """A run's sampled drafts (a chain, a static tree) are drawn by ops.draft_sample on the run's backend: under
    the cpu backend its kernel runs, and the images are those of the same run with the draws composed from
    process_logits and philox_uniform (what a run takes where no kernel serves draft_sample)."""
    import tiny_random_models
    from lantern import _backend
    from lantern.decoding import state

    target, drafter = tiny_random_models.small_models()
    labels = torch.tensor([1, 2, 3])
    table = lantern.ops.latent_neighbours(torch.randn(64, 8, generator=torch.Generator().manual_seed(4)), 8,
                                          backend="reference")
    options = dict(method="lantern", drafter=drafter, neighbours=table, k=8, delta=0.2, seed=5, compile=False,
                   temperature=0.9, cfg_scale=2.0, **tree)
    with lantern.fused("cpu"):
        before = _backend.kernel_calls()["ran"].get(("cpu", "draft_sample"), 0)
        fused, _ = lantern.generate(target, labels, **options)
        assert _backend.kernel_calls()["ran"].get(("cpu", "draft_sample"), 0) > before
        draft = state.DecodeState.draft

        def reference_draws(self, *args):
            self.backends = dict(self.backends, draft_sample="reference")
            return draft(self, *args)

        monkeypatch.setattr(state.DecodeState, "draft", reference_draws)
        with_reference, _ = lantern.generate(target, labels, **options)
    assert torch.equal(fused, with_reference)


@pytest.mark.parametrize("temperature", [0.8, torch.tensor([0.0, 1.2, 0.5])], ids=["scalar", "per-row-greedy"])
@pytest.mark.parametrize("draws", [1, 4])
def test_the_composed_draws_are_draft_samples_definition(temperature, draws):
    """DecodeState.draft's composition (process, the drafter's Philox keys, the race) where no kernel serves
    draft_sample gives the reference definition's q and tokens, top-k leaving fewer tokens than draws."""
    from types import SimpleNamespace

    from lantern.decoding.config import Sampling
    from lantern.decoding.state import DecodeState
    from lantern.decoding.trees import DRAFT_SEED_SALT
    from lantern.ops.reference.draft_sample import draft_sample

    B, N, V = 3, 2, 30
    g = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(B, N, V, generator=g)
    rows, node_ids = torch.tensor([9, 2, 4]), torch.tensor([[0, 1], [0, 1], [2, 3]])
    sampling = Sampling(temperature=temperature, top_k=3, seed=77, rows=rows)
    greedy = torch.as_tensor(temperature) == 0
    state = SimpleNamespace(s=sampling, backends={"draft_sample": "reference", "process_logits": "reference"},
                            greedy_rows=greedy.expand(B) if bool(greedy.any()) else None)
    state.process = lambda draft_logits: DecodeState.process(state, draft_logits)
    got = DecodeState.draft(state, logits, draws, node_ids, 6)
    want = draft_sample(logits, None, 1.0, temperature, 3, 1.0, draws=draws, seed=77 ^ DRAFT_SEED_SALT,
                        node_ids=node_ids, offset=6, rows=rows)
    assert torch.equal(got.probs, want.probs) and torch.equal(got.tokens, want.tokens)
    other = DecodeState.draft(state, logits, draws, node_ids, 7)  # negative control: another offset
    assert not torch.equal(other.tokens, want.tokens)
