"""The planner of tree="auto" on synthetic cost and acceptance models: it picks trees when drafting is cheap
and the device has idle width, AR when the drafter is expensive or the batch already fills the device, and
never a plan its own models predict slower than AR."""
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lantern.decoding.costs import CostModel
from lantern.decoding.planner import (
    AR_PLAN,
    AcceptanceModel,
    Plan,
    Planner,
    candidate_plans,
    measured_rates,
    steps_to_finish,
)
from lantern.decoding.plans import accept_any, static_level_rates, static_shape
from planner_models import synthetic_costs

PLANS = candidate_plans(5)


def planner(costs, prior=0.7):
    return Planner(costs, PLANS, AcceptanceModel(prior=prior))


def test_cheap_drafter_and_idle_device_pick_a_tree():
    p = planner(synthetic_costs(dispatch=0.01, per_token=1e-5, drafter=5e-4))
    decision = p.choose(rows=2, n_active=1, rows_reaching=[1] * 5)
    assert not decision.plan.is_ar
    assert decision.tokens_per_s > decision.ar_tokens_per_s
    assert decision.plan.kind == "dynamic"  # nearly free width: the widest tree wins


def test_expensive_drafter_picks_ar():
    p = planner(synthetic_costs(dispatch=0.01, per_token=1e-5, drafter=0.02))
    decision = p.choose(rows=2, n_active=1, rows_reaching=[1] * 5)
    assert decision.plan == AR_PLAN
    assert decision.tokens_per_s == decision.ar_tokens_per_s


def test_wide_batch_on_a_busy_device_picks_ar():
    costs = synthetic_costs(dispatch=0.01, per_token=1e-3, drafter=5e-4)
    assert not planner(costs).choose(rows=2, n_active=1, rows_reaching=[1] * 5).plan.is_ar
    assert planner(costs).choose(rows=80, n_active=40, rows_reaching=[40] * 5).plan == AR_PLAN


def test_rows_near_the_end_need_no_drafts():
    p = planner(synthetic_costs(dispatch=0.01, per_token=1e-5, drafter=5e-4))
    assert p.choose(rows=8, n_active=4, rows_reaching=[0] * 5).plan == AR_PLAN  # one token to go each
    shallow = p.choose(rows=8, n_active=4, rows_reaching=[4, 0, 0, 0, 0]).plan  # two to go: depth 1 suffices
    assert not shallow.is_ar and shallow.depth <= 3


def test_observed_rejections_turn_speculation_off_and_forgetting_turns_it_back_on():
    p = planner(synthetic_costs(dispatch=0.01, per_token=1e-5, drafter=2e-3))
    first = p.choose(rows=2, n_active=1, rows_reaching=[1] * 5).plan
    assert not first.is_ar
    for plan in PLANS[1:]:
        p.acceptance.observe(plan, [0] * plan.depth, [50] + [0] * (plan.depth - 1))  # nothing accepted
    assert p.choose(rows=2, n_active=1, rows_reaching=[1] * 5).plan == AR_PLAN
    steps = 0
    while p.choose(rows=2, n_active=1, rows_reaching=[1] * 5).plan.is_ar:
        p.acceptance.forget()
        steps += 1
    assert 10 < steps < 500


def test_measured_step_times_correct_the_cost_model():
    """A calibration that underestimated the trees 10x is corrected by the run's own step times."""
    p = Planner(synthetic_costs(dispatch=0.01, per_token=1e-5, drafter=5e-4), PLANS, AcceptanceModel(prior=0.7),
                adapt_costs=True)
    chosen = []
    for _ in range(20):
        decision = p.choose(rows=2, n_active=1, rows_reaching=[1] * 5)
        chosen.append(decision.plan)
        truth = p.cost_model.step_seconds(decision.plan.name, 2) * (1 if decision.plan.is_ar else 10)
        p.record(decision, round(decision.expected_tokens), truth)
        p.forget()
    # probes: AR's time is measured before anything is compared with it; a plan's first step (its shapes'
    # first calls) is not counted, so AR is probed twice
    assert chosen[:2] == [AR_PLAN, AR_PLAN]
    assert not chosen[2].is_ar and chosen[-1] == AR_PLAN
    assert sum(not plan.is_ar for plan in chosen) <= 5
    assert p.step_seconds(AR_PLAN, 2) == pytest.approx(p.cost_model.step_seconds("ar", 2), rel=0.05)
    frozen = planner(synthetic_costs(dispatch=0.01, per_token=1e-5, drafter=5e-4))
    decision = frozen.choose(rows=2, n_active=1, rows_reaching=[1] * 5)
    frozen.record(decision, 1, 100.0)
    assert frozen.choose(rows=2, n_active=1, rows_reaching=[1] * 5).plan == decision.plan  # adapt_costs off


