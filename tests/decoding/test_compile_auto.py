"""compile="auto", the decoding default (python/lantern/decoding/compiled.py): compiled where torch.compile can
work on the device, eager elsewhere with the reason in the stats; inductor's on-disk caches under lantern's
cache folder; compiled and eager steps calibrated into different cost-model cache entries, the compiled
ones timed through the compiled forwards. (The suite runs with LANTERN_COMPILE=0, tests/conftest.py; the tests
here set the variable themselves.)"""
from __future__ import annotations

import dataclasses
import os
import shutil

import pytest
import torch

from lantern.decoding import Plan, SpecConfig, compile_choice, generate, generate_ar, generate_spec
from lantern.decoding import compiled as compiled_module
from lantern.decoding.calibration import _mode
from lantern.decoding.compiled import CompileChoice, baseline_compile, resolve_compile
from lantern.decoding.config import Sampling
from test_compile_loop import AOT, neighbours, small_models


@pytest.fixture
def compile_allowed(monkeypatch):
    monkeypatch.delenv("LANTERN_COMPILE", raising=False)


def test_auto_runs_aot_packages_of_lanterns_models_on_a_cpu(compile_allowed):
    """lantern's own models: every forward from AOT packages (aot.py), "auto" and True alike."""
    from lantern.decoding import aot

    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")) or aot.unavailable() is not None:
        pytest.skip("no C++ compiler or no AOTInductor here")
    target, drafter = small_models()
    for compile in ("auto", True):
        choice = resolve_compile(compile, torch.device("cpu"), (target, drafter))
        assert choice.on and choice.aot and choice.speculative_on and not choice.ar_only and choice.options == {}
        assert "ahead-of-time compiled forwards" in choice.reason
    assert resolve_compile("auto", torch.device("cpu")).aot  # no models named: lantern's own assumed


def test_auto_compiles_only_ars_loop_on_a_cpu_for_other_models(compile_allowed, monkeypatch):
    """A model without AOT packages (a transformers model behind lantern.hf, say): "auto" compiles AR's loop
    with torch.compile and keeps the speculative forwards eager, unless asked (LANTERN_COMPILE=1, True)."""
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler here")
    other = object()  # not one of lantern's models
    choice = resolve_compile("auto", torch.device("cpu"), (other,))
    assert choice.on and choice.ar_only and not choice.speculative_on and not choice.aot and choice.options == {}
    assert choice.reason.startswith("on, AR's loop only (auto: ") and "tens of seconds" in choice.reason
    monkeypatch.setenv("LANTERN_COMPILE", "1")
    choice = resolve_compile("auto", torch.device("cpu"), (other,))
    assert choice.speculative_on and not choice.ar_only and not choice.aot and choice.reason == "on (auto)"
    assert resolve_compile(True, torch.device("cpu"), (other,)).speculative_on  # True compiles every forward


def test_auto_compiles_on_a_gpu_with_triton(compile_allowed, monkeypatch):
    import torch.utils._triton as triton_utils

    monkeypatch.setattr(triton_utils, "has_triton", lambda: True)
    choice = resolve_compile("auto", torch.device("cuda"))
    assert choice.speculative_on and choice.options == {"mode": "reduce-overhead"}
    monkeypatch.setattr(triton_utils, "has_triton", lambda: False)
    assert "Triton" in resolve_compile("auto", torch.device("cuda")).reason


@pytest.mark.parametrize("value", ["0", "off", "false"])
def test_lantern_compile_0_turns_auto_off(monkeypatch, value):
    monkeypatch.setenv("LANTERN_COMPILE", value)
    choice = resolve_compile("auto", torch.device("cpu"))
    assert not choice.on and choice.reason == f"off (auto: LANTERN_COMPILE={value})"
    assert resolve_compile(True, torch.device("cpu")).on  # an explicit True is not "auto"


def test_auto_without_a_cxx_compiler_stays_eager(compile_allowed, monkeypatch):
    monkeypatch.setenv("LANTERN_COMPILE", "1")
    monkeypatch.setattr(compile_choice.shutil, "which", lambda name: None)
    choice = resolve_compile("auto", torch.device("cpu"))
    assert not choice.on and "no C++ compiler" in choice.reason


def test_auto_on_a_device_inductor_does_not_serve_stays_eager(compile_allowed):
    choice = resolve_compile("auto", torch.device("meta"))
    assert not choice.on and "meta" in choice.reason


