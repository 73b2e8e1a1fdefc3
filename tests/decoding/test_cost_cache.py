"""The calibration cache of tree="auto": measured once and written, then reused; measured again when stale
(another torch / fused backend, too old) or corrupt (with a warning, never trusted). The reader takes only
a regular file of bounded size whose whole schema holds; a write that fails warns and the run goes on; a
write goes through a new unique temporary file with the user's umask."""
import contextlib
import json
import math
import os
import resource
import stat
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

from lantern.decoding import SpecConfig, costs, resolve_cost_model
from lantern.decoding.planner import AR_PLAN, Plan, Planner
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


@pytest.mark.parametrize("change", ["torch", "backend", "format", "lantern"])
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
    from lantern.decoding.calibration import calibrate
    from lantern.decoding.config import Sampling

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
    from lantern.decoding.calibration import _contains, _nested_min

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


class PositionTimer:
    """A stand-in for calibration._StepTimer: a step's seconds grow with the state's position in the image
    (its attention) and with the plan's ``factor``; a plan's step advances the position by its depth + 1, AR's
    by 1, and the image starts again at its end."""

    max_depth = 2

    def __init__(self, factor, L=64):
        self.factor, self.L, self.position = factor, L, 0

    def __call__(self, plan) -> float:
        seconds = 0.01 * self.factor[plan.name] * (1.0 + self.position / 32)
        self.position = (self.position + plan.depth + 1) % self.L
        return seconds


