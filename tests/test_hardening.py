"""Regression tests of issue 16 ("Hardening"): each test is named after the defect number it covers
(docs/hardening.md lists them)."""
import hashlib
import math
import threading
import warnings

import pytest
import torch

import backends
from lantern.cli import main
from lantern.models import load_gpt, load_vq
from lantern.models.loading import read_state_dict


def within(seconds, fn, *args, **kwargs):
    """fn's return value, or its exception re-raised; fails (instead of hanging the run) if it is still
    running after ``seconds``."""
    box = {}

    def run():
        try:
            box["value"] = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"{getattr(fn, '__name__', fn)} still running after {seconds}s (a hang)"
    if "error" in box:
        raise box["error"]
    return box.get("value")


BACKENDS = backends.params(backends.NAMES)  # reference, cpu, cuda, triton (skipped, with the reason, if unusable)
# numpy's floating-point warnings from Triton's interpreter, on the deliberately non-finite inputs
pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


# -- 2: a checkpoint whose wrapper contains itself -------------------------------------------------------

@pytest.fixture
def cyclic_checkpoint(tmp_path):
    path = tmp_path / "cycle.pt"
    d = {}
    d["model"] = d
    torch.save(d, path)
    return path


def test_2_self_containing_wrapper_raises(cyclic_checkpoint):
    with pytest.raises(ValueError, match="contains itself"):
        within(30, read_state_dict, cyclic_checkpoint)
    with pytest.raises(ValueError, match="contains itself"):
        within(30, load_gpt, cyclic_checkpoint, "GPT-B")
    with pytest.raises(ValueError, match="contains itself"):
        within(30, load_vq, cyclic_checkpoint, "VQ-16", decoder_only=True)


