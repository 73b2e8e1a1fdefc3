"""The calibration cache of tree="auto": measured once and written, then reused; measured again when stale
(another torch / fused backend, too old) or corrupt (with a warning, never trusted)."""
import json

import pytest
import torch

from lantern.decoding import SpecConfig, resolve_cost_model
from lantern.decoding import costs
from lantern.decoding.planner import AR_PLAN, Plan
from lantern.models import build_gpt
from lantern.models.drafter import EagleDrafter

KEY = {"device": "test", "mode": {"plans": ["ar"]}}


class Measure:
    def __init__(self):
        self.calls = 0

    def __call__(self):
        self.calls += 1
        return {"ar": {2: 0.01, 16: 0.02}, "chain1": {2: 0.015}}


def test_measured_once_then_read_back(tmp_path):
    measure = Measure()
    first = costs.cached_cost_model(KEY, measure, directory=tmp_path)
    second = costs.cached_cost_model(KEY, measure, directory=tmp_path)
    assert measure.calls == 1
    assert first.meta["source"] == "measured" and second.meta["source"] == "cache"
    assert second.points == first.points == {"ar": {2: 0.01, 16: 0.02}, "chain1": {2: 0.015}}
    other = costs.cached_cost_model(dict(KEY, device="another"), measure, directory=tmp_path)
    assert measure.calls == 2 and other.meta["path"] != first.meta["path"]
    assert len(list(tmp_path.glob("costs-*.json"))) == 2


@pytest.mark.parametrize("change", ["torch", "backend", "format"])
def test_stale_stamp_is_measured_again(tmp_path, monkeypatch, change):
    measure = Measure()
    costs.cached_cost_model(KEY, measure, directory=tmp_path)
    stamp = dict(costs.staleness_stamp(), **{change: "something else"})
    monkeypatch.setattr(costs, "staleness_stamp", lambda: stamp)
    assert costs.cached_cost_model(KEY, measure, directory=tmp_path).meta["source"] == "measured"
    assert costs.cached_cost_model(KEY, measure, directory=tmp_path).meta["source"] == "cache"
    assert measure.calls == 2


def test_old_file_is_measured_again(tmp_path):
    measure = Measure()
    path = costs.cache_path(KEY, tmp_path)
    costs.cached_cost_model(KEY, measure, directory=tmp_path)
    data = json.loads(path.read_text())
    data["meta"]["created"] -= (costs.MAX_AGE_DAYS + 1) * 86400
    path.write_text(json.dumps(data))
    assert costs.cached_cost_model(KEY, measure, directory=tmp_path).meta["source"] == "measured"
    assert measure.calls == 2


@pytest.mark.parametrize("garbage", ["{not json", "[1, 2]", '{"points": {"ar": {"2": -1}}}',
                                     '{"points": {"ar": {"2": 0.01}}, "meta": {"key": "another"}}', ""])
def test_corrupt_file_warns_and_is_measured_again(tmp_path, garbage):
    measure = Measure()
    path = costs.cache_path(KEY, tmp_path)
    path.write_text(garbage)
    with pytest.warns(RuntimeWarning, match="corrupt"):
        model = costs.cached_cost_model(KEY, measure, directory=tmp_path)
    assert measure.calls == 1 and model.meta["source"] == "measured"
    assert costs.cached_cost_model(KEY, measure, directory=tmp_path).meta["source"] == "cache"  # rewritten


def test_resolve_calibrates_the_real_loop_once(tmp_path, monkeypatch):
    """A real calibration on a small model (two plans, so it takes a moment), then the cache."""
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path))
    torch.manual_seed(0)
    target = build_gpt("GPT-tiny", block_size=16, n_layer=1).eval()
    drafter = EagleDrafter(target.config).bind(target).eval()
    config = SpecConfig(method="spec", plans=[AR_PLAN, Plan("chain2", "chain", depth=2)])
    labels = torch.tensor([0, 1])
    first = resolve_cost_model(target, drafter, labels, config=config, cfg_scale=2.0)
    second = resolve_cost_model(target, drafter, labels, config=config, cfg_scale=2.0)
    assert first.meta["source"] == "measured" and second.meta["source"] == "cache"
    assert set(first.points) == {"ar", "chain2"} and 2 in first.points["ar"]
    assert all(s > 0 for pts in first.points.values() for s in pts.values())
    assert first.meta["calibration_s"] < 30
    assert set(first.acceptance) == {"top"}  # the top-1 chain's verify results, the planner's prior
    assert len(first.acceptance["top"]) == 2 and all(0 <= r < 1 for r in first.acceptance["top"])
    assert second.acceptance == first.acceptance  # kept in the cache file
    unguided = resolve_cost_model(target, drafter, labels, config=config)  # another mode, another entry
    assert unguided.meta["source"] == "measured"


def test_acceptance_is_cached_and_checked(tmp_path):
    def measure():
        return {"points": {"ar": {2: 0.01}}, "acceptance": {"sampled": [0.8, 0.7]}}

    first = costs.cached_cost_model(KEY, measure, directory=tmp_path)
    assert costs.cached_cost_model(KEY, measure, directory=tmp_path).acceptance == {"sampled": [0.8, 0.7]}
    assert first.acceptance == {"sampled": [0.8, 0.7]}
    for bad in ({"sampled": [1.0]}, {"greedy": [0.5]}, {"top": [-0.1]}):
        with pytest.raises(ValueError, match="acceptance"):
            costs.CostModel({"ar": {2: 0.01}}, acceptance=bad)


