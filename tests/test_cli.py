"""The command line end to end on the shipped tiny model (small runs: a few images)."""
import json
import math
import subprocess
import sys

import pytest
import torch
from PIL import Image

from lantern.cli import main


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
        lantern_cli("generate", "--classes", "4", "--per-class", "1", "--seed", "9", "--out", str(path),
                    "--no-progress")
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


@pytest.mark.parametrize("extra", [[], ["--coupling", "--delta", "0.2", "--k", "100"]],
                         ids=["exact", "coupled-relaxed"])
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
def test_sjd_options_are_checked(tmp_path, capsys, args, message):
    """In this process (test_help_explains_the_options runs the command itself): the exit status and the message
    the command would print."""
    with pytest.raises(SystemExit) as exit:
        main(["generate", *args, "--out", str(tmp_path / "g.png"), "--no-progress"])
    assert exit.value.code not in (0, None) and message in f"{exit.value.code}\n{capsys.readouterr().err}"


def test_help_explains_the_options():
    text = lantern_cli("generate", "--help")
    for option in ("--method", "--delta", "--k", "--tree", "--cfg-scale", "--top-k", "--json", "--out"):
        assert option in text


@pytest.fixture
def stub_gpt(monkeypatch):
    """The discrete models' loader (``lantern.sources.load_discrete``) replaced by a small random GPT (5 classes,
    V 64) and a VQ stub over a random codebook; ``loads`` counts the loads, so a test can tell whether an error
    came before any."""
    from types import SimpleNamespace

    import torch

    from lantern import sources
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

    monkeypatch.setattr(sources, "load_discrete", load)
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


# -- lantern generate: classes, outputs, options of other models, JSON ---------------------------------------------

class StubVQ:
    """decode_codes / to_uint8 of a VQ, enough for the CLI to write its grid."""

    def decode_codes(self, tokens, h, w):
        return torch.zeros(tokens.shape[0], 3, 4 * h, 4 * w)

    def to_uint8(self, images):
        return images.permute(0, 2, 3, 1).to(torch.uint8)  # [B, H, W, 3]


@pytest.fixture
def stub_models(monkeypatch):
    """The discrete models' loader (``lantern.sources.load_discrete``) replaced: a small random 10-class GPT (like
    the tiny model's classes) and a stub VQ; ``loads`` counts the loads, so a test can tell an error came before
    any model was loaded."""
    from lantern import sources
    from models.gpt_testing import small_gpt

    loads = []
    gpt = small_gpt(0, num_classes=10)

    def load(args):
        loads.append(args.model)
        return gpt, StubVQ(), {"sampling": {"cfg_scale": 1.0}}

    monkeypatch.setattr(sources, "load_discrete", load)
    return loads


def generate_tiny_classes(tmp_path, *extra):
    return main(["generate", "--per-class", "1", "--no-progress", "--out", str(tmp_path / "g.png"), *extra])


def test_classes_outside_the_model_fail_before_sampling(stub_models, tmp_path, monkeypatch):
    import lantern.decoding

    monkeypatch.setattr(lantern.decoding, "generate_ar", lambda *a, **k: pytest.fail("sampled"))
    with pytest.raises(SystemExit, match=r"--classes must be class ids in \[0, 10\).*got \[10\]"):
        generate_tiny_classes(tmp_path, "--classes", "3", "10")
    with pytest.raises(SystemExit, match=r"--classes .*got \[-1\]"):
        generate_tiny_classes(tmp_path, "--classes", "-1")


def test_mar_classes_outside_the_model_fail_before_sampling(tmp_path, monkeypatch):
    from lantern import sources
    from lantern.cli import generate_mar
    from lantern.models import build_mar

    torch.manual_seed(0)
    mar = build_mar("MAR-tiny-drafter").eval()
    defaults = dict(cfg=1.0, cfg_schedule="linear", num_iter=2, temperature=1.0)
    monkeypatch.setattr(sources, "load_mar_models", lambda args: (mar, None, None, defaults, [0]))
    monkeypatch.setattr(generate_mar, "_sample", lambda *a, **k: pytest.fail("sampled"))
    with pytest.raises(SystemExit, match=r"--classes must be class ids in \[0, 10\)"):
        main(["generate", "--model", "tiny-mar", "--classes", "10", "--out", str(tmp_path / "m.png"), "--no-progress"])


