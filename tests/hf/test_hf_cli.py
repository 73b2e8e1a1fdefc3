"""``lantern generate --hf DIR --prompt TEXT``: a tiny random Janus saved with a tiny tokenizer and processor built
in-process (no download) loads from its directory; the grid and the JSON are written, and the greedy codes equal
lantern.generate's on the processor's prompts. Bad input is named before any model is loaded."""
import json

import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, JanusImageProcessor, JanusProcessor, PreTrainedTokenizerFast

import lantern
from hf_models import JANUS_BOI, model, wrap
from lantern.cli import main

WORDS = ["a", "red", "cat", "on", "blue", "mat", "dog"]
JANUS_BOI_TOKEN = "<begin_of_image>"


def tiny_processor():
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<end_of_image>": 61, JANUS_BOI_TOKEN: JANUS_BOI,
             "<image_placeholder>": 63, **{w: 3 + i for i, w in enumerate(WORDS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   extra_special_tokens={"image_token": "<image_placeholder>",
                                                         "boi_token": JANUS_BOI_TOKEN, "eoi_token": "<end_of_image>"})
    return JanusProcessor(image_processor=JanusImageProcessor(), tokenizer=fast, num_image_tokens=16)



@pytest.fixture(scope="module")
def janus_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("janus")
    m = model("janus", torch.float32)
    m.generation_config = GenerationConfig(bos_token_id=1, pad_token_id=0,
                                           generation_kwargs={"boi_token_id": JANUS_BOI})
    m.save_pretrained(directory)
    tiny_processor().save_pretrained(directory)
    return directory


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
