"""The command line end to end on the shipped tiny model (small runs: a few images)."""
import json
import subprocess
import sys

import pytest
from PIL import Image

from lantern.pretrained import TINY_DIR


def lantern_cli(*args, timeout=600):
    return subprocess.run([sys.executable, "-m", "lantern", *args], capture_output=True, text=True, timeout=timeout,
                          check=True).stdout


def test_generate_ar_writes_grid_and_figures(tmp_path):
    out, js = tmp_path / "grid.png", tmp_path / "run.json"
    stdout = lantern_cli("generate", "--classes", "0", "7", "--per-class", "2", "--seed", "3", "--out", str(out),
                         "--json", str(js), "--no-progress")
    assert "tokens/s" in stdout and "classifier accuracy" in stdout
    figures = json.loads(js.read_text())
    assert figures["images"] == 4 and figures["tokens_per_s"] > 0
    assert 0.0 <= figures["class_accuracy"] <= 1.0 and figures["fd"] >= 0
    with Image.open(out) as picture:  # 2 rows (classes) x 2 columns, upscaled 32 px tiles
        assert picture.size[0] == picture.size[1] and picture.size[0] >= 64


def test_same_seed_same_picture(tmp_path):
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    for path in (a, b):
        lantern_cli("generate", "--classes", "4", "--per-class", "1", "--seed", "9", "--out", str(path), "--no-progress")
    assert a.read_bytes() == b.read_bytes()


def test_generate_lantern_reports_speculative_figures(tmp_path):
    js = tmp_path / "run.json"
    stdout = lantern_cli("generate", "--method", "lantern", "--classes", "1", "--per-class", "2", "--k", "100",
                         "--delta", "0.1", "--tree", "dynamic", "--depth", "3", "--nodes", "16", "--out",
                         str(tmp_path / "g.png"), "--json", str(js), "--no-progress")
    assert "tau" in stdout and "speed-up vs AR" in stdout
    figures = json.loads(js.read_text())
    for key in ("tau", "target_forwards", "draft_forwards", "wall_s", "speedup_vs_ar", "class_accuracy", "fd"):
        assert key in figures
    assert figures["tau"] >= 1.0 and figures["target_forwards"] <= 64


@pytest.mark.parametrize("extra", [[], ["--coupling", "--delta", "0.2", "--k", "100"]], ids=["exact", "coupled-relaxed"])
def test_generate_sjd_needs_no_drafter(tmp_path, extra):
    js = tmp_path / "run.json"
    stdout = lantern_cli("generate", "--method", "sjd", "--tree", "chain", "--window", "4", "--classes", "1",
                         "--per-class", "2", *extra, "--out", str(tmp_path / "g.png"), "--json", str(js),
                         "--no-progress")
    assert "tau" in stdout and "speed-up vs AR" in stdout
    figures = json.loads(js.read_text())
    assert figures["method"] == "sjd" and figures["draft_forwards"] == 0
    assert figures["delta"] == (0.2 if extra else 0.0)
    for key in ("tau", "speedup_vs_ar", "class_accuracy", "fd"):
        assert key in figures
    assert figures["tau"] >= 1.0


@pytest.mark.parametrize("args,message", [(["--method", "sjd", "--tree", "static"], "--tree"),
                                          (["--method", "lantern", "--window", "4"], "--window"),
                                          (["--method", "spec", "--coupling"], "--coupling")])
def test_sjd_options_are_checked(tmp_path, args, message):
    result = subprocess.run([sys.executable, "-m", "lantern", "generate", *args, "--out", str(tmp_path / "g.png"),
                             "--no-progress"], capture_output=True, text=True, timeout=600)
    assert result.returncode != 0 and message in result.stderr


def test_help_explains_the_options():
    text = lantern_cli("generate", "--help")
    for option in ("--method", "--delta", "--k", "--tree", "--cfg-scale", "--top-k", "--json", "--out"):
        assert option in text


@pytest.fixture
def stub_gpt(monkeypatch):
    """generate_cli's loader replaced by a small random GPT (5 classes, V 64) and a VQ stub over a random
    codebook; ``loads`` counts the loads, so a test can tell whether an error came before any."""
    from types import SimpleNamespace

    import torch

    from lantern import generate_cli
    from models.gpt_testing import small_gpt

    loads = []
    gpt = small_gpt(0)
    codebook = torch.randn(64, 4, generator=torch.Generator().manual_seed(0))
    vq = SimpleNamespace(quantize=SimpleNamespace(embedding=SimpleNamespace(weight=codebook)),
                         decode_codes=lambda tokens, h, w: torch.zeros(tokens.shape[0], 3, 4 * h, 4 * w),
                         to_uint8=lambda images: images.permute(0, 2, 3, 1).to(torch.uint8))

    def load(args):
        loads.append(args.model)
        return gpt, vq, {"sampling": {"cfg_scale": 1.0}}

    monkeypatch.setattr(generate_cli, "_load", load)
    return loads


