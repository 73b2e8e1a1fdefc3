"""The decoding loop under tree="auto": greedy auto reproduces greedy AR token for token whatever the
planner picks (trees, chains, AR steps, AR streaks the drafter catches up on), rows finishing at different
steps stop exactly at L, an AR step costs no drafter forward, and the stats say which plans ran and why."""
import copy

import pytest
import torch

import lantern
from lantern.decoding import SpecConfig, generate_ar, generate_spec
from lantern.decoding.config import Sampling
from lantern.decoding.planner import AR_PLAN, Plan, candidate_plans
from lantern.decoding.proposers import new_state
from lantern.decoding.state import DecodeState
from lantern.models import build_gpt
from lantern.models.drafter import EagleDrafter, GPTDrafter
from planner_models import synthetic_costs
from test_spec import sharpen

# dispatch-bound, cheap drafter: speculation pays while rows have tokens to go, AR at the end
SWITCHING = synthetic_costs(dispatch=0.01, per_token=2e-5, drafter=1e-3)
NO_DRAFTS = synthetic_costs(dispatch=0.01, per_token=2e-5, drafter=0.05)


@pytest.fixture(scope="module")
def target():
    torch.manual_seed(0)
    return sharpen(build_gpt("GPT-tiny", block_size=16, n_layer=2))


def drafter_named(target, name):
    torch.manual_seed(1)
    if name == "self":
        return GPTDrafter(copy.deepcopy(target))
    if name == "small":
        return GPTDrafter(sharpen(build_gpt("GPT-tiny", block_size=16, n_layer=1)))
    if name == "noisy":  # agrees with the target part of the time: rows accept different lengths
        noisy = copy.deepcopy(target)
        with torch.no_grad():
            for p in noisy.parameters():
                p.add_(torch.randn_like(p) * 0.3 * p.std())
        return GPTDrafter(noisy)
    return EagleDrafter(target.config).bind(target).eval()


@pytest.mark.parametrize("drafter_name", ["self", "small", "eagle"])
def test_greedy_auto_reproduces_greedy_ar(target, drafter_name):
    labels = torch.tensor([0, 3, 7, 9, 3])
    want = generate_ar(target, labels, cfg_scale=3.0, temperature=0.0)
    config = SpecConfig(method="spec", cost_model=SWITCHING)
    got, stats = generate_spec(target, drafter_named(target, drafter_name), labels, config=config, cfg_scale=3.0,
                               temperature=0.0)
    assert torch.equal(got, want)
    assert stats.emitted == labels.shape[0] * (target.config.block_size - 1)
    assert stats.target_forwards == stats.steps + 1
    assert sum(stats.plan_counts.values()) == stats.steps
    assert any(name != "ar" for name in stats.plan_counts)
    plans = stats.planner["plans"]
    assert sum(p["steps"] for p in plans.values()) == stats.steps
    assert sum(p["tokens"] for p in plans.values()) == stats.emitted
    assert all(p["expected_tokens_per_s"] > 0 and p["achieved_tokens_per_s"] > 0 for p in plans.values())


def test_auto_lantern_at_zero_delta_is_greedy_ar(target):
    labels = torch.tensor([1, 2])
    table = lantern.ops.latent_neighbours(torch.randn(target.config.vocab_size, 8), 8)
    config = SpecConfig(method="lantern", k=8, delta=0.0, cost_model=SWITCHING)
    got, _ = generate_spec(target, drafter_named(target, "small"), labels, table, config=config, temperature=0.0)
    assert torch.equal(got, generate_ar(target, labels, temperature=0.0))



