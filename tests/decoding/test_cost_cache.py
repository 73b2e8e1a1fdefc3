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
