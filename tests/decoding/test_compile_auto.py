"""compile="auto", the decoding default (python/lantern/decoding/compiled.py): compiled where torch.compile can
work on the device, eager elsewhere with the reason in the stats; inductor's on-disk caches under lantern's
cache folder; compiled and eager steps calibrated into different cost-model cache entries, the compiled
ones timed through the compiled forwards. (The suite runs with LANTERN_COMPILE=0, tests/conftest.py; the tests
here set the variable themselves.)"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from lantern.decoding import SpecConfig, compile_choice, generate, generate_ar, generate_spec
from lantern.decoding import compiled as compiled_module
from lantern.decoding.calibration import _mode
from lantern.decoding.compiled import baseline_compile, resolve_compile
from lantern.decoding.config import Sampling
from test_compile_loop import AOT, neighbours, small_models


@pytest.fixture
def compile_allowed(monkeypatch):
    monkeypatch.delenv("LANTERN_COMPILE", raising=False)


def test_auto_stays_eager_on_a_cpu_unless_asked(compile_allowed, monkeypatch):
    choice = resolve_compile("auto", torch.device("cpu"))
    assert not choice.on and "tens of seconds" in choice.reason
    if not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("LANTERN_COMPILE", "1")
    choice = resolve_compile("auto", torch.device("cpu"))
    assert choice.on and choice.options == {} and choice.reason == "on (auto)"


def test_auto_compiles_on_a_gpu_with_triton(compile_allowed, monkeypatch):
    import torch.utils._triton as triton_utils

    monkeypatch.setattr(triton_utils, "has_triton", lambda: True)
    choice = resolve_compile("auto", torch.device("cuda"))
    assert choice.on and choice.options == {"mode": "reduce-overhead"}
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
    assert resolve_compile(False, cpu) == (None, "off (compile=False)")
    assert resolve_compile(True, cpu).options == {}
    assert resolve_compile(True, torch.device("cuda")).options == {"mode": "reduce-overhead"}
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
    eager = _mode(config, sampling, 16, plans, False, None)
    assert _mode(config, sampling, 16, plans, False, {}) != eager  # inductor
    assert _mode(config, sampling, 16, plans, False, {"mode": "reduce-overhead"}) != _mode(
        config, sampling, 16, plans, False, {})


@pytest.mark.slow  # torch.compile: 10-40 s of CPU
@torch.no_grad()
def test_calibration_times_the_compiled_forwards(monkeypatch, tmp_path):
    """A compiled run's cost model is measured through the compiled forwards (the calibration makes the
    compiled wrappers and their graphs; an eager calibration makes none), so the run then compiles nothing
    new at the shapes it calibrated."""
    from lantern.decoding import resolve_cost_model

    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path))
    labels, kw = torch.tensor([0, 1]), dict(method="spec", depth=3)
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
    assert not resolve_compile("auto", torch.device("cpu")).on
    monkeypatch.setattr(compile_choice.shutil, "which", lambda name: None)
    assert not baseline_compile(torch.device("cpu"))
    monkeypatch.undo()
    monkeypatch.setenv("LANTERN_COMPILE", "0")
    assert not baseline_compile(torch.device("cpu"))