def test_auto_at_batch_above_one_holds_one_plan_for_the_run(target):
    """At batch > 1 the planner picks one plan for the whole run (the fewest predicted seconds until the
    slowest row is done): the run is that fixed plan's run, token for token, with its steps in the planner's
    record; a single row keeps the per-step planner."""
    labels = torch.tensor([0, 3, 7])
    settings = dict(cfg_scale=3.0, temperature=1.0, seed=4)
    drafter = drafter_named(target, "noisy")
    chain3 = next(p for p in candidate_plans(3) if p.name == "chain3")  # sampled drafts
    costs = synthetic_costs(dispatch=0.01, per_token=2e-5, drafter=1e-3, plans=[AR_PLAN, chain3])
    config = SpecConfig(method="spec", cost_model=costs, plans=[AR_PLAN, chain3], depth=3, draft="sampled")
    got, stats = generate_spec(target, drafter, labels, config=config, **settings)
    fixed = SpecConfig(method="spec", tree="chain", depth=3, draft="sampled")
    want, want_stats = generate_spec(target, drafter, labels, config=fixed, **settings)
    assert torch.equal(got, want)
    assert stats.plan_counts == {"chain3": want_stats.steps} and stats.planner["whole_run"]
    assert stats.planner["plans"]["chain3"]["steps"] == stats.steps
    assert stats.planner["plans"]["chain3"]["tokens"] == stats.emitted
    _, single = generate_spec(target, drafter, labels[:1], config=config, **settings)
    assert "whole_run" not in single.planner


class Counting:
    """A drafter wrapper that counts the drafter's forwards."""

    def __init__(self, drafter):
        self.drafter, self.calls = drafter, 0

    def reset(self, *args):
        return self.drafter.reset(*args)

    def release(self):
        return self.drafter.release()

    def commit(self, *args):
        self.calls += 1
        return self.drafter.commit(*args)

    def expand(self, *args):
        self.calls += 1
        return self.drafter.expand(*args)


def test_ar_steps_run_no_drafter(target):
    labels = torch.tensor([0, 5, 6])
    drafter = Counting(drafter_named(target, "eagle"))
    got, stats = generate_spec(target, drafter, labels, config=SpecConfig(method="spec", cost_model=NO_DRAFTS),
                               cfg_scale=3.0, temperature=0.0)
    assert torch.equal(got, generate_ar(target, labels, cfg_scale=3.0, temperature=0.0))
    L = target.config.block_size
    assert stats.plan_counts == {"ar": L - 1} and stats.steps == L - 1
    assert drafter.calls == 0 and stats.draft_forwards == 0



def test_auto_whose_first_plan_is_ar_is_the_ar_loop(target):
    """When AR wins the first step the run is generate_ar's loop (AR would win every step): the sampled
    tokens are AR's with the same seed, top-k and guidance interval, the drafter is never reset, and the
    printout's planner record says so. With drafts that pay, the speculative loop runs instead."""
    labels = torch.tensor([2, 4, 8])
    settings = dict(cfg_scale=3.0, temperature=1.0, top_k=50, cfg_interval=6, seed=11)
    drafter = Counting(drafter_named(target, "eagle"))
    resets = []
    drafter.reset = lambda *args: resets.append(args) or drafter.drafter.reset(*args)
    got, stats = generate_spec(target, drafter, labels, config=SpecConfig(method="spec", cost_model=NO_DRAFTS),
                               **settings)
    assert torch.equal(got, generate_ar(target, labels, **settings))
    assert resets == [] and stats.planner["all_ar"] and stats.planner["plans"]["ar"]["steps"] == stats.steps
    assert stats.target_forwards == target.config.block_size and stats.tau == 1.0
    _, paying = generate_spec(target, drafter, labels, config=SpecConfig(method="spec", cost_model=SWITCHING),
                              **settings)
    assert resets and "all_ar" not in paying.planner and set(paying.plan_counts) != {"ar"}


def test_finished_rows_leave_the_models_batch_and_the_tokens_stay(target, monkeypatch):
    """Rows finish raggedly under sampled chains; once a quarter of the models' rows are finished the loop
    drops them from the target's and the drafter's caches, and the sampled tokens are those of the loop
    that keeps computing every row (verify and the draft sampling still see every row at its place)."""
    labels = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7])
    settings = dict(cfg_scale=3.0, temperature=1.0, seed=5)
    config = SpecConfig(method="spec", tree="chain", depth=3, draft="sampled")
    drafter = drafter_named(target, "noisy")  # a GPT drafter: its model's cache shrinks too
    kept = []
    real_keep = type(target).keep_cache_rows
    monkeypatch.setattr(type(target), "keep_cache_rows", lambda self, rows: (kept.append(rows.numel())
                                                                             if self is target else None)
                        or real_keep(self, rows))
    compacted, stats = generate_spec(target, drafter, labels, config=config, **settings)
    assert kept and all(b < a for a, b in zip([2 * len(labels)] + kept, kept))  # the batch shrank, step by step
    monkeypatch.setattr(DecodeState, "should_compact", lambda self, n_active: False)
    full, full_stats = generate_spec(target, drafter, labels, config=config, **settings)
    assert torch.equal(compacted, full) and stats.plan_counts == full_stats.plan_counts

