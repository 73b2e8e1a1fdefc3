"""``lantern generate --hf DIR --prompt TEXT``: a tiny random Janus saved with a tiny tokenizer and processor built
in-process (no download) loads from its directory; the grid and the JSON are written, and the greedy codes equal
lantern.generate's on the processor's prompts. Bad input is named before any model is loaded."""
import json

import pytest
import torch
from PIL import Image

import lantern
from hf_models import model, tiny_processor, wrap
from lantern.cli import main


def test_generate_hf_writes_the_grid_and_the_codes(janus_dir, tmp_path):
    out, figures = tmp_path / "grid.png", tmp_path / "run.json"
    prompts = ["a red cat", "dog"]
    assert main(["generate", "--hf", str(janus_dir), "--prompt", *prompts, "--method", "sjd", "--tree", "chain",
                 "--window", "4", "--temperature", "0", "--per-class", "2", "--device", "cpu", "--dtype", "float32",
                 "--out", str(out), "--json", str(figures)]) == 0
    run = json.loads(figures.read_text())
    assert run["model"] == "JanusForConditionalGeneration" and run["images"] == 4 and run["codes_per_image"] == 16
    grid = Image.open(out)
    side = 8 * (128 // 8)  # the tiny VQ decodes 4 x 4 codes to 8 x 8 pixels, upscaled to 128
    assert grid.size == (2 * side, 2 * side)  # two prompts (rows) x two images (columns)
    processor = tiny_processor()
    enc = processor(text=[p for p in prompts for _ in range(2)], generation_mode="image", return_tensors="pt",
                    padding=True)
    expected, _ = lantern.generate(wrap(model("janus", torch.float32)), enc["input_ids"],
                                   attention_mask=enc["attention_mask"], method="ar", cfg_scale=5.0, temperature=0)
    assert run["codes"] == expected.tolist()


@pytest.mark.parametrize("argv,match", [
    (["--prompt", "a cat"], "not a directory"),
    ([], "--prompt"),
    (["--prompt", "a cat", "--out", "grid.txt"], "--out"),
])
def test_bad_hf_arguments_are_named(janus_dir, tmp_path, argv, match):
    hf = str(tmp_path / "missing") if match == "not a directory" else str(janus_dir)
    with pytest.raises(SystemExit, match=match):
        main(["generate", "--hf", hf, "--device", "cpu", *argv])
