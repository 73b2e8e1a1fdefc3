"""``lantern sample --hf DIR`` (and ``lantern.sample(..., hf=DIR)``) on the tiny random Janus and Emu3 saved as
model directories with tokenizers and processors built in-process (no download).

What the equality with ``lantern generate --hf`` / ``lantern.generate`` depends on: the same weights and dtype
(float32 here), the same prompts encoded by DIR's processor *in the same batch* (a block's prompts are padded
together, and a matrix product may round a row differently in a batch of another shape), the same seed and
image ids (generate's default ids are 0..B-1, a block's are its image ids), method options and thread count
(one, here and in lantern sample by default). Images are compared as the uint8 pixels of each image's codes
decoded one image at a time, which is what the folder holds; a negative control checks that another seed's
codes give other pixels."""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import lantern
from hf_models import EMU3_HW, model, tiny_emu3_processor, tiny_processor, wrap
from lantern.cli import main
from lantern.hf.cli import to_pixels

PROMPTS = ["a red cat", "dog", "blue mat on a mat"]
BASE = ["--device", "cpu", "--dtype", "float32", "--no-progress"]


def janus():
    return wrap(model("janus", torch.float32))


def pixels_of(target, codes: torch.Tensor) -> np.ndarray:
    """uint8 [B, h, w, 3]: each image's codes through the model's VQ decoder, one image at a time."""
    with torch.no_grad():
        return np.concatenate([to_pixels(target.decode_images(row[None])).numpy() for row in codes])


def block_codes(texts, ids, **options):
    """lantern.generate on one block: its prompts through the processor together, its image ids."""
    enc = tiny_processor()(text=texts, generation_mode="image", return_tensors="pt", padding=True)
    codes, _ = lantern.generate(janus(), enc["input_ids"], attention_mask=enc["attention_mask"],
                                image_ids=torch.tensor(ids), **options)
    return codes


def npz_images(out) -> np.ndarray:
    with np.load(os.path.join(out, "samples.npz")) as npz:
        return npz["arr_0"]


def test_sample_hf_images_are_generate_hf_codes_decoded(janus_dir, tmp_path):
    figures, out = tmp_path / "run.json", tmp_path / "samples"
    method = ["--method", "sjd", "--tree", "chain", "--window", "4", "--temperature", "1", "--seed", "3"]
    assert main(["generate", "--hf", str(janus_dir), "--prompt", *PROMPTS, *method, "--per-class", "1",
                 "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "grid.png"), "--json",
                 str(figures)]) == 0
    codes = torch.tensor(json.loads(figures.read_text())["codes"])
    assert main(["sample", str(out), "--hf", str(janus_dir), "--prompt", *PROMPTS, "--num-images", "3",
                 "--batch", "3", *method, *BASE]) == 0
    images = npz_images(out)
    assert images.shape == (3, 8, 8, 3) and sorted(os.listdir(out / "images")) == [f"{i:06d}.png" for i in range(3)]
    target = janus()
    assert np.array_equal(images, pixels_of(target, codes))
    other = block_codes(PROMPTS, [0, 1, 2], method="sjd", window=4, tree="chain", temperature=1.0, cfg_scale=5.0,
                        seed=4)
    assert not torch.equal(other, codes) and not np.array_equal(images, pixels_of(target, other))  # control
    config = json.loads((out / "config.json").read_text())
    assert config["hf"] == str(janus_dir) and config["prompts"] == PROMPTS and config["cfg_scale"] == 5.0
    assert config["model_class"] == "JanusForConditionalGeneration" and "transformers" in config["numerics"]