def test_acceptance_estimates_follow_the_data():
    model = AcceptanceModel(prior=0.5)
    chain3 = next(p for p in PLANS if p.name == "chain3")
    assert model.survival(chain3) == pytest.approx([0.5, 0.25, 0.125])
    model.observe(chain3, [900, 810, 729], [1000, 900, 810])  # 0.9 per level
    assert model.level_rates(chain3) == pytest.approx([0.9] * 3, abs=0.01)
    static = next(p for p in PLANS if p.name == "static2-2-1-1")
    assert model.level_rates(static)[0] > 0.9  # a wider level accepts more often
    assert model.expected_tokens(chain3, 10, [10, 10, 0]) == pytest.approx(10 + 10 * 0.9 + 10 * 0.81, rel=0.02)
    # sampled chains teach nothing about top-k drafts (another family): tree16 keeps the prior's rates
    tree16 = next(p for p in PLANS if p.name == "tree16")
    assert model.level_rates(tree16) == pytest.approx(AcceptanceModel(prior=0.5).level_rates(tree16))


def _walk_survival(widths, b, walks: int, seed: int = 0) -> np.ndarray:
    """P(accept_len >= d) of walks down ``trees.static_shape(widths)``'s actual tree, each node's children
    tried in order: the first k of m accept with accept_any(b_d, k) (the model's sibling law)."""
    parents = static_shape(widths)
    children = {}
    for node, parent in enumerate(parents[1:], 1):
        children.setdefault(parent, []).append(node)
    rng = np.random.default_rng(seed)
    reached = np.zeros(len(widths))
    for _ in range(walks):
        node, d = 0, 0
        while children.get(node):
            kids, u = children[node], rng.random()
            j = next((i for i in range(len(kids)) if u < accept_any(b[d], i + 1)), None)
            if j is None:
                break
            node, d = kids[j], d + 1
            reached[d - 1] += 1
    return reached / walks


@pytest.mark.parametrize("widths", [(2, 1, 1), (2, 2, 1, 1), (3, 2, 1, 1), (1, 1, 1), (3, 3, 2)])
def test_static_level_rates_follow_the_tree_the_plan_drafts(widths):
    b = [0.8, 0.7, 0.75, 0.6][: len(widths)]
    model = np.cumprod(static_level_rates(widths, b))
    walks = 40_000  # a fixed seed: the same walks every run; 5 standard errors apart at most
    measured = _walk_survival(widths, b, walks)
    assert np.abs(model - measured).max() < 5 * math.sqrt(0.25 / walks)
    # a chain-equivalent reading of every level (the width of the first at every level) is wrong by far more
    # wherever a node below the first level can be childless: (2, 1, 1) reaches its second level only through
    # its first child
    if widths == (2, 1, 1):
        assert model[1] == pytest.approx(b[0] * b[1])
        naive = np.cumprod([accept_any(r, 2) for r in b])
        assert naive[1] - measured[1] > 0.05


def test_static_trees_below_their_first_level_do_not_teach_the_chains():
    static = next(p for p in PLANS if p.name == "static2-1-1")
    chain3 = next(p for p in PLANS if p.name == "chain3")
    model = AcceptanceModel(prior=0.5)
    model.observe(static, [0, 500, 400], [0, 1000, 1000])  # levels 2 and 3 only: no chain-equivalent reading
    assert model.chain_rates(3, "sampled") == pytest.approx(AcceptanceModel(prior=0.5).chain_rates(3, "sampled"))
    model.observe(static, [900, 0, 0], [1000, 0, 0])  # its first level: 2 siblings, 1 - (1 - b)^(2^0.3) = 0.9
    b1 = model.chain_rates(3, "sampled")[0]
    assert accept_any(b1, 2) == pytest.approx(0.9, abs=0.01)
    assert model.level_rates(chain3)[0] == pytest.approx(b1)