def bad_outputs(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_folder.png").mkdir()
    return [
        ("--out", str(tmp_path / "missing" / "g.png"), "does not exist"),
        ("--out", str(tmp_path / "a_file" / "g.png"), "does not exist"),
        ("--out", "/proc/lantern-hardening.png", "cannot be written"),  # no new files in /proc, even for root
        ("--out", str(tmp_path / "grid"), "must name an image file"),
        ("--out", str(tmp_path / "grid.txt"), "must name an image file"),
        ("--out", str(tmp_path / "a_folder.png"), "is a folder"),
        ("--json", str(tmp_path / "missing" / "run.json"), "does not exist"),
        ("--json", "/proc/lantern-hardening.json", "cannot be written"),
        ("--json", str(tmp_path / "run"), "must name a JSON file"),
        ("--json", str(tmp_path / "g.png"), "must name a JSON file"),
    ]


@pytest.mark.parametrize("model", ["tiny", "checkpoint", "tiny-mar"])
def test_unwritable_outputs_fail_before_loading(stub_models, tmp_path, model):
    for flag, path, message in bad_outputs(tmp_path):
        argv = ["generate", "--model", model, "--no-progress", "--out", str(tmp_path / "g.png"), flag, path]
        with pytest.raises(SystemExit, match=message):
            main(argv)
    assert stub_models == []  # nothing was loaded, let alone sampled
    assert not (tmp_path / "missing").exists() and not (tmp_path / "grid").exists()


@pytest.mark.skipif(hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0,
                    reason="root writes into read-only folders")
def test_read_only_output_folder_fails_before_loading(stub_models, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(SystemExit, match="cannot be written"):
        generate_tiny_classes(tmp_path, "--out", str(locked / "g.png"))
    assert stub_models == []


def test_demo_json_fails_before_running(tmp_path, monkeypatch):
    import lantern.demo

    monkeypatch.setattr(lantern.demo, "run_demo", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit, match="does not exist"):
        main(["demo", "--json", str(tmp_path / "missing" / "d.json")])
    with pytest.raises(SystemExit, match="must name a JSON file"):
        main(["demo", "--json", str(tmp_path / "d.txt")])


@pytest.mark.parametrize("model,option", [
    ("tiny", ["--image-size", "512"]), ("tiny", ["--gpt-name", "GPT-B"]), ("tiny", ["--num-iter", "4"]),
    ("tiny", ["--vae", "kl.ckpt"]), ("checkpoint", ["--mar-name", "MAR-L"]),
    ("checkpoint", ["--cfg-schedule", "linear"]), ("tiny-mar", ["--image-size", "384"]),
    ("tiny-mar", ["--num-sampling-steps", "10"]), ("tiny-mar", ["--vq", "vq.pt"]),
    ("mar-checkpoint", ["--gpt", "gpt.pt"]),
])
def test_options_of_other_models_are_rejected(stub_models, tmp_path, model, option):
    with pytest.raises(SystemExit, match=f"{option[0]} does not apply to --model {model}"):
        generate_tiny_classes(tmp_path, "--model", model, *option)
    assert stub_models == []


def test_options_of_the_chosen_model_still_run(stub_models, tmp_path):
    assert generate_tiny_classes(tmp_path, "--model", "checkpoint", "--image-size", "384", "--gpt-name", "GPT-B",
                    "--classes", "1") == 0
    assert stub_models == ["checkpoint"] and (tmp_path / "g.png").exists()


def test_json_of_one_image_is_valid_json_with_null(stub_models, tmp_path, monkeypatch):
    import json

    import lantern.tiny.evaluate

    nan = float("nan")
    monkeypatch.setattr(lantern.tiny.evaluate, "evaluate_samples",  # what it returns for one image
                        lambda images, labels: dict(class_accuracy=1.0, n=1, fd=nan,
                                                    per_class_accuracy=[1.0] + [nan] * 9))
    js = tmp_path / "run.json"
    assert generate_tiny_classes(tmp_path, "--classes", "0", "--json", str(js)) == 0
    text = js.read_text()
    assert "NaN" not in text and "Infinity" not in text
    figures = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert figures["fd"] is None and figures["per_class_accuracy"] == [1.0] + [None] * 9
    assert figures["class_accuracy"] == 1.0 and math.isfinite(figures["wall_s"])


def test_write_json_replaces_every_non_finite_float(tmp_path):
    import json

    from lantern.outputs import write_json

    path = tmp_path / "x.json"
    write_json(str(path), {"a": float("inf"), "b": [1.5, float("-inf"), {"c": float("nan")}], "d": (2, "s")})
    assert json.loads(path.read_text()) == {"a": None, "b": [1.5, None, {"c": None}], "d": [2, "s"]}


@pytest.mark.parametrize("option,message", [
    (["--nodes", "0"], "--nodes must be >= 1"), (["--depth", "0"], "--depth must be >= 1"),
    (["--depth", "-3"], "--depth must be >= 1"), (["--per-class", "0"], "--per-class must be >= 1"),
    (["--tree", "dynamic", "--draft", "sampled"], "--draft sampled does not apply to --tree dynamic"),
])
def test_spec_options_fail_before_loading(stub_models, tmp_path, option, message):
    with pytest.raises(SystemExit, match=message):
        generate_tiny_classes(tmp_path, "--method", "lantern", *option)
    assert stub_models == []


# -- lantern demo --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flag,value,message", [("--rows", "0", r"rows \(--rows\) must be an int >= 1"),
                                                ("--vocab", "1", r"vocab \(--vocab\) must be an int >= 2"),
                                                ("--k", "-1", r"neighbours \(--k\) must be an int in")])