def test_a_new_row_count_extends_the_cached_model(tmp_path):
    """With the row counts a run needs, the cache measures only those it lacks and keeps the rest."""
    calls = []

    def measure(missing, known):
        calls.append((list(missing), known is not None))
        return {"points": {"ar": {r: 0.001 * r for r in missing}, "chain1": {r: 0.002 * r for r in missing}},
                "acceptance": {"sampled": [0.9 if known else 0.7]}}

    first = costs.cached_cost_model(KEY, measure, rows=[2, 16], directory=tmp_path)
    assert calls == [([2, 16], False)] and first.meta["source"] == "measured"
    assert costs.cached_cost_model(KEY, measure, rows=[16, 2], directory=tmp_path).meta["source"] == "cache"
    wider = costs.cached_cost_model(KEY, measure, rows=[2, 16, 80], directory=tmp_path)
    assert calls[-1] == ([80], True) and wider.meta["source"] == "extended"
    assert wider.points["ar"] == {2: 0.002, 16: 0.016, 80: 0.08}
    assert wider.acceptance == {"sampled": [0.7]}  # the first calibration's rates are kept
    assert wider.meta["created"] == first.meta["created"]
    reread = costs.cached_cost_model(KEY, measure, rows=[80], directory=tmp_path)
    assert reread.meta["source"] == "cache" and reread.points == wider.points and len(calls) == 2


def test_calibration_at_a_larger_batch_times_only_the_plans_that_could_pay(tmp_path, monkeypatch):
    """A plan slower than AR at the smaller row count is not timed at the larger one; its point there is
    the bound that ruled it out."""
    from lantern.decoding.spec import Sampling, calibrate

    torch.manual_seed(0)
    target = build_gpt("GPT-tiny", block_size=16, n_layer=1).eval()
    drafter = EagleDrafter(target.config).bind(target).eval()
    chain1, chain2 = Plan("chain1", "chain", depth=1, sampled=True), Plan("chain2", "chain", depth=2, sampled=True)
    config = SpecConfig(method="spec", plans=[AR_PLAN, chain1, chain2])
    # "measured" at 2 rows with AR slower than at 4 rows will be (no growth to add): chain1 far cheaper than any
    # AR step, chain2 far dearer (1 s for 2.1 tokens a row) than the 1-layer model's AR step at 4 rows
    known = costs.CostModel({"ar": {2: 1.0}, "chain1": {2: 1e-5}, "chain2": {2: 1.0}},
                            acceptance={"sampled": [0.7, 0.6]})
    with torch.no_grad():
        got = calibrate(target, drafter, torch.tensor([0, 1]), None, config, Sampling(cfg_scale=2.0), 16,
                        [AR_PLAN, chain1, chain2], rows_grid=[4], known=known)
    assert set(got["points"]["ar"]) == {4} and set(got["points"]["chain1"]) == {4}
    # chain2 was not timed: its point is the bound that left it out (its 2-row second, AR having grown by
    # nothing), not the 2-row slope extrapolated, so no planner sees it paying at 4 rows
    assert got["points"]["chain2"] == {4: 1.0}
    assert set(got["acceptance"]) == {"sampled"}


def test_a_step_costs_no_more_than_a_step_that_contains_it():
    """Load only adds time: a measured point is lowered to the cheapest measurement of a plan that does all
    of its work (a deeper chain, a larger nested tree, the same plan at more rows); unrelated plans (another
    draft kind, a tree that does not contain it) leave it alone."""
    from lantern.decoding.spec import _contains, _nested_min

    chain1, chain2 = Plan("chain1", "chain", depth=1, sampled=True), Plan("chain2", "chain", depth=2, sampled=True)
    top2 = Plan("top1chain2", "chain", depth=2)
    small, big = (Plan("s", "static", depth=2, static_widths=(2, 1)), Plan("b", "static", depth=3,
                                                                          static_widths=(3, 1, 1)))
    other = Plan("o", "static", depth=4, static_widths=(1, 1, 1, 1))  # deeper than big
    assert _contains(chain2, chain1) and not _contains(chain1, chain2) and not _contains(top2, chain1)
    assert _contains(big, small) and not _contains(big, other) and _contains(small, AR_PLAN)
    points = {"ar": {2: 0.05, 16: 0.02}, "chain1": {2: 0.03, 16: 0.04}, "chain2": {2: 0.02, 16: 0.05},
              "top1chain2": {2: 0.001, 16: 0.001}, "s": {2: 0.04}, "b": {2: 0.03}, "o": {2: 0.001}}
    _nested_min(points, [AR_PLAN, chain1, chain2, top2, small, big, other])
    assert points["ar"] == {2: 0.001, 16: 0.001}  # every step contains an AR step
    assert points["chain1"] == {2: 0.02, 16: 0.04} and points["chain2"] == {2: 0.02, 16: 0.05}
    assert points["s"] == {2: 0.03} and points["b"] == {2: 0.03} and points["o"] == {2: 0.001}