def test_measured_rates_become_the_prior_of_their_family():
    """The calibration's verify results (per plan) give per-level chain-equivalent rates per draft family;
    as prior_rates they replace the constant prior for that family only, and the run's data still wins."""
    chain2 = next(p for p in PLANS if p.name == "chain2")
    rates = measured_rates({chain2: ([800, 560], [1000, 800])}, 3)  # 0.8 then 0.7
    assert set(rates) == {"sampled"}
    # one standard error under the estimate, sqrt(r (1 - r) / trials) (the prior's row among the trials)
    assert rates["sampled"][:2] == pytest.approx([0.8 - (0.16 / 1001) ** 0.5, 0.7 - (0.21 / 801) ** 0.5], abs=5e-4)
    few = measured_rates({chain2: ([80, 56], [100, 80])}, 3)["sampled"]  # the same rates over a tenth the trials
    assert few[:2] == pytest.approx([0.8 - (0.16 / 101) ** 0.5, 0.7 - (0.21 / 81) ** 0.5], abs=2e-3)
    # level 3, which no plan reached: the pooled rate (over both levels' trials), under its own error
    pooled = (0.5 + 800 + 560) / 1801
    assert rates["sampled"][2] == pytest.approx(pooled - (pooled * (1 - pooled) / 1801) ** 0.5, abs=5e-4)
    model = AcceptanceModel(prior=0.5, prior_rates=rates)
    chain3 = next(p for p in PLANS if p.name == "chain3")
    assert model.level_rates(chain3)[:2] == pytest.approx(rates["sampled"][:2], abs=0.01)
    tree16 = next(p for p in PLANS if p.name == "tree16")
    assert model.level_rates(tree16) == pytest.approx(AcceptanceModel(prior=0.5).level_rates(tree16))
    model.observe(chain3, [20, 2, 0], [100, 20, 2])  # this run accepts far less
    assert model.level_rates(chain3)[0] < 0.35
    with pytest.raises(ValueError, match="prior_rates"):
        AcceptanceModel(prior_rates={"sampled": [1.5]})


def test_candidate_plans_by_draft_kind():
    default = candidate_plans(3)
    assert {p.kind for p in default} == {"ar", "chain", "static", "dynamic"}
    assert all(p.samples for p in default if p.kind in ("chain", "static"))
    assert not any(p.samples for p in default if p.kind == "dynamic")
    assert all(len(p.static_widths) <= 3 for p in default if p.kind == "static")
    sampled = candidate_plans(5, draft="sampled")
    assert "dynamic" not in {p.kind for p in sampled}
    top = candidate_plans(5, draft="deterministic")
    assert "static" not in {p.kind for p in top}
    assert not any(p.samples for p in top)
    assert len({p.name for p in default + top}) == len(default) + len(top) - 1 - 5  # AR and trees shared
    with pytest.raises(ValueError, match="draft"):
        candidate_plans(3, draft="bogus")


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="prior"):
        AcceptanceModel(prior=1.0)
    with pytest.raises(ValueError, match="AR"):
        Planner(synthetic_costs(), PLANS[1:])
    with pytest.raises(ValueError, match="seconds"):
        CostModel({"ar": {2: 0.0}})


def test_cost_model_interpolates_and_extrapolates():
    costs = CostModel({"ar": {2: 1.0, 16: 2.0}, "flat": {2: 1.0}})
    assert costs.step_seconds("ar", 1) == 1.0
    assert costs.step_seconds("ar", 9) == pytest.approx(1.5)
    assert costs.step_seconds("ar", 30) == pytest.approx(3.0)  # the last segment's slope
    assert costs.step_seconds("flat", 4) == pytest.approx(2.0)  # one point: proportional to rows
    assert CostModel.from_json(costs.to_json()).points == costs.points


levels = st.floats(0.0, 1.0)


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(dispatch=st.floats(1e-4, 0.1), per_token=st.floats(0.0, 1e-2), drafter=st.floats(0.0, 0.1),
       prior=st.floats(0.0, 0.99), rows=st.integers(1, 200), margin=st.sampled_from([0.0, 0.1, 0.5]),
       data=st.data())