def test_explicit_choices():
    cpu = torch.device("cpu")
    assert resolve_compile(False, cpu) == CompileChoice(None, "off (compile=False)")
    assert resolve_compile(True, cpu).options == {}
    assert resolve_compile(True, torch.device("cuda")).options == {"mode": "reduce-overhead"}
    assert not resolve_compile(True, torch.device("cuda")).aot and not resolve_compile(dict(AOT), cpu).aot
    assert resolve_compile(dict(AOT), cpu).options == AOT


@pytest.mark.parametrize("before", ["unset", "inductor's default"])
def test_compiling_points_inductor_at_lanterns_cache(monkeypatch, tmp_path, before):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    if before == "unset":
        monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    else:  # inductor sets its default on first use, possibly before lantern compiles anything
        monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path))
    unchanged = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    resolve_compile(False, torch.device("cpu"))
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == unchanged  # eager: nothing changed
    resolve_compile(True, torch.device("cpu"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))  # the user's own setting wins
    resolve_compile(True, torch.device("cpu"))
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "mine")


@pytest.mark.slow  # torch.compile: 10-40 s of CPU
@torch.no_grad()
def test_the_stats_say_what_auto_resolved_to(monkeypatch):
    monkeypatch.setenv("LANTERN_COMPILE", "0")
    target, drafter = small_models()
    ar_stats = {}
    generate_ar(target, torch.tensor([0, 1]), cfg_scale=2.0, seed=1, length=4, stats=ar_stats)
    assert ar_stats["compile"] == "off (auto: LANTERN_COMPILE=0)" and ar_stats["compiled_graphs"] == 0
    _, stats = generate(target, torch.tensor([0, 1]), drafter=drafter, neighbours=neighbours(), k=4, tree="chain",
                        depth=3, cfg_scale=2.0, seed=1)
    assert stats.compile == "off (auto: LANTERN_COMPILE=0)" and stats.compile_s == 0.0
    _, stats = generate(target, torch.tensor([0, 1]), drafter=drafter, neighbours=neighbours(), k=4, tree="chain",
                        depth=3, cfg_scale=2.0, seed=1, compile=AOT)
    assert stats.compile == "on (compile options given)" and stats.compiled_graphs >= 0


def test_compiled_and_eager_costs_are_different_cache_entries():
    config, sampling = SpecConfig(method="spec"), Sampling(1.0, 1.0, 0, 1.0, 0, -1)
    plans = config.candidates()
    modes = [_mode(config, sampling, 16, plans, False, choice) for choice in (
        None, CompileChoice(None, "off"), CompileChoice({}, "inductor"),
        CompileChoice({"mode": "reduce-overhead"}, "cuda"), CompileChoice({}, "AR's loop only", ar_only=True),
        CompileChoice({}, "packages", aot=True))]
    assert modes[0] == modes[1]  # eager, however it came about
    assert len({repr(m) for m in modes[1:]}) == 5


# a plan of each kind the calibration times: AR, a chain, a dynamic tree (a few, so that calibrating is quick)
FEW_PLANS = [Plan("ar", "ar"), Plan("chain2", "chain", depth=2),
             Plan("tree6", "dynamic", depth=2, n_nodes=5, top_per_node=3)]


@pytest.mark.slow  # torch.compile: 10-40 s of CPU
@torch.no_grad()
def test_calibration_times_the_compiled_forwards(monkeypatch, tmp_path):
    """A compiled run's cost model is measured through the compiled forwards (the calibration makes the
    compiled wrappers and their graphs; an eager calibration makes none), so the run then compiles nothing
    new at the shapes it calibrated."""
    from lantern.decoding import resolve_cost_model

    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path))
    labels, kw = torch.tensor([0, 1]), dict(method="spec", depth=3, plans=FEW_PLANS)
    target, drafter = small_models()
    resolve_cost_model(target, drafter, labels, config=SpecConfig(**kw, compile=False), cfg_scale=2.0)
    assert target not in compiled_module._CACHE and drafter not in compiled_module._CACHE
    model = resolve_cost_model(target, drafter, labels, config=SpecConfig(**kw, compile=AOT), cfg_scale=2.0)
    assert target in compiled_module._CACHE and drafter in compiled_module._CACHE
    assert model.meta.get("source") != "cache"  # the eager entry was not reused for the compiled run
    _, stats = generate_spec(target, drafter, labels, config=SpecConfig(**kw, compile=AOT, cost_model=model),
                             cfg_scale=2.0, seed=0)
    assert stats.compile == "on (compile options given)" and stats.compiled_graphs == 0


