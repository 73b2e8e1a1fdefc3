"""lantern generate's speed-up against AR (python/lantern/cli/generate.py): measured in rounds after the image
run, each round timing the speculative run again and AR, in turn first, the speed-up a ratio of medians; --repeats
checked before any model is loaded. Small random models stand in for the tiny model (the loaders replaced)."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from lantern import ops, sources
from lantern.cli import generate as generate_cli
from tiny_random_models import StubVQ, small_models


def _run(tmp_path, monkeypatch, *flags):
    target, drafter = small_models()
    table = ops.latent_neighbours(torch.randn(64, 4, generator=torch.Generator().manual_seed(1)), 4)
    monkeypatch.setattr(sources, "load_discrete", lambda args: (target, StubVQ(), {"sampling": {"cfg_scale": 2.0}}))
    monkeypatch.setattr(sources, "drafter_and_table", lambda args, gpt, vq: (drafter, table))
    parser = argparse.ArgumentParser()
    generate_cli.add_generate_parser(parser.add_subparsers(dest="command"))
    js = tmp_path / "run.json"
    args = parser.parse_args(["generate", "--model", "checkpoint", "--classes", "1", "2", "--per-class", "1",
                              "--compile", "off", "--no-progress", "--out", str(tmp_path / "g.png"), "--json",
                              str(js), *flags])
    return generate_cli.run_generate(args), js


def test_rounds_alternate_the_rerun_and_ar_and_take_medians(tmp_path, monkeypatch, capsys):
    from lantern import decoding

    calls, times = [], iter([10.0, 11.0, 13.0, 15.0, 16.0, 17.0, 18.0, 24.0, 25.0, 26.0, 27.0, 28.0, 29.0, 31.0])
    generate, generate_ar = decoding.generate, decoding.generate_ar

    def counted(name, fn):
        def call(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return call

    monkeypatch.setattr(decoding, "generate", counted("spec", generate))
    monkeypatch.setattr(decoding, "generate_ar", counted("ar", generate_ar))
    monkeypatch.setattr(generate_cli, "_clock", lambda: next(times))
    code, js = _run(tmp_path, monkeypatch, "--method", "lantern", "--tree", "chain", "--depth", "2", "--k", "4",
                    "--repeats", "3")
    assert code == 0
    # the image run, then three rounds of the run again and AR, in turn first; AR eager here, so no eager AR
    assert calls == ["spec"] + ["spec", "ar"] + ["ar", "spec"] + ["spec", "ar"]
    figures = json.loads(js.read_text())
    # the clock: image run 10 -> 11; rounds (13 -> 15 run, 16 -> 17 AR), (18 -> 24 AR, 25 -> 26 run),
    # (27 -> 28 run, 29 -> 31 AR)
    assert figures["wall_s"] == 1.0 and figures["rounds"] == 3
    assert figures["run_s"] == 1.0 and figures["ar_s"] == 2.0  # medians of (2, 1, 1) and (1, 6, 2)
    assert figures["speedup_vs_ar"] == 2.0 and "speedup_vs_ar_eager" not in figures
    assert "speed-up vs AR (eager; median of 3 alternated rounds after the image run" in capsys.readouterr().out



def test_eager_ar_runs_after_the_rounds_when_ar_is_compiled(tmp_path, monkeypatch, capsys):
    """With AR compiled, eager AR is timed too, in runs of its own after the alternated rounds: a slow eager
    run leaves the caches cold for whatever runs next, so it must not precede either contender in a round."""
    from lantern import decoding
    from lantern.decoding import compiled

    calls = []
    generate, generate_ar = decoding.generate, decoding.generate_ar

    def spec(*args, **kwargs):
        calls.append("spec")
        return generate(*args, **kwargs)

    def ar(*args, compile=False, stats=None, **kwargs):  # "compiled" AR: eager underneath, its stats say on
        calls.append("ar" if compile else "eager")
        if stats is not None and compile:
            stats["compile"] = "on (test)"
        return generate_ar(*args, **kwargs)

    monkeypatch.setattr(decoding, "generate", spec)
    monkeypatch.setattr(decoding, "generate_ar", ar)
    monkeypatch.setattr(compiled, "baseline_compile", lambda device: "compiled")
    code, js = _run(tmp_path, monkeypatch, "--method", "lantern", "--tree", "chain", "--depth", "2", "--k", "4",
                    "--repeats", "2")
    assert code == 0
    assert calls == ["spec", "spec", "ar", "ar", "spec", "eager", "eager"]
    figures = json.loads(js.read_text())
    assert figures["ar_compile"] == "on (test)" and figures["speedup_vs_ar_eager"] > 0
    assert "speed-up vs eager AR" in capsys.readouterr().out


@pytest.mark.parametrize("flags,message", [
    (["--method", "lantern", "--repeats", "0"], "--repeats must be >= 1 and at most 100, got 0"),
    (["--method", "lantern", "--repeats", "101"], "--repeats must be >= 1 and at most 100, got 101"),
    (["--method", "ar", "--repeats", "2"], "--repeats applies to the speculative methods"),
    (["--method", "sjd", "--no-ar-baseline", "--repeats", "2"], "--repeats applies to the speculative methods"),
])
def test_repeats_is_checked_before_any_model_is_loaded(tmp_path, monkeypatch, flags, message):
    def no_load(args):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(sources, "load_discrete", no_load)
    parser = argparse.ArgumentParser()
    generate_cli.add_generate_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["generate", *flags, "--out", str(tmp_path / "g.png")])
    with pytest.raises(SystemExit, match=message):
        generate_cli.run_generate(args)
    assert not (tmp_path / "g.png").exists()