def generate_stub(tmp_path, *extra):
    from lantern.cli import main

    return main(["generate", "--model", "checkpoint", "--classes", "1", "--per-class", "1", "--no-progress",
                 "--out", str(tmp_path / "g.png"), *extra])


@pytest.mark.parametrize("args,message", [
    (["--method", "ar", "--tree", "chain"], "--tree does not apply to --method ar"),
    (["--method", "ar", "--depth", "3"], "--depth does not apply to --method ar"),
    (["--method", "ar", "--k", "5"], "--k does not apply to --method ar"),
    (["--method", "ar", "--lam", "2"], "--lam does not apply to --method ar"),
    (["--method", "spec", "--k", "5"], "--k applies to relaxed acceptance"),
    (["--method", "spec", "--delta", "0.2"], "--delta applies to relaxed acceptance"),
    (["--method", "spec", "--lam", "2"], "--lam applies to relaxed acceptance"),
    (["--method", "spec", "--budget", "node"], "--budget applies to relaxed acceptance"),
    (["--method", "sjd", "--k", "5"], "--k applies to relaxed acceptance; --method sjd relaxes only with --delta"),
    (["--method", "sjd", "--depth", "3"], "--depth does not apply to --method sjd"),
    (["--method", "sjd", "--nodes", "3"], "--nodes does not apply to --method sjd"),
    (["--method", "lantern", "--tree", "chain", "--nodes", "4"], "--nodes applies to --tree dynamic"),
    (["--method", "lantern", "--tree", "static", "--depth", "3"], "--depth does not apply to --tree static"),
    (["--method", "lantern", "--lam", "2", "--budget", "node"], "--budget 'node' applies to delta mode"),
    (["--method", "lantern", "--gamma", "2"], "--gamma does not apply to --model checkpoint"),
])
def test_options_of_other_methods_and_trees_are_refused_before_loading(stub_gpt, tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        generate_stub(tmp_path, *args)
    assert stub_gpt == []


def test_the_ar_baseline_flag_is_for_speculative_methods(stub_gpt, tmp_path):
    from lantern.cli import main

    with pytest.raises(SystemExit, match="--no-ar-baseline does not apply to --method ar"):
        main(["generate", "--method", "ar", "--no-ar-baseline", "--out", str(tmp_path / "g.png")])
    assert stub_gpt == []


@pytest.mark.parametrize("args,message", [
    (["--temperature", "nan"], "--temperature"), (["--temperature", "-1"], "--temperature"),
    (["--cfg-scale", "inf"], "--cfg-scale"), (["--top-p", "2"], r"--top-p must be in \(0, 1\]"),
    (["--top-k", "-1"], "--top-k"), (["--seed", "-1"], "--seed"), (["--seed", str(2**64)], "--seed"),
    (["--cfg-interval", "-2"], "--cfg-interval"),
    (["--delta", "2"], r"--delta must be a total-variation budget in \[0, 1\]"), (["--lam", "0.5"], "--lam"),
    (["--depth", "5000"], r"--depth must be an int in \[1, 1023\]"), (["--window", "5000"], "--window"),
    (["--per-class", "5000"], "--per-class must be >= 1 and at most 1024"), (["--k", "-1"], "--k must be an int >= 0"),
])
def test_numeric_options_are_bounded_before_loading(stub_gpt, tmp_path, args, message):
    with pytest.raises(SystemExit, match=message):
        generate_stub(tmp_path, "--method", "lantern", *args)
    assert stub_gpt == []


def test_k_beyond_the_codebook_is_refused_before_the_table_is_built(stub_gpt, tmp_path, monkeypatch):
    import lantern.neighbours

    monkeypatch.setattr(lantern.neighbours, "neighbour_table", lambda *a, **k: pytest.fail("table built"))
    with pytest.raises(SystemExit, match="--k must be at most the codebook's 64 codes"):
        generate_stub(tmp_path, "--method", "sjd", "--tree", "chain", "--delta", "0.1", "--k", "65")


def test_options_at_the_commands_defaults_and_relaxed_sjd_run(stub_gpt, tmp_path):
    assert generate_stub(tmp_path, "--method", "ar", "--tree", "auto", "--depth", "5", "--nodes", "58",
                         "--window", "8") == 0
    assert generate_stub(tmp_path, "--method", "sjd", "--tree", "chain", "--window", "2", "--delta", "0.1",
                         "--k", "4") == 0
    assert stub_gpt == ["checkpoint", "checkpoint"]