def test_2_neighbours_cli_on_a_cyclic_vq_raises(cyclic_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("LANTERN_CACHE", str(tmp_path / "cache"))
    with pytest.raises(ValueError, match="contains itself"):
        within(30, main, ["neighbours", "--vq", str(cyclic_checkpoint), "--K", "4"])


def test_2_two_level_cycle_and_deep_chains_raise():
    a, b = {}, {}
    a["state_dict"], b["module"] = b, a
    with pytest.raises(ValueError, match="contains itself"):
        within(30, read_state_dict, a)
    deep = {"w": torch.zeros(1)}
    for _ in range(40):
        deep = {"model": deep}
    with pytest.raises(ValueError, match="nest more than"):
        read_state_dict(deep)
    shallow = {"w": torch.zeros(1)}
    for _ in range(3):
        shallow = {"model": shallow}
    assert list(read_state_dict(shallow)) == ["w"]  # ordinary nesting still unwraps


# -- 4 / 7: the neighbour-table cache -------------------------------------------------------------------

def _cache_file(directory, codebook, K, normalize=True):
    from lantern.neighbours import codebook_key

    return directory / (codebook_key(codebook, K, normalize) + ".safetensors")


def test_4_cache_records_codebook_V_K_dtype(tmp_path):
    from safetensors import safe_open

    from lantern.neighbours import neighbour_table

    codebook = torch.randn(32, 4)
    neighbour_table(codebook, 3, directory=tmp_path)
    with safe_open(str(_cache_file(tmp_path, codebook, 3)), "pt") as f:
        meta = f.metadata() or {}
    assert meta.get("V") == "32" and meta.get("K") == "3" and meta.get("dtype") == "int32"
    assert meta.get("normalize") == "True"
    assert meta["codebook_sha256"] == hashlib.sha256(codebook.numpy().tobytes()).hexdigest()


def _swap_in(tmp_path, src_codebook, src_K, dst_codebook, dst_K, **save_kwargs):
    """Build src's table, then put a file at dst's key: src's file, or one saved with save_kwargs."""
    from safetensors.torch import save_file

    from lantern.neighbours import neighbour_table

    table = neighbour_table(src_codebook, src_K, directory=tmp_path)
    dst = _cache_file(tmp_path, dst_codebook, dst_K)
    if save_kwargs:
        save_file(save_kwargs["tensors"], str(dst), metadata=save_kwargs.get("metadata"))
    else:
        dst.write_bytes(_cache_file(tmp_path, src_codebook, src_K).read_bytes())
    return table


@pytest.mark.parametrize("case", ["other_codebook", "other_K", "other_dtype", "no_record", "corrupt", "bad_ids"])
def test_4_mismatching_or_corrupt_cache_entry_is_rebuilt_with_a_warning(tmp_path, case):
    from lantern import ops
    from lantern.neighbours import neighbour_table

    torch.manual_seed(0)
    codebook, other = torch.randn(24, 4), torch.randn(24, 4)
    want = ops.latent_neighbours(codebook, 5, normalize=True)
    record = {"format": "lantern-neighbours-1", "V": "24", "K": "5", "normalize": "True", "dtype": "int32",
              "codebook_sha256": hashlib.sha256(codebook.numpy().tobytes()).hexdigest()}
    if case == "other_codebook":
        _swap_in(tmp_path, other, 5, codebook, 5)
    elif case == "other_K":
        _swap_in(tmp_path, codebook, 4, codebook, 5)
    elif case == "other_dtype":  # the right record, a table of another dtype
        _swap_in(tmp_path, codebook, 5, codebook, 5, tensors={"neighbours": want.to(torch.int64)}, metadata=record)
    elif case == "no_record":  # a file as the old cache wrote it: no metadata
        _swap_in(tmp_path, codebook, 5, codebook, 5, tensors={"neighbours": (want + 1) % 24})
    elif case == "bad_ids":
        _swap_in(tmp_path, codebook, 5, codebook, 5, tensors={"neighbours": want + 100}, metadata=record)
    else:
        _cache_file(tmp_path, codebook, 5).write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.warns(RuntimeWarning, match="rebuilding"):
        got = neighbour_table(codebook, 5, directory=tmp_path)
    assert got.dtype == torch.int32 and torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rebuilt entry is now served as is
        assert torch.equal(neighbour_table(codebook, 5, directory=tmp_path), want)


def _hammer(fn, seconds, errors):
    import time

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - collected for the assertion
            errors.append(repr(e))
            return


def test_7_concurrent_writers_and_readers(tmp_path):
    from lantern import ops
    from lantern.neighbours import neighbour_table

    torch.manual_seed(0)
    codebook = torch.randn(64, 4)
    want = ops.latent_neighbours(codebook, 8, normalize=True)
    neighbour_table(codebook, 8, directory=tmp_path)
    errors = []

    def write():
        assert torch.equal(neighbour_table(codebook, 8, directory=tmp_path, rebuild=True), want)

    def read():
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a reader that saw half a file would warn and rebuild
            assert torch.equal(neighbour_table(codebook, 8, directory=tmp_path), want)

    workers = [threading.Thread(target=_hammer, args=(fn, 2.0, errors)) for fn in (write, write, write, write, read, read)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == [_cache_file(tmp_path, codebook, 8).name]  # no temporaries left


# -- 5 / 14: decoding arguments -------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_pair():
    from models.gpt_testing import small_gpt

    from lantern.models.drafter import GPTDrafter

    return small_gpt(0), GPTDrafter(small_gpt(1, n_layer=1))  # num_classes 5, V 64, 4x4 tokens


@pytest.mark.parametrize("labels", [[5], [0, 7], [-1]])
def test_5_class_ids_outside_the_model_raise(small_pair, labels):
    import lantern
    from lantern.decoding import SpecConfig, generate_ar, generate_spec

    gpt, drafter = small_pair
    cond = torch.tensor(labels)
    for run in (lambda: lantern.generate(gpt, cond, method="ar"),
                lambda: generate_ar(gpt, cond, cfg_scale=2.0),
                lambda: generate_spec(gpt, drafter, cond, config=SpecConfig(method="spec", tree="chain", depth=2)),
                lambda: lantern.generate(gpt, cond, method="spec", drafter=drafter, tree="chain", depth=2)):
        with pytest.raises(ValueError, match=r"cond_idx: class ids must be in \[0, 5\)"):
            run()


def test_5_class_ids_must_be_integers_in_a_batch(small_pair):
    from lantern.decoding import generate_ar

    gpt, _ = small_pair
    for bad in (torch.tensor([1.0]), torch.tensor([[1]]), torch.tensor([True])):
        with pytest.raises(ValueError, match="cond_idx must be integer class ids"):
            generate_ar(gpt, bad)
    assert generate_ar(gpt, torch.tensor([4]), length=2).shape == (1, 2)  # the last real class still runs


def test_5_mar_labels_outside_the_model_raise():
    from lantern.decoding import sample_mar
    from lantern.models import build_mar

    torch.manual_seed(0)
    mar = build_mar("MAR-tiny-drafter").eval()
    n = mar.config.class_num
    with pytest.raises(ValueError, match=rf"labels: class ids must be in \[0, {n}\)"):
        sample_mar(mar, torch.tensor([n]), num_iter=1)


SPEC_ERRORS = [
    (dict(tree="chain", depth=-3), "depth must be an int >= 1"),
    (dict(tree="dynamic", depth=0), "depth must be an int >= 1"),
    (dict(tree="auto", depth=0), "depth must be an int >= 1"),
    (dict(tree="dynamic", top_per_node=0), r"top_per_node must be an int in \[1, 64\]"),
    (dict(tree="dynamic", top_per_node=65), r"top_per_node must be an int in \[1, 64\]"),
    (dict(tree="static", static_widths=(0,)), "static_widths must be a non-empty sequence"),
    (dict(tree="static", static_widths=()), "static_widths must be a non-empty sequence"),
    (dict(tree="chain", draft="bogus"), "draft must be one of"),
    (dict(tree="dynamic", draft="sampled"), "draft='sampled' does not apply to tree='dynamic'"),
    (dict(tree="dynamic", n_nodes=0), "n_nodes must be an int >= 1"),
]


@pytest.mark.parametrize("options,message", SPEC_ERRORS, ids=lambda x: str(x) if isinstance(x, dict) else "")
def test_14_bad_speculative_options_raise_naming_the_option(small_pair, options, message):
    from lantern.decoding import SpecConfig, generate_spec, resolve_cost_model

    gpt, drafter = small_pair
    config = SpecConfig(method="spec", **options)
    with pytest.raises(ValueError, match=message):
        generate_spec(gpt, drafter, torch.tensor([0, 1]), config=config, temperature=0.0)
    with pytest.raises(ValueError, match=message):
        resolve_cost_model(gpt, drafter, torch.tensor([0, 1]), config=config)


def test_14_empty_batch_raises(small_pair):
    from lantern.decoding import SpecConfig, generate_ar, generate_spec

    gpt, drafter = small_pair
    empty = torch.zeros(0, dtype=torch.int64)
    with pytest.raises(ValueError, match="cond_idx must hold at least one row"):
        generate_spec(gpt, drafter, empty, config=SpecConfig(method="spec", tree="chain", depth=2))
    with pytest.raises(ValueError, match="cond_idx must hold at least one row"):
        generate_ar(gpt, empty)


def test_14_valid_edge_options_still_run(small_pair):
    from lantern.decoding import SpecConfig, generate_ar, generate_spec

    gpt, drafter = small_pair
    labels = torch.tensor([0, 4])
    want = generate_ar(gpt, labels, temperature=0.0)
    for config in (SpecConfig(method="spec", tree="chain", depth=1),
                   SpecConfig(method="spec", tree="dynamic", depth=1, top_per_node=64, n_nodes=1),
                   SpecConfig(method="spec", tree="static", static_widths=(1,)),
                   SpecConfig(method="spec", tree="chain", depth=2, draft="sampled")):
        got, _ = generate_spec(gpt, drafter, labels, config=config, temperature=0.0)
        assert torch.equal(got, want)


@pytest.mark.parametrize("flag,value,message", [("--rows", "0", r"rows \(--rows\) must be an int >= 1"),
                                                ("--vocab", "1", r"vocab \(--vocab\) must be an int >= 2"),
                                                ("--k", "-1", r"neighbours \(--k\) must be an int in")])
def test_14_demo_rejects_empty_settings(flag, value, message):
    with pytest.raises(ValueError, match=message):
        main(["demo", flag, value, "--vocab" if flag != "--vocab" else "--rows", "16" if flag != "--vocab" else "2"])


# -- CLI: 5 (--classes), 11 (outputs), 12 (options of other models), 13 (JSON), 14 (--nodes / --depth) ---------

class StubVQ:
    """decode_codes / to_uint8 of a VQ, enough for the CLI to write its grid."""

    def decode_codes(self, tokens, h, w):
        return torch.zeros(tokens.shape[0], 3, 4 * h, 4 * w)

    def to_uint8(self, images):
        return images.permute(0, 2, 3, 1).to(torch.uint8)  # [B, H, W, 3]


@pytest.fixture
def stub_models(monkeypatch):
    """generate_cli's loader replaced: a small random 10-class GPT (like the tiny model's classes) and a
    stub VQ; ``loads`` counts the loads, so a test can tell an error came before any model was loaded."""
    from models.gpt_testing import small_gpt

    from lantern import generate_cli

    loads = []
    gpt = small_gpt(0, num_classes=10)

    def load(args):
        loads.append(args.model)
        return gpt, StubVQ(), {"sampling": {"cfg_scale": 1.0}}

    monkeypatch.setattr(generate_cli, "_load", load)
    return loads


def generate(tmp_path, *extra):
    return main(["generate", "--per-class", "1", "--no-progress", "--out", str(tmp_path / "g.png"), *extra])


def test_5_cli_classes_outside_the_model_fail_before_sampling(stub_models, tmp_path, monkeypatch):
    import lantern.decoding

    monkeypatch.setattr(lantern.decoding, "generate_ar", lambda *a, **k: pytest.fail("sampled"))
    with pytest.raises(SystemExit, match=r"--classes must be class ids in \[0, 10\).*got \[10\]"):
        generate(tmp_path, "--classes", "3", "10")
    with pytest.raises(SystemExit, match=r"--classes .*got \[-1\]"):
        generate(tmp_path, "--classes", "-1")


def test_5_cli_mar_classes_outside_the_model_fail(tmp_path, monkeypatch):
    from lantern import generate_mar_cli
    from lantern.models import build_mar

    torch.manual_seed(0)
    mar = build_mar("MAR-tiny-drafter").eval()
    defaults = dict(cfg=1.0, cfg_schedule="linear", num_iter=2, temperature=1.0)
    monkeypatch.setattr(generate_mar_cli, "_load", lambda args: (mar, None, None, defaults, [0]))
    monkeypatch.setattr(generate_mar_cli, "sample_mar", lambda *a, **k: pytest.fail("sampled"), raising=False)
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
def test_11_unwritable_outputs_fail_before_loading(stub_models, tmp_path, model):
    for flag, path, message in bad_outputs(tmp_path):
        argv = ["generate", "--model", model, "--no-progress", "--out", str(tmp_path / "g.png"), flag, path]
        with pytest.raises(SystemExit, match=message):
            main(argv)
    assert stub_models == []  # nothing was loaded, let alone sampled
    assert not (tmp_path / "missing").exists() and not (tmp_path / "grid").exists()


@pytest.mark.skipif(hasattr(__import__("os"), "geteuid") and __import__("os").geteuid() == 0,
                    reason="root writes into read-only folders")
def test_11_read_only_folder_fails_before_loading(stub_models, tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(SystemExit, match="cannot be written"):
        generate(tmp_path, "--out", str(locked / "g.png"))
    assert stub_models == []


def test_11_demo_json_fails_before_running(tmp_path, monkeypatch):
    import lantern.demo

    monkeypatch.setattr(lantern.demo, "run_demo", lambda *a, **k: pytest.fail("ran"))
    with pytest.raises(SystemExit, match="does not exist"):
        main(["demo", "--json", str(tmp_path / "missing" / "d.json")])
    with pytest.raises(SystemExit, match="must name a JSON file"):
        main(["demo", "--json", str(tmp_path / "d.txt")])


@pytest.mark.parametrize("model,option", [
    ("tiny", ["--image-size", "512"]), ("tiny", ["--gpt-name", "GPT-B"]), ("tiny", ["--num-iter", "4"]),
    ("tiny", ["--vae", "kl.ckpt"]), ("checkpoint", ["--mar-name", "MAR-L"]), ("checkpoint", ["--cfg-schedule", "linear"]),
    ("tiny-mar", ["--image-size", "384"]), ("tiny-mar", ["--num-sampling-steps", "10"]), ("tiny-mar", ["--vq", "vq.pt"]),
    ("mar-checkpoint", ["--gpt", "gpt.pt"]),
])
def test_12_options_of_other_models_are_rejected(stub_models, tmp_path, model, option):
    with pytest.raises(SystemExit, match=f"{option[0]} does not apply to --model {model}"):
        generate(tmp_path, "--model", model, *option)
    assert stub_models == []


def test_12_options_of_the_chosen_model_still_run(stub_models, tmp_path):
    assert generate(tmp_path, "--model", "checkpoint", "--image-size", "384", "--gpt-name", "GPT-B",
                    "--classes", "1") == 0
    assert stub_models == ["checkpoint"] and (tmp_path / "g.png").exists()


def test_13_json_of_one_image_is_valid_json_with_null(stub_models, tmp_path, monkeypatch):
    import json
    import math

    import lantern.tiny.evaluate

    nan = float("nan")
    monkeypatch.setattr(lantern.tiny.evaluate, "evaluate_samples",  # what it returns for one image
                        lambda images, labels: dict(class_accuracy=1.0, n=1, fd=nan,
                                                    per_class_accuracy=[1.0] + [nan] * 9))
    js = tmp_path / "run.json"
    assert generate(tmp_path, "--classes", "0", "--json", str(js)) == 0
    text = js.read_text()
    assert "NaN" not in text and "Infinity" not in text
    figures = json.loads(text, parse_constant=lambda c: pytest.fail(f"bare {c} in the JSON"))
    assert figures["fd"] is None and figures["per_class_accuracy"] == [1.0] + [None] * 9
    assert figures["class_accuracy"] == 1.0 and math.isfinite(figures["wall_s"])


def test_13_write_json_replaces_every_non_finite_float(tmp_path):
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
def test_14_cli_spec_options_fail_before_loading(stub_models, tmp_path, option, message):
    with pytest.raises(SystemExit, match=message):
        generate(tmp_path, "--method", "lantern", *option)
    assert stub_models == []


# -- lantern neighbours --out: checked before the codebook is loaded ---------------------------------------

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


# -- README: the fused-backend choice is per thread -------------------------------------------------------

def test_fused_backend_choice_is_per_thread():
    import lantern

    seen = {}

    def other():
        seen["start"] = lantern.active_backend()
        lantern.enable_fused("cpu")
        seen["after"] = lantern.active_backend()

    with lantern.fused("reference"):
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()
        assert lantern.active_backend() == "reference"  # the other thread's enable_fused did not leak here
        with lantern.fused("cpu"):
            worker = threading.Thread(target=other)
            worker.start()
            worker.join()
            assert lantern.active_backend() == "cpu"
    assert seen == {"start": "reference", "after": "cpu"}  # a new thread starts on the reference ops
