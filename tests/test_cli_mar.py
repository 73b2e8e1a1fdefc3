"""`lantern generate` with MAR models: official-layout files (small random ones here) write the grid and
the JSON; --batch does not change the picture; --model tiny-mar says how to train the weights while they
are missing, and samples them once they are there."""
import json
import subprocess
import sys

import pytest
import torch
from PIL import Image

import lantern.tiny_mar
from lantern.cli import main
from lantern.decoding.mar import tokens_per_step
from lantern.models import build_mar, build_vae


def lantern_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "lantern", *args], capture_output=True, text=True, timeout=timeout,
                          check=True).stdout


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("mar")
    torch.manual_seed(0)
    torch.save({"model": build_mar("MAR-tiny-drafter").state_dict(),
                "model_ema": build_mar("MAR-tiny-drafter").state_dict()}, d / "checkpoint-last.pth")
    torch.save({"model": build_vae("KL-tiny").state_dict()}, d / "kl.ckpt")
    return d


def _args(files, out, *extra):
    return ["generate", "--model", "mar-checkpoint", "--mar", str(files / "checkpoint-last.pth"), "--mar-name",
            "MAR-tiny-drafter", "--vae", str(files / "kl.ckpt"), "--vae-name", "KL-tiny", "--num-iter", "3",
            "--num-sampling-steps", "4", "--classes", "0", "5", "--per-class", "2", "--seed", "3", "--out", str(out),
            "--no-progress", *extra]


def test_mar_checkpoint_writes_grid_and_figures(files, tmp_path):
    js = tmp_path / "run.json"
    stdout = lantern_cli(*_args(files, tmp_path / "a.png", "--json", str(js)))
    assert "tokens/s" in stdout and "diffusion head" in stdout
    figures = json.loads(js.read_text())
    assert figures["family"] == "mar" and figures["images"] == 4 and figures["num_iter"] == 3
    assert figures["diffusion_steps"] == 4 and figures["transformer_s"] > 0 and figures["head_s"] > 0
    with Image.open(tmp_path / "a.png") as picture:  # 2 rows x 2 columns of 32 px tiles, upscaled x4
        assert picture.size == (256, 256)
    lantern_cli(*_args(files, tmp_path / "b.png", "--batch", "3"))
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_mar_rejects_discrete_options(files, tmp_path):
    with pytest.raises(SystemExit, match="continuous speculative"):
        main(_args(files, tmp_path / "c.png", "--method", "lantern"))
    with pytest.raises(SystemExit, match="top-k"):
        main(_args(files, tmp_path / "c.png", "--top-k", "10"))
    with pytest.raises(SystemExit, match="--vae PATH"):
        main(["generate", "--model", "mar-checkpoint", "--mar", str(files / "checkpoint-last.pth")])


def test_tiny_mar_missing_weights_say_how_to_train(tmp_path, monkeypatch):
    monkeypatch.setattr(lantern.tiny_mar, "TINY_MAR_DIR", tmp_path / "absent")
    with pytest.raises(SystemExit, match="python -m lantern.tiny_mar.train"):
        main(["generate", "--model", "tiny-mar", "--out", str(tmp_path / "x.png"), "--no-progress"])


@pytest.mark.skipif(not (lantern.tiny_mar.TINY_MAR_DIR / lantern.tiny_mar.META_FILE).exists(),
                    reason="the tiny MAR weights are not trained yet (python -m lantern.tiny_mar.train)")
def test_tiny_mar_generates(tmp_path):
    js = tmp_path / "run.json"
    stdout = lantern_cli("generate", "--model", "tiny-mar", "--classes", "2", "--per-class", "2", "--num-iter", "4",
                         "--out", str(tmp_path / "t.png"), "--json", str(js), "--no-progress")
    assert "classifier accuracy" in stdout
    assert 0.0 <= json.loads(js.read_text())["class_accuracy"] <= 1.0


def _cspd_args(files, out, *extra):
    return _args(files, out, "--method", "cspd", "--mar-drafter", str(files / "checkpoint-last.pth"),
                 "--mar-drafter-name", "MAR-tiny-drafter", *extra)


def test_cspd_writes_its_figures_and_the_target_only_baseline(files, tmp_path):
    js = tmp_path / "cspd.json"
    stdout = lantern_cli(*_cspd_args(files, tmp_path / "a.png", "--gamma", "2", "--num-iter", "6", "--json", str(js)))
    assert "acceptance" in stdout and "capped fallbacks" in stdout and "speed-up vs target-only MAR" in stdout
    f = json.loads(js.read_text())
    assert f["method"] == "cspd" and f["gamma"] == 2 and f["rule"] == "exact" and f["last_step_noise"] is True
    assert 0.0 <= f["acceptance"] <= 1.0 and f["residual_fallbacks"] == 0
    assert f["drafted"] == 4 * (64 - tokens_per_step(64, 6)[0])  # pre-fill: ceil(0.05 * 6) = 1 step
    assert f["tau"] == pytest.approx(64 / (1 + 3)) and f["speedup_vs_ar"] == pytest.approx(f["ar_wall_s"] / f["wall_s"])
    assert f["target_forwards"] == 4 and f["drafter_forwards"] == 5 and f["verify_s"] > 0
    lantern_cli(*_cspd_args(files, tmp_path / "b.png", "--gamma", "2", "--num-iter", "6", "--batch", "3",
                            "--no-ar-baseline"))
    assert (tmp_path / "a.png").read_bytes() == (tmp_path / "b.png").read_bytes()