def test_a_plans_step_is_timed_against_the_ar_step_at_its_position():
    """A plan's point is its median ratio to the AR step just before it, times AR's median step: a plan
    twice AR's cost at every position comes out at about twice AR's point (2 % over: the plan's step runs one
    token after its AR step), wherever its steps fell. The plans that could beat AR get CONFIRM_ROUNDS more
    steps (chain2: 1.75 tokens a row at the prior's 0.5 acceptance, 25 % slack, 2x AR's step), the others not
    (chain3 at 4x AR's step). Negative control: the fastest of each plan's own steps in the rounds every plan
    had (the previous statistic) puts chain2 at 2.2x AR (AR's fastest step at the image's start, chain2's
    never there)."""
    from lantern.decoding.calibration import CONFIRM_ROUNDS, _step_points, _time_plans

    chain1, chain2 = Plan("chain1", "chain", depth=1, sampled=True), Plan("chain2", "chain", depth=2, sampled=True)
    chain3 = Plan("chain3", "chain", depth=3, sampled=True)
    plans = [AR_PLAN, chain1, chain2, chain3]
    factor = {"ar": 1.0, "chain1": 1.5, "chain2": 2.0, "chain3": 4.0}
    points = {p.name: {} for p in plans}
    times, ratios, bounds = _time_plans(PositionTimer(factor), plans, points, 4, 2, {}, None, 3, 0.3)
    assert not bounds and len(ratios["chain3"]) == 3
    assert len(ratios["chain1"]) == len(ratios["chain2"]) == 3 + CONFIRM_ROUNDS
    assert len(times["ar"]) == 3 * 3 + 2 * CONFIRM_ROUNDS
    got = _step_points(times, ratios)
    ar = sorted(times["ar"])
    assert got["ar"] == (ar[len(ar) // 2] if len(ar) % 2 else (ar[len(ar) // 2 - 1] + ar[len(ar) // 2]) / 2)
    for name in ("chain1", "chain2", "chain3"):
        assert got[name] / got["ar"] == pytest.approx(factor[name], rel=0.03)
    first = {"chain2": times["chain2"][:3], "ar": times["ar"][:9]}  # the 3 rounds all plans had
    assert min(first["chain2"]) / min(first["ar"]) > 1.08 * factor["chain2"]


def test_the_calibrations_state_steps_until_its_last_row_is_done(monkeypatch):
    """The shared state of the calibration starts afresh only once every row has finished its image, so the
    timed steps fall all over the image as a run's do (a run's rows step on until the last is done);
    starting afresh when the first row finished kept the steps in the image's cheaper first part."""
    from lantern.decoding import calibration
    from lantern.decoding.config import Sampling

    L = 16

    class RaggedState:  # rows advance 1, 2 and 3 tokens a step
        made = 0

        def __init__(self, *args, **kwargs):
            RaggedState.made += 1
            self.n_done, self.figures = torch.ones(3, dtype=torch.int64), None

        def step(self, plan, step):
            self.n_done = torch.clamp(self.n_done + torch.tensor([1, 2, 3]), max=L)

        def sync(self, max_depth, figures):
            return [int((self.n_done < L).sum())]

        def close(self):
            pass

    monkeypatch.setattr(calibration, "new_state", RaggedState)
    target = build_gpt("GPT-tiny", block_size=L, n_layer=1).eval()
    timer = calibration._StepTimer(target, None, torch.tensor([0, 1, 2]), None, SpecConfig(method="spec"),
                                   Sampling(), L, [AR_PLAN], 3, {})
    before = []  # each step's rows done, before it
    for _ in range(2 * (L - 1)):
        state = timer._ready_state()
        before.append(int((state.n_done >= L).sum()))
        timer(AR_PLAN)
    assert RaggedState.made == 2 and before.count(1) > 0 and before.count(2) > 0  # steps with rows done
    assert before[L - 1] == 0  # the second state: its first step


# ---- the reader: only a regular file of bounded size, never trusted, never a reason to fail -------------

def fresh_entry(**changes) -> dict:
    """The JSON a fresh cache file for KEY holds, with ``changes`` applied to its top level."""
    data = {"format": costs.FORMAT, "acceptance": {"sampled": [0.8]},
            "points": {"ar": {"2": 0.01, "16": 0.02}, "chain1": {"2": 0.015}},
            "meta": {"key": KEY, "stamp": costs.staleness_stamp(), "created": time.time(), "calibration_s": 1.5}}
    data.update(changes)
    return data


def with_meta(**changes) -> dict:
    data = fresh_entry()
    data["meta"].update(changes)
    return data


def assert_measured_again(tmp_path, match="corrupt"):
    """One call warns (``match``) and measures; the entry it wrote is then read back."""
    measure = Measure()
    with pytest.warns(RuntimeWarning, match=match):
        model = costs.cached_cost_model(KEY, measure, directory=tmp_path)
    assert measure.calls == 1 and model.meta["source"] == "measured"
    assert model.points == Measure()()
    return model


def test_a_well_formed_entry_is_read_back(tmp_path):
    """The positive control of the tests below: the entry they break, written as is, is used."""
    costs.cache_path(KEY, tmp_path).write_text(json.dumps(fresh_entry()))
    model = costs.cached_cost_model(KEY, Measure(), directory=tmp_path)
    assert model.meta["source"] == "cache" and model.points == {"ar": {2: 0.01, 16: 0.02}, "chain1": {2: 0.015}}


def test_a_fifo_entry_is_refused_without_blocking(tmp_path):
    """A reader that opened a FIFO would wait for a writer forever; a timer plays the writer after 10 s so
    that a regression fails instead of hanging."""
    path = costs.cache_path(KEY, tmp_path)
    os.mkfifo(path)
    unblocked = []

    def play_the_writer():
        with contextlib.suppress(OSError):  # ENXIO: nobody is reading it
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
            unblocked.append(True)

    timer = threading.Timer(10.0, play_the_writer)
    timer.start()
    try:
        assert_measured_again(tmp_path, match="FIFO")
    finally:
        timer.cancel()
    assert not unblocked, "the reader blocked on the FIFO"
    assert stat.S_ISREG(os.lstat(path).st_mode)  # the measurement replaced the FIFO


@contextlib.contextmanager
def heap_limit(extra_bytes: int):
    """RLIMIT_DATA at the current data size plus ``extra_bytes``: a reader that regresses into reading an
    endless file raises MemoryError instead of filling the machine's memory."""
    with open("/proc/self/status") as f:
        data_kb = next(int(line.split()[1]) for line in f if line.startswith("VmData:"))
    soft, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = data_kb * 1024 + extra_bytes
    resource.setrlimit(resource.RLIMIT_DATA, (limit if hard == resource.RLIM_INFINITY else min(limit, hard), hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))


@pytest.mark.skipif(not os.path.exists("/dev/zero") or not os.path.exists("/proc/self/status"),
                    reason="needs /dev/zero and /proc")
def test_a_symlink_to_an_endless_file_is_not_followed(tmp_path):
    path = costs.cache_path(KEY, tmp_path)
    path.symlink_to("/dev/zero")
    with heap_limit(512 << 20):
        assert_measured_again(tmp_path, match="symbolic link")
    assert stat.S_ISREG(os.lstat(path).st_mode)


def test_a_symlink_to_a_good_entry_is_not_followed_and_its_target_is_kept(tmp_path):
    """A link in the cache folder is refused even when it leads to a well-formed entry, and the
    measurement replaces the link, not the file it pointed to."""
    elsewhere = tmp_path / "elsewhere.json"
    text = json.dumps(fresh_entry())
    elsewhere.write_text(text)
    cache = tmp_path / "cache"
    cache.mkdir()
    costs.cache_path(KEY, cache).symlink_to(elsewhere)
    assert_measured_again(cache, match="symbolic link")
    assert elsewhere.read_text() == text and stat.S_ISREG(os.lstat(costs.cache_path(KEY, cache)).st_mode)


def test_an_entry_larger_than_the_cap_is_refused_unread(tmp_path):
    """A well-formed entry padded past MAX_FILE_BYTES: refused by its size, not parsed."""
    padded = json.dumps(fresh_entry()) + " " * costs.MAX_FILE_BYTES
    costs.cache_path(KEY, tmp_path).write_text(padded)
    assert_measured_again(tmp_path, match="more than a cost model")


def deep(levels: int):
    value = 0
    for _ in range(levels):
        value = [value]
    return value


MALFORMED = {  # label -> the file's text
    "nested too deep to parse": "[" * 200_000,
    "deep nesting inside the key": json.dumps(with_meta(key=None)).replace("null", "[" * 100_000 + "]" * 100_000),
    "created is a string": json.dumps(with_meta(created="yesterday")),
    "created is a bool": json.dumps(with_meta(created=True)),
    "created is NaN": json.dumps(with_meta(created=math.nan)),
    "calibration_s negative": json.dumps(with_meta(calibration_s=-1.0)),
    "meta is a list": json.dumps(fresh_entry(meta=[1])),
    "meta lacks the stamp": json.dumps(fresh_entry(meta={"key": KEY, "created": 1.0, "calibration_s": 1.0})),
    "stamp is a string": json.dumps(with_meta(stamp="fresh")),
    "the key is another": json.dumps(with_meta(key={"device": "another"})),
    "no format": json.dumps({k: v for k, v in fresh_entry().items() if k != "format"}),
    "format is a string": json.dumps(fresh_entry(format="2")),
    "an unknown field": json.dumps(fresh_entry(extra=1)),
    "points is a list": json.dumps(fresh_entry(points=[0.01])),
    "no AR entry": json.dumps(fresh_entry(points={"chain1": {"2": 0.01}})),
    "a plan without points": json.dumps(fresh_entry(points={"ar": {}})),
    "a plan's points are a list": json.dumps(fresh_entry(points={"ar": [0.01]})),
    "seconds is a string": json.dumps(fresh_entry(points={"ar": {"2": "0.01"}})),
    "seconds is null": json.dumps(fresh_entry(points={"ar": {"2": None}})),
    "seconds is a bool": json.dumps(fresh_entry(points={"ar": {"2": True}})),
    "seconds is an object": json.dumps(fresh_entry(points={"ar": {"2": {"s": 0.01}}})),
    "seconds past float": json.dumps(fresh_entry(points={"ar": {"2": 10**400}})),
    "rows 0": json.dumps(fresh_entry(points={"ar": {"0": 0.01}})),
    "rows negative": json.dumps(fresh_entry(points={"ar": {"-2": 0.01}})),
    "rows with a leading zero": json.dumps(fresh_entry(points={"ar": {"02": 0.01}})),
    "rows with a space": json.dumps(fresh_entry(points={"ar": {" 2": 0.01}})),
    "rows a float": json.dumps(fresh_entry(points={"ar": {"2.0": 0.01}})),
    "rows in other digits": json.dumps(fresh_entry(points={"ar": {"\u0662": 0.01}})),
    "rows past int32": json.dumps(fresh_entry(points={"ar": {"99999999999": 0.01}})),
    "acceptance is a list": json.dumps(fresh_entry(acceptance=[0.5])),
    "rates are a string": json.dumps(fresh_entry(acceptance={"sampled": "0.5"})),
    "rates are an object": json.dumps(fresh_entry(acceptance={"sampled": {"0.5": 1}})),
    "a rate is a string": json.dumps(fresh_entry(acceptance={"sampled": ["0.5"]})),
    "a rate is 1": json.dumps(fresh_entry(acceptance={"sampled": [1.0]})),
    "an unknown family": json.dumps(fresh_entry(acceptance={"greedy": [0.5]})),
    "not UTF-8": b"\xff\xfe{}",
    "the top level is a number": "3",
    "empty": "",
}


@pytest.mark.parametrize("label", list(MALFORMED))
def test_malformed_entries_warn_corrupt_and_are_measured_again(tmp_path, label):
    text = MALFORMED[label]
    path = costs.cache_path(KEY, tmp_path)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert_measured_again(tmp_path)
    assert costs.cached_cost_model(KEY, Measure(), directory=tmp_path).meta["source"] == "cache"  # rewritten


def test_a_folder_entry_warns_and_the_run_goes_on(tmp_path):
    """A folder where the entry belongs: corrupt, measured, and the write (which cannot replace a folder)
    warns too; the folder and what it holds stay, and no temporary file is left."""
    path = costs.cache_path(KEY, tmp_path)
    path.mkdir()
    (path / "inside").write_text("kept")
    measure = Measure()
    with pytest.warns(RuntimeWarning) as caught:
        model = costs.cached_cost_model(KEY, measure, directory=tmp_path)
    messages = [str(w.message) for w in caught]
    assert any("a folder" in m and "corrupt" in m for m in messages), messages
    assert any("could not be written" in m for m in messages), messages
    assert model.meta["source"] == "measured" and measure.calls == 1
    assert (path / "inside").read_text() == "kept" and not list(tmp_path.glob("*.tmp"))


@pytest.mark.parametrize("seconds", ["1e999", "-1e999", "Infinity", "NaN", "1e-300", "5e-324", "0", "-0.01",
                                     "1e300"])
def test_absurd_timings_are_corrupt(tmp_path, seconds):
    """The planner divides expected tokens by these seconds: each must be finite, in [MIN_STEP_S,
    MAX_STEP_S]."""
    text = json.dumps(fresh_entry()).replace('"16": 0.02', f'"16": {seconds}')
    assert seconds in text
    costs.cache_path(KEY, tmp_path).write_text(text)
    model = assert_measured_again(tmp_path)
    planner = Planner(model, [AR_PLAN, Plan("chain1", "chain", depth=1)])
    assert planner.choose(rows=16, n_active=16, rows_reaching=[16]).tokens_per_s > 0


@pytest.mark.parametrize("seconds", [costs.MIN_STEP_S, costs.MAX_STEP_S])
def test_timings_at_the_bounds_are_read_back(tmp_path, seconds):
    data = fresh_entry()
    data["points"]["ar"]["16"] = seconds
    costs.cache_path(KEY, tmp_path).write_text(json.dumps(data))
    model = costs.cached_cost_model(KEY, Measure(), directory=tmp_path)
    assert model.meta["source"] == "cache" and model.points["ar"][16] == seconds
    planner = Planner(model, [AR_PLAN, Plan("chain1", "chain", depth=1)])
    assert 0 < planner.choose(rows=16, n_active=16, rows_reaching=[16]).tokens_per_s < math.inf


# ---- the writer: a failure warns, a unique temporary file, the user's umask -----------------------------

def test_a_cache_that_is_a_file_warns_and_the_measurement_is_used(tmp_path, monkeypatch):
    """LANTERN_CACHE naming a file: nothing to read, the write fails with a warning, the model is used."""
    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file")
    monkeypatch.setenv("LANTERN_CACHE", str(not_a_folder))
    measure = Measure()
    with pytest.warns(RuntimeWarning, match="could not be written") as caught:
        model = costs.cached_cost_model(KEY, measure)
    assert len(caught) == 1 and model.meta["source"] == "measured" and model.points == Measure()()
    assert not_a_folder.read_text() == "a file"


def test_a_folder_no_one_can_write_warns_and_the_measurement_is_used(tmp_path):
    """/proc takes no new folders or files, even from root."""
    measure = Measure()
    with pytest.warns(RuntimeWarning, match="could not be written"):
        model = costs.cached_cost_model(KEY, measure, directory=Path("/proc/lantern-cost-cache"))
    assert model.meta["source"] == "measured" and measure.calls == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_folder_warns_and_the_measurement_is_used(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.warns(RuntimeWarning, match="could not be written"):
            model = costs.cached_cost_model(KEY, Measure(), directory=tmp_path)
    finally:
        tmp_path.chmod(0o755)
    assert model.meta["source"] == "measured" and not list(tmp_path.iterdir())


def test_generation_goes_on_when_the_cache_cannot_be_written(tmp_path, monkeypatch):
    """tree="auto" end to end with LANTERN_CACHE a file: the calibration's model plans the run."""
    from lantern.decoding import generate_spec

    not_a_folder = tmp_path / "cache"
    not_a_folder.write_text("a file")
    monkeypatch.setenv("LANTERN_CACHE", str(not_a_folder))
    torch.manual_seed(0)
    target = build_gpt("GPT-tiny", block_size=16, n_layer=1).eval()
    drafter = EagleDrafter(target.config).bind(target).eval()
    config = SpecConfig(method="spec", plans=[AR_PLAN, Plan("chain2", "chain", depth=2)])
    with pytest.warns(RuntimeWarning, match="could not be written"):
        tokens, stats = generate_spec(target, drafter, torch.tensor([0, 1]), config=config, length=8)
    assert tokens.shape == (2, 8) and stats.planner["cost_model"]["source"] == "measured"


def test_the_write_never_follows_a_link_at_a_temporary_name(tmp_path):
    """Links planted at every name a writer could have predicted (the entry's name with the pid, or with
    .tmp) lead to a victim file: it is never written, and the entry is a regular file."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    path = costs.cache_path(KEY, tmp_path)
    for name in (path.with_suffix(f".{os.getpid()}.tmp"), path.with_suffix(".tmp"), Path(f"{path}.tmp")):
        name.symlink_to(victim)
    costs.cached_cost_model(KEY, Measure(), directory=tmp_path)
    assert victim.read_text() == "precious"
    assert stat.S_ISREG(os.lstat(path).st_mode) and costs.parse_entry(path.read_bytes()).points == Measure()()


def test_concurrent_writers_use_their_own_temporary_files(tmp_path):
    """Threads of one process measuring the same entry at once: no error, no warning, a whole entry at the
    end, no temporary file left."""
    errors = []

    def writer():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                for _ in range(40):
                    costs.cached_cost_model(KEY, Measure(), directory=tmp_path, remeasure=True)
        except Exception as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=writer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert [p.name for p in tmp_path.iterdir()] == [costs.cache_path(KEY, tmp_path).name]
    assert costs.cached_cost_model(KEY, Measure(), directory=tmp_path).meta["source"] == "cache"


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_the_entry_is_created_with_the_users_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        costs.cached_cost_model(KEY, Measure(), directory=tmp_path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(costs.cache_path(KEY, tmp_path)).st_mode) == 0o666 & ~umask


def test_compiled_ars_step_is_the_median_of_pairs_timed_before_and_after_the_plans(monkeypatch):
    """generate_ar's compiled step: (a whole image - a prefill) / the tokens between, per pair; half the
    pairs are timed before the plans' rounds and half after, and the point is their median, as the plans'
    points are medians. Stand-in runs on a stand-in clock: after an untimed first (the compile), the whole
    images take 0.60 and 0.62 s before the rounds and 0.80 and 0.84 s after (the device slowed down during
    them), the prefills 0.03 s: the point is (0.71 - 0.03) / 63. Negative controls: the fastest whole image
    less the fastest prefill (the previous statistic) gives 0.57 s, AR's luckiest run; pairs timed only after
    the rounds (before: all of them) give 0.79 s, the device's speed after the plans were timed."""
    from lantern.decoding import calibration
    from lantern.decoding.compile_choice import CompileChoice

    clock, events = [0.0], []
    whole = iter([0.5, 0.60, 0.62, 0.80, 0.84])  # the first (length 2): compiles, untimed

    class StandIn:
        @staticmethod
        def unguarded(target, labels, *, length, **kw):
            events.append("ar" if length > 2 else "warm-up" if length == 2 else "prefill")
            clock[0] += 0.03 if length == 1 else next(whole)

    def rounds(timer, plans, points, rows, *args):
        events.append("plans")
        return {"ar": [0.01]}, {}, {}

    monkeypatch.setattr(calibration, "generate_ar", StandIn)
    monkeypatch.setattr(calibration.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(calibration, "_time_plans", rounds)
    target = build_gpt("GPT-tiny", block_size=64, n_layer=1).eval()
    choice = CompileChoice({}, "test", aot=True)  # AR's loop compiled apart from the speculative loop's
    out = calibration.calibrate(target, None, torch.tensor([0, 1]), None, SpecConfig(method="spec", plans=[AR_PLAN]),
                                calibration.Sampling(), 64, [AR_PLAN], rows_grid=(2,), choice=choice)
    assert events == ["warm-up", "ar", "prefill", "ar", "prefill", "plans", "ar", "prefill", "ar", "prefill"]
    assert out["points"][calibration.COMPILED_AR][2] == pytest.approx((0.71 - 0.03) / 63)  # the median of 4
    assert next(whole, None) is None