def test_never_picks_a_plan_predicted_slower_than_ar(dispatch, per_token, drafter, prior, rows, margin, data):
    p = Planner(synthetic_costs(dispatch, per_token, drafter), PLANS, AcceptanceModel(prior=prior), margin=margin)
    for plan in data.draw(st.lists(st.sampled_from(PLANS[1:]), max_size=4)):
        trials = data.draw(st.lists(st.integers(0, 50), min_size=plan.depth, max_size=plan.depth))
        hits = [data.draw(st.integers(0, t)) for t in trials]
        p.acceptance.observe(plan, hits, trials)
    n_active = data.draw(st.integers(1, max(rows // 2, 1)))
    reaching = sorted(data.draw(st.lists(st.integers(0, n_active), min_size=5, max_size=5)), reverse=True)
    decision = p.choose(rows, n_active, reaching)
    rates = [tokens / seconds for tokens, seconds, _ in p.rates(rows, n_active, reaching)]
    ar_rate = n_active / p.cost_model.step_seconds("ar", rows)
    assert decision.tokens_per_s >= ar_rate * (1 - 1e-12)
    if decision.plan.is_ar:
        assert max(rates) <= ar_rate * (1 + margin) * (1 + 1e-12)
    else:
        assert math.isclose(decision.tokens_per_s, max(rates), rel_tol=1e-12)
        assert decision.tokens_per_s > ar_rate * (1 + margin)


def test_margin_keeps_ar_near_break_even():
    """A drafting plan predicted 5 % faster than AR is taken without a margin and refused with a 10 % one;
    one predicted 30 % faster is taken either way."""
    chain1 = next(p for p in PLANS if p.name == "chain1")
    for gain, margin, drafts in ((1.05, 0.0, True), (1.05, 0.1, False), (1.3, 0.1, True)):
        # chain1 at acceptance 0.5 emits 1.5 tokens a row: its step costs 1.5 / gain AR steps
        costs = CostModel({"ar": {2: 0.01}, "chain1": {2: 0.01 * 1.5 / gain}})
        p = Planner(costs, [AR_PLAN, chain1], AcceptanceModel(prior=0.5), margin=margin)
        decision = p.choose(rows=2, n_active=1, rows_reaching=[1])
        assert decision.plan == (chain1 if drafts else AR_PLAN)
        assert decision.runner_up == (AR_PLAN if drafts else chain1)
    with pytest.raises(ValueError, match="margin"):
        Planner(costs, [AR_PLAN, chain1], margin=-0.1)


def simulated_steps(survival, remaining, rows, runs=20000, seed=0):
    """Mean over ``runs`` simulated batches of the steps until the slowest row is done (numpy, fixed seed)."""
    tail = np.array([1.0, *survival, 0.0])
    emit = tail[:-1] - tail[1:]
    draws = np.random.default_rng(seed).choice(len(emit), size=(runs, rows, remaining), p=emit) + 1
    steps = (np.cumsum(draws, axis=2) < remaining).sum(axis=2) + 1  # [runs, rows]
    return steps.max(axis=1).mean()


@pytest.mark.parametrize("survival, remaining, rows", [([0.87, 0.58], 63, 1), ([0.87, 0.58], 63, 10),
                                                        ([0.6, 0.3, 0.1], 20, 4), ([0.9], 7, 40)])
def test_steps_to_finish_is_the_slowest_rows_expected_steps(survival, remaining, rows):
    """Against simulated batches: 20000 runs put the simulated mean within ~0.02 steps (its standard error
    is under 0.01 here), so a 1 % tolerance cannot fail by chance; one row per batch (rows=1) would miss
    the batch-10 case by 2.4 steps (the negative control)."""
    want = simulated_steps(survival, remaining, rows)
    assert steps_to_finish(survival, remaining, rows) == pytest.approx(want, rel=0.01)
    if rows > 1:
        assert steps_to_finish(survival, remaining, 1) < want * 0.97


def simulated_compacted_seconds(survival, remaining, rows, step_s, runs=4000, seed=0):
    """Mean over simulated batches of the seconds until the slowest row is done, each step costing
    step_s(live rows), the finished rows leaving the batch by ``DecodeState.should_compact``'s rule."""
    tail = np.array([1.0, *survival, 0.0])
    emit = tail[:-1] - tail[1:]
    draws = np.random.default_rng(seed).choice(len(emit), size=(runs, rows, remaining), p=emit) + 1
    steps = (np.cumsum(draws, axis=2) < remaining).sum(axis=2) + 1  # [runs, rows] each row's steps
    total = 0.0
    for row_steps in steps:
        live = rows
        for n in range(1, row_steps.max() + 1):
            active = int((row_steps >= n).sum())  # rows not done before step n
            if 4 * (live - active) >= live:
                live = active
            total += step_s(live)
    return total / runs


@pytest.mark.parametrize("survival, rows", [([0.85, 0.65], 10), ([0.85, 0.65, 0.5, 0.38], 10), ([0.6, 0.3], 40)])
def test_a_compacting_runs_later_steps_cost_the_rows_left(survival, rows):
    """Where finished rows leave the batch, a whole run's prediction prices each step at the rows still in
    it (expected rows not done, taken out by the quarter rule): within 3 % of simulated batches (4000 of them,
    a fixed seed), where pricing every step at the full batch (the negative control) is over by 4 % or more.
    AR's rows all finish at the last step: its steps stay at the full batch."""
    from lantern.decoding.costs import CostModel

    plan = Plan("chainx", "chain", depth=len(survival), sampled=True)
    costs = CostModel({"ar": {2: 1.0, 2 * rows: 2.0}, "chainx": {2: 1.5, 2 * rows: 4.0}}, {"source": "test"})
    survive = AcceptanceModel(prior_rates={"sampled": [survival[0]] + [b / a for a, b in zip(survival,
                                                                                              survival[1:])]})
    compacting = Planner(costs, [AR_PLAN, plan], survive, compacts=True)
    steps, step_s = compacting.run_steps(plan, 2 * rows, rows, 63)
    want = simulated_compacted_seconds(compacting.acceptance.survival(plan), 63, rows,
                                       lambda live: costs.step_seconds("chainx", 2 * live))
    assert steps * step_s == pytest.approx(want, rel=0.03)
    whole = Planner(costs, [AR_PLAN, plan], survive).run_seconds(plan, 2 * rows, rows, 63)
    assert whole > 1.04 * want
    assert compacting.run_seconds(AR_PLAN, 2 * rows, rows, 63) == pytest.approx(63 * 2.0)


def test_steps_to_finish_of_ar_and_of_nothing_left():
    assert steps_to_finish([], 63, 10) == 63.0
    assert steps_to_finish([0.5, 0.5], 0, 10) == 0.0
    assert steps_to_finish([0.999999], 10, 3) == pytest.approx(5.0, abs=1e-3)  # two tokens every step
    with pytest.raises(ValueError, match="rows"):
        steps_to_finish([0.5], 5, 0)


def test_plan_run_counts_the_stragglers_a_per_step_rate_misses():
    """chain2 emits 2.45 tokens a row per step (survival 0.87, 0.58) and its step costs 2.35 AR steps: per step
    it beats AR by 4 %, and one row needs 26 steps (0.61 s against AR's 0.63 s), but a batch of 10 needs
    ~28.5 steps (0.67 s), not 63 / 2.45 = 25.7: AR."""
    chain2 = next(p for p in PLANS if p.name == "chain2")
    costs = CostModel({"ar": {2: 0.01, 20: 0.01}, "chain2": {2: 0.0235, 20: 0.0235}})
    model = AcceptanceModel(prior_rates={"sampled": [0.87, 0.667]}, prior_weight=1e9)
    p = Planner(costs, [AR_PLAN, chain2], model)
    assert not p.choose(rows=20, n_active=10, rows_reaching=[10, 10]).plan.is_ar
    assert p.plan_run(rows=2, n_active=1, remaining=63).plan == chain2
    batch = p.plan_run(rows=20, n_active=10, remaining=63)
    assert batch.plan == AR_PLAN and batch.runner_up == chain2
    assert batch.runner_up_rate == pytest.approx(630 / p.run_seconds(chain2, 20, 10, 63))
    assert p.run_seconds(chain2, 20, 10, 63) == pytest.approx(0.0235 * steps_to_finish([0.87, 0.58], 63, 10),
                                                             rel=1e-3)
    cheaper = Planner(CostModel({"ar": {20: 0.01}, "chain2": {20: 0.018}}), [AR_PLAN, chain2], model, margin=0.1)
    assert cheaper.plan_run(rows=20, n_active=10, remaining=63).plan == chain2
    faster_ar = cheaper.plan_run(rows=20, n_active=10, remaining=63, ar_step_s=0.005)  # e.g. a compiled AR loop
    assert faster_ar.plan == AR_PLAN and faster_ar.ar_tokens_per_s == pytest.approx(630 / (63 * 0.005))