SCRIPT = [AR_PLAN, AR_PLAN, Plan("chain3", "chain", depth=3), AR_PLAN, AR_PLAN, AR_PLAN,
          Plan("tree8", "dynamic", depth=4, n_nodes=8, top_per_node=3), Plan("chain1", "chain", depth=1), AR_PLAN,
          Plan("static", "static", depth=2, static_widths=(2, 1))]


@pytest.mark.parametrize("drafter_name", ["self", "noisy", "eagle"])
def test_ar_streaks_and_resumed_speculation_stay_exact_with_ragged_rows(target, drafter_name):
    """A scripted mix of AR steps and trees: the drafter catches up on every AR token in one commit when a
    tree follows; rows finish at different steps and each stops exactly at L."""
    labels = torch.tensor([0, 3, 7, 9])
    L = target.config.block_size
    want = generate_ar(target, labels, cfg_scale=3.0, temperature=0.0)
    drafter = Counting(drafter_named(target, drafter_name))
    config = SpecConfig(method="spec", draft="deterministic")
    with torch.no_grad():
        state = new_state(target, drafter, labels, None, config, Sampling(cfg_scale=3.0, temperature=0.0), L, SCRIPT,
                         catch_up=True)
        step, ragged = 0, False
        while bool((state.n_done < L).any()):
            plan = SCRIPT[step % len(SCRIPT)]
            step += 1
            before = state.n_done.clone()
            calls = drafter.calls
            state.step(plan, step)
            if plan.is_ar:
                assert drafter.calls == calls
                assert torch.equal(state.n_done, torch.where(before < L, before + 1, before))
            assert bool((state.n_done <= L).all())
            ragged |= len(set(state.n_done.tolist())) > 1
        state.close()
    assert torch.equal(state.out, want)
    assert bool((state.n_done == L).all())
    if drafter_name == "noisy":
        assert ragged


def test_auto_length_stops_every_row_at_the_prefix(target):
    labels = torch.tensor([0, 3, 7])
    full = generate_ar(target, labels, cfg_scale=3.0, temperature=0.0)
    for length in (1, 2, 5):
        got, stats = generate_spec(target, drafter_named(target, "small"), labels,
                                   config=SpecConfig(method="spec", cost_model=SWITCHING), cfg_scale=3.0,
                                   temperature=0.0, length=length)
        assert torch.equal(got, full[:, :length])
        assert stats.emitted == labels.shape[0] * (length - 1)


def test_cost_model_missing_ar_is_named(target):
    from lantern.decoding.costs import CostModel

    with pytest.raises(ValueError, match="'ar'"):
        generate_spec(target, drafter_named(target, "small"), torch.tensor([0]),
                      config=SpecConfig(method="spec", cost_model=CostModel({"chain1": {2: 0.01}})))


# -- the shipped tiny model: the fused cpu backend reproduces the reference loop under auto -------------

@pytest.fixture(scope="module")
def tiny():
    from lantern.ops.reference.latent_neighbours import latent_neighbours
    from lantern.pretrained import load_tiny, load_tiny_drafter

    models = load_tiny()
    table = latent_neighbours(models.vq.quantize.embedding.weight, 8, normalize=True)  # [1024, 8]
    return models.gpt, load_tiny_drafter(models.gpt), table


def test_tiny_auto_fused_cpu_matches_the_reference_loop(tiny):
    gpt, drafter, table = tiny
    labels = torch.tensor([1, 7])
    config = SpecConfig(method="lantern", k=8, delta=0.2, cost_model=SWITCHING, plans=candidate_plans(3),
                        adapt_costs=False)  # plans from the models alone: the same in both runs
    options = dict(config=config, cfg_scale=2.0, temperature=1.0, top_k=50, seed=3, length=10)
    with torch.no_grad():
        want, want_stats = generate_spec(gpt, drafter, labels, table, **options)
        with lantern.fused("cpu"):
            got, got_stats = generate_spec(gpt, drafter, labels, table, **options)
    assert torch.equal(got, want)
    assert got_stats.plan_counts == want_stats.plan_counts
    assert any(name != "ar" for name in got_stats.plan_counts)