def test_sample_hf_emu3_images_are_generate_hf_codes_decoded(emu3_dir, emu3_generation_size, tmp_path):
    """Emu3: the processor's prompt ("H*W" image size), its forced row ends, guidance with --negative-prompt."""
    figures, out = tmp_path / "run.json", tmp_path / "samples"
    method = ["--method", "sjd", "--tree", "chain", "--window", "4", "--temperature", "1", "--seed", "3",
              "--negative-prompt", "blue mat"]
    assert main(["generate", "--hf", str(emu3_dir), "--prompt", *PROMPTS, *method, "--per-class", "1",
                 "--device", "cpu", "--dtype", "float32", "--out", str(tmp_path / "grid.png"), "--json",
                 str(figures)]) == 0
    run = json.loads(figures.read_text())
    assert run["model"] == "Emu3ForConditionalGeneration" and run["codes_per_image"] == EMU3_HW[0] * EMU3_HW[1]
    codes = torch.tensor(run["codes"])
    assert main(["sample", str(out), "--hf", str(emu3_dir), "--prompt", *PROMPTS, "--num-images", "3",
                 "--batch", "3", *method, *BASE]) == 0
    images = npz_images(out)
    target = wrap(model("emu3", torch.float32))
    assert images.shape == (3, 2 * EMU3_HW[0], 2 * EMU3_HW[1], 3)  # the tiny VQ decodes a code to 2 x 2 pixels
    assert np.array_equal(images, pixels_of(target, codes))
    # negative control: lantern.generate on the processor's prompts, another seed
    processor = tiny_emu3_processor()
    enc = processor(text=PROMPTS, return_for_image_generation=True, return_tensors="pt", padding=True)
    negative = processor.tokenizer(["blue mat"] * 3, return_tensors="pt", padding=True)
    options = dict(method="sjd", window=4, tree="chain", temperature=1.0, cfg_scale=3.0,
                   negative_prompt_ids=negative["input_ids"],
                   negative_prompt_attention_mask=negative["attention_mask"])
    same, _ = lantern.generate(target, enc["input_ids"], attention_mask=enc["attention_mask"], seed=3, **options)
    other, _ = lantern.generate(target, enc["input_ids"], attention_mask=enc["attention_mask"], seed=4, **options)
    assert torch.equal(same, codes)
    assert not torch.equal(other, codes) and not np.array_equal(images, pixels_of(target, other))
    config = json.loads((out / "config.json").read_text())
    assert config["hf"] == str(emu3_dir) and config["prompts"] == PROMPTS and config["cfg_scale"] == 3.0
    assert config["model_class"] == "Emu3ForConditionalGeneration" and config["image_codes"] == list(EMU3_HW)
    assert config["negative_prompt"] == "blue mat" and "tokenizer.json" in config["sha256"]


@pytest.fixture
def prompts_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text(f"{PROMPTS[0]}\n\n  {PROMPTS[1]}  \n{PROMPTS[2]}\n")  # blank lines skipped, spaces stripped
    return path


def lantern_run(out, janus_dir, prompts_file, **options):
    settings = dict(hf=janus_dir, prompts=prompts_file, batch=2, method="lantern", temperature=1.0, seed=5,
                    device="cpu", dtype="float32", no_progress=True)
    return lantern.sample(out, 4, **{**settings, **options})


def test_sample_hf_blocks_cycle_the_prompts_file_and_resume(janus_dir, prompts_file, tmp_path):
    out = tmp_path / "samples"
    lantern_run(out, janus_dir, prompts_file)
    images = npz_images(out)
    texts = [PROMPTS[i % 3] for i in range(4)]  # image i: prompt i mod 3
    options = dict(method="lantern", tree="chain", temperature=1.0, cfg_scale=5.0, seed=5)
    expected = np.concatenate([pixels_of(janus(), block_codes(texts[j:j + 2], [j, j + 1], **options))
                               for j in (0, 2)])
    assert np.array_equal(images, expected)
    config = json.loads((out / "config.json").read_text())
    assert config["prompts_file"] == str(prompts_file) and config["prompt_count"] == 3
    assert config["sha256"]["model.safetensors"] == lantern.sampling.digest(janus_dir / "model.safetensors")
    assert "tokenizer.json" in config["sha256"] and config["delta"] == 0.1

    with pytest.raises(SystemExit, match="already holds this run"):
        lantern_run(out, janus_dir, prompts_file)
    lantern_run(out, janus_dir, prompts_file, resume=True)  # complete: nothing to make
    run = json.loads((out / "runs" / "run-001.json").read_text())
    assert run["images_this_run"] == 0 and np.array_equal(npz_images(out), images)

    os.unlink(out / "shards" / "000001.npz")  # what a run killed during its second block leaves
    os.unlink(out / "samples.npz")
    lantern_run(out, janus_dir, prompts_file, resume=True)
    run = json.loads((out / "runs" / "run-002.json").read_text())
    assert run["images_this_run"] == 2 and np.array_equal(npz_images(out), images)

    prompts_file.write_text("dog\n")
    with pytest.raises(SystemExit, match="prompts_sha256"):
        lantern_run(out, janus_dir, prompts_file, resume=True)


