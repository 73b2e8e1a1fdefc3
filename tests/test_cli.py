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