def test_cspd_options_are_checked(files, tmp_path):
    with pytest.raises(SystemExit, match="--gamma applies to --method cspd"):
        main(_args(files, tmp_path / "c.png", "--gamma", "4"))
    with pytest.raises(SystemExit, match="--mar-drafter PATH"):
        main(_args(files, tmp_path / "c.png", "--method", "cspd"))
    with pytest.raises(SystemExit, match="bandwidth"):
        main(_cspd_args(files, tmp_path / "c.png", "--bandwidth", "42"))
    with pytest.raises(SystemExit, match="gamma"):
        main(_cspd_args(files, tmp_path / "c.png", "--gamma", "0"))
    with pytest.raises(SystemExit, match="MAR models"):
        main(["generate", "--model", "tiny", "--method", "cspd", "--out", str(tmp_path / "c.png")])
    with pytest.raises(SystemExit, match="--rule does not apply to --model tiny"):
        main(["generate", "--model", "tiny", "--rule", "paper", "--out", str(tmp_path / "c.png")])


@pytest.mark.skipif(not (lantern.tiny_mar.TINY_MAR_DIR / lantern.tiny_mar.META_FILE).exists(),
                    reason="the tiny MAR weights are not trained yet (python -m lantern.tiny_mar.train)")
def test_tiny_mar_cspd_generates(tmp_path):
    js = tmp_path / "run.json"
    stdout = lantern_cli("generate", "--model", "tiny-mar", "--method", "cspd", "--classes", "2", "--per-class", "2",
                         "--num-iter", "8", "--gamma", "4", "--out", str(tmp_path / "t.png"), "--json", str(js),
                         "--no-progress")
    assert "classifier accuracy" in stdout
    f = json.loads(js.read_text())
    keys = ("speedup_vs_ar", "acceptance", "residual_fallbacks", "tau", "class_accuracy", "fd", "ar_class_accuracy")
    for key in keys:
        assert key in f


@pytest.fixture
def no_loading(monkeypatch):
    """Loading a model fails the test: a refusal must come before it."""
    from lantern import sources

    for loader in ("load_discrete", "load_mar_models"):
        monkeypatch.setattr(sources, loader, lambda args: pytest.fail("a model was loaded"))


@pytest.mark.parametrize("option", [
    ["--compile"], ["--dtype", "bfloat16"], ["--lam", "2"], ["--tree", "chain"], ["--nodes", "4"], ["--depth", "3"],
    ["--k", "5"], ["--draft", "sampled"], ["--budget", "node"], ["--delta", "0.2"], ["--window", "3"],
    ["--coupling"], ["--init", "sample"], ["--top-p", "0.9"], ["--cfg-interval", "3"], ["--top-k", "10"],
])
@pytest.mark.parametrize("method", ["ar", "cspd"])
def test_mar_refuses_discrete_only_flags_before_loading(no_loading, tmp_path, option, method):
    with pytest.raises(SystemExit, match=f"{option[0]} does not apply to MAR models"):
        main(["generate", "--model", "tiny-mar", "--method", method, "--out", str(tmp_path / "m.png"), *option])


@pytest.mark.parametrize("option,message", [
    (["--num-iter", "0"], r"--num-iter must be an int >= 1"), (["--num-iter", "-5"], "--num-iter"),
    (["--temperature", "nan"], "--temperature"), (["--temperature", "inf"], "--temperature"),
    (["--temperature", "0"], r"--temperature must be a number in \(0, 1000\]"), (["--cfg-scale", "nan"], "--cfg-scale"),
    (["--cfg-scale", "inf"], "--cfg-scale"), (["--cfg-scale=-1e4"], "--cfg-scale"), (["--seed", "-1"], "--seed"),
    (["--seed", str(2**64)], "--seed"), (["--no-ar-baseline"], "--no-ar-baseline applies to --method cspd only"),
    (["--method", "lantern"], "--method must be 'ar'"), (["--method", "sjd"], "--method must be 'ar'"),
])
def test_mar_settings_are_checked_before_loading(no_loading, tmp_path, option, message):
    with pytest.raises(SystemExit, match=message):
        main(["generate", "--model", "tiny-mar", "--out", str(tmp_path / "m.png"), *option])


@pytest.mark.parametrize("steps", ["abc", "0", "-3", "5000"])
def test_mar_sampling_steps_are_checked_before_loading(no_loading, tmp_path, steps):
    with pytest.raises(SystemExit, match=r"--num-sampling-steps must be an int in \[1, 1000\]"):
        main(["generate", "--model", "mar-checkpoint", "--mar", "m.pth", "--vae", "v.ckpt", "--num-sampling-steps",
              steps, "--out", str(tmp_path / "m.png")])


def test_mar_steps_and_blocks_beyond_the_image_are_refused_before_sampling(files, tmp_path, monkeypatch):
    from lantern.cli import generate_mar

    monkeypatch.setattr(generate_mar, "_sample", lambda *a, **k: pytest.fail("sampled"))
    with pytest.raises(SystemExit, match="--num-iter must be at most the image's 64 tokens"):
        main(_args(files, tmp_path / "c.png", "--num-iter", "65"))
    with pytest.raises(SystemExit, match="--gamma must be at most the image's 64 tokens"):
        main(_cspd_args(files, tmp_path / "c.png", "--gamma", "65"))