def test_resume_with_other_weights_is_refused_naming_the_file(janus_dir, tmp_path):
    directory = tmp_path / "model"
    shutil.copytree(janus_dir, directory)
    out = tmp_path / "samples"
    argv = ["sample", str(out), "--hf", str(directory), "--prompt", "dog", "--num-images", "2", "--batch", "2",
            "--temperature", "0", *BASE]
    assert main(argv) == 0
    with open(directory / "config.json", "a") as f:
        f.write("\n")  # the same model, other bytes: the digest tells
    with pytest.raises(SystemExit, match=f"contents of {directory / 'config.json'}"):
        main([*argv, "--resume"])


@pytest.mark.parametrize("argv,match", [
    (["--classes", "3"], "--classes does not apply to --hf"),
    (["--gpt", "gpt.pt"], "--gpt does not apply to --hf"),
    (["--model", "checkpoint"], "--model does not apply with --hf"),
    (["--num-iter", "4"], "--num-iter does not apply to --hf"),
    (["--method", "cspd"], "cspd is for MAR models"),
    (["--method", "sjd", "--depth", "3"], "--depth does not apply to --hf"),
    (["--method", "lantern", "--nodes", "8"], "--nodes does not apply to --hf"),
    (["--method", "sjd", "--tree", "static"], "--tree must be chain"),
    (["--method", "sjd", "--tree", "auto"], "--tree must be chain"),
    (["--method", "spec", "--delta", "0.2"], "--delta"),
    (["--method", "ar", "--window", "4"], "--window does not apply to --method ar"),
    (["--negative-prompt", "dog"], "--negative-prompt applies to Emu3"),
    (["--temperature", "-1"], "--temperature"),
    (["--prompts", "PROMPTS"], "one of them"),
    (["NO-PROMPT"], "--prompt TEXT"),
    (["NO-PROMPT", "--prompts", "MISSING"], "--prompts"),
    (["NO-PROMPT", "--prompts", "EMPTY"], "holds no prompt"),
    (["NO-HF"], "--prompt applies to --hf"),
    (["MISSING-HF"], "not a directory"),
])
def test_options_that_do_not_apply_are_refused_before_anything_is_written(janus_dir, prompts_file, tmp_path, argv,
                                                                          match):
    (tmp_path / "empty.txt").write_text("\n  \n")
    files = {"PROMPTS": str(prompts_file), "MISSING": str(tmp_path / "missing.txt"),
             "EMPTY": str(tmp_path / "empty.txt")}
    hf = {"NO-HF": [], "MISSING-HF": ["--hf", str(tmp_path / "none")]}.get(argv[0], ["--hf", str(janus_dir)])
    prompt = [] if argv[0] == "NO-PROMPT" else ["--prompt", "a cat"]
    rest = [files.get(a, a) for a in argv if a not in ("NO-PROMPT", "NO-HF", "MISSING-HF")]
    out = tmp_path / "samples"
    with pytest.raises(SystemExit, match=match):
        main(["sample", str(out), *hf, *prompt, "--num-images", "2", *rest, *BASE])
    assert not out.exists()


def test_api_refuses_classes_with_hf_before_anything_is_written(janus_dir, tmp_path):
    with pytest.raises(SystemExit, match="--classes does not apply to --hf"):
        lantern.sample(tmp_path / "samples", 2, hf=janus_dir, prompt=["dog"], classes=[1], device="cpu")
    with pytest.raises(TypeError, match="prompt must be a list"):
        lantern.sample(tmp_path / "samples", 2, hf=janus_dir, prompt="dog", device="cpu")
    assert not (tmp_path / "samples").exists()