def test_the_ar_baseline_is_compiled_wherever_torch_compile_works(compile_allowed, monkeypatch):
    """Printed speed-ups are held against the fastest AR lantern runs: compiled on a CPU too, whatever "auto"
    decides for the run; LANTERN_COMPILE=0 keeps everything eager."""
    has_compiler = any(shutil.which(c) for c in ("g++", "c++", "clang++"))
    assert baseline_compile(torch.device("cpu")) == has_compiler
    assert resolve_compile("auto", torch.device("cpu")).on == has_compiler
    monkeypatch.setattr(compile_choice.shutil, "which", lambda name: None)
    assert not baseline_compile(torch.device("cpu"))
    monkeypatch.undo()
    monkeypatch.setenv("LANTERN_COMPILE", "0")
    assert not baseline_compile(torch.device("cpu"))


def _ar_only_compiled(monkeypatch) -> CompileChoice:
    """compile="auto" as on a CPU: AR's loop compiled, the speculative forwards eager (aot_eager: dynamo
    without inductor's compile time)."""
    from lantern.decoding import ar, calibration, spec

    choice = CompileChoice(dict(AOT), "on, AR's loop only (test)", ar_only=True)
    for module in (ar, calibration, spec):
        monkeypatch.setattr(module, "resolve_compile", lambda compile, device, models=(): choice)
    return choice


@pytest.mark.slow  # torch.compile (aot_eager): a few seconds of CPU
@pytest.mark.parametrize("compiled_ar_s, ar_s", [(1e-4, 1.0), (10.0, 1.0), (10.0, 0.2)])
@torch.no_grad()
def test_with_ars_loop_compiled_the_run_is_compiled_ar_where_its_step_beats_the_eager_plans(monkeypatch,
                                                                                         compiled_ar_s, ar_s):
    """The cost model says a chain of 2 beats an eager AR step (1 s each); the compiled AR step then decides:
    much faster (1e-4 s) -> the whole run is generate_ar's compiled loop (its tokens, every step AR, the eager
    plan the runner-up); much slower (10 s, the negative control) -> the speculative run, its forwards eager.
    With the AR step at 0.2 s the run is AR's loop however slow its compiled step was timed: whole runs and
    single steps are timed differently, and the plans are single steps (``spec._ar_loop_step``)."""
    from lantern.decoding import CostModel
    from lantern.decoding.calibration import COMPILED_AR

    target, drafter = small_models()
    choice = _ar_only_compiled(monkeypatch)
    labels = torch.tensor([0, 1])  # 4 rows with guidance
    plans = [Plan("ar", "ar"), Plan("chain2", "chain", depth=2)]
    cost = CostModel({"ar": {4: ar_s}, "chain2": {4: 1.0}, COMPILED_AR: {4: compiled_ar_s}}, {"source": "test"})
    config = SpecConfig(method="spec", tree="auto", cost_model=cost, plans=plans, adapt_costs=False, depth=2)
    tokens, stats = generate_spec(target, drafter, labels, config=config, cfg_scale=2.0, seed=3)
    assert stats.compile == choice.reason
    L = target.config.block_size
    if min(compiled_ar_s, ar_s) < 1.0:
        ar_stats = {}
        want = generate_ar(target, labels, cfg_scale=2.0, seed=3, compile=choice, stats=ar_stats)
        assert torch.equal(tokens, want) and ar_stats["compile"] == choice.reason
        assert stats.plan_counts == {"ar": L - 1} and stats.planner["all_ar"]
        assert stats.planner["plans"]["ar"]["runner_up"] == "chain2"
    else:
        assert stats.plan_counts.get("chain2", 0) > 0 and "all_ar" not in stats.planner
        assert stats.compiled_graphs == 0 and drafter not in compiled_module._CACHE  # eager speculative forwards


@pytest.mark.slow  # torch.compile (aot_eager): a few seconds of CPU
@torch.no_grad()
def test_with_ars_loop_compiled_the_calibration_times_compiled_ar_beside_the_eager_plans(monkeypatch, tmp_path):
    from lantern.decoding import resolve_cost_model
    from lantern.decoding.calibration import COMPILED_AR

    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path))
    target, drafter = small_models()
    labels, config = torch.tensor([0, 1]), SpecConfig(method="spec", depth=3, plans=FEW_PLANS)
    eager = resolve_cost_model(target, drafter, labels, config=dataclasses.replace(config, compile=False),
                               cfg_scale=2.0)
    assert not eager.knows(COMPILED_AR)
    _ar_only_compiled(monkeypatch)
    model = resolve_cost_model(target, drafter, labels, config=config, cfg_scale=2.0)
    assert model.meta["source"] != "cache"  # the eager entry is not this one
    assert sorted(model.points[COMPILED_AR]) == sorted(model.points["ar"]) == [2, 4]
    assert all(s > 0 for s in model.points[COMPILED_AR].values())
    assert target in compiled_module._CACHE and drafter not in compiled_module._CACHE  # AR's graph only