def test_demo_rejects_empty_settings(flag, value, message):
    with pytest.raises(ValueError, match=message):
        main(["demo", flag, value, "--vocab" if flag != "--vocab" else "--rows", "16" if flag != "--vocab" else "2"])



# -- lantern neighbours --out: checked before the codebook is loaded -----------------------------------------------

@pytest.fixture
def stub_codebook(monkeypatch, tmp_path):
    """``lantern neighbours --vq tiny`` with a small random codebook instead of the shipped model's; ``loads``
    counts the loads, so a test can tell an error came before any."""
    from types import SimpleNamespace

    import lantern.pretrained

    loads = []
    codebook = torch.randn(24, 4, generator=torch.Generator().manual_seed(5))
    embedding = SimpleNamespace(weight=codebook)

    def load_tiny():
        loads.append("tiny")
        return SimpleNamespace(vq=SimpleNamespace(quantize=SimpleNamespace(embedding=embedding)))

    monkeypatch.setattr(lantern.pretrained, "load_tiny", load_tiny)
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    return loads


def test_neighbours_out_fails_before_loading(stub_codebook, tmp_path):
    (tmp_path / "a_folder.safetensors").mkdir()
    bad = [(str(tmp_path / "missing" / "n.safetensors"), "does not exist"),
           (str(tmp_path / "n.pt"), "must name a safetensors file"),
           (str(tmp_path / "n"), "must name a safetensors file"),
           (str(tmp_path / "a_folder.safetensors"), "is a folder"),
           ("/proc/lantern-hardening.safetensors", "cannot be written")]
    for path, message in bad:
        with pytest.raises(SystemExit, match=message):
            main(["neighbours", "--K", "4", "--out", path])
    with pytest.raises(SystemExit, match="--K must be >= 1"):
        main(["neighbours", "--K", "0"])
    assert stub_codebook == []  # nothing was loaded, no table built
    assert not (tmp_path / "missing").exists() and not (tmp_path / "cache").exists()


def test_neighbours_out_writes_the_table(stub_codebook, tmp_path):
    from safetensors.torch import load_file

    from lantern import ops

    out = tmp_path / "n.safetensors"
    assert main(["neighbours", "--K", "4", "--out", str(out)]) == 0
    codebook = torch.randn(24, 4, generator=torch.Generator().manual_seed(5))
    assert torch.equal(load_file(str(out))["neighbours"], ops.latent_neighbours(codebook, 4, normalize=True))
    assert stub_codebook == ["tiny"]


@pytest.mark.parametrize("plan_steps, says_all_ar", [({"ar": 63}, True), ({"chain3": 20, "ar": 3}, False)])
def test_the_printout_says_when_every_step_was_ar(capsys, plan_steps, says_all_ar):
    """A run that tree auto made AR throughout prints that its speed-up vs AR compares AR with AR."""
    import argparse

    from lantern.cli import generate as generate_cli

    figures = dict(images=10, tokens_per_image=64, wall_s=2.0, tokens_per_s=320.0, dtype="float32", tau=1.0,
                   target_forwards=64, draft_forwards=0, batch=10, plan_steps=plan_steps, speedup_vs_ar=1.08,
                   ar_compile="on (auto)", rounds=3, run_s=1.97, ar_s=2.13, ar_compile_s=0)
    generate_cli._print_figures(figures, argparse.Namespace(method="lantern", device="cpu", out="samples.png"))
    out = capsys.readouterr().out
    assert "speed-up vs AR (compiled" in out
    assert ("every step was AR" in out) == says_all_ar
