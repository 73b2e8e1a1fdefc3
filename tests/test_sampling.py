"""`lantern sample` / `lantern eval` (docs/sampling.md): the same images whatever the number of processes,
a kill and a restart lose nothing and duplicate nothing, what the images depend on is recorded and a resume or
a rank with other numerics is refused, bad input is refused with a message naming it.

The multi-process runs use ``python -m torch.distributed.run --standalone --nproc_per_node 2`` on the CPU
(gloo; torchrun gives each process OMP_NUM_THREADS=1); the single-process references run with the machine's
default thread count (OMP_NUM_THREADS unset), so only lantern sample's pinned ``--threads`` makes them compute
alike (docs/sampling.md "Numerics")."""
import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import lantern
from lantern import sampling
from lantern.sampling import SampleFolder, block_ids, labels_of, rank_blocks, sample
from rounding import shape_dependent_rounding

TINY_AR = ["--num-images", "6", "--batch", "2", "--seed", "5", "--no-progress"]
TINY_LANTERN = ["--method", "lantern", "--k", "100", "--tree", "chain", "--depth", "3", "--num-images", "4",
                "--batch", "2", "--seed", "2", "--no-progress"]


def _env(**extra):
    env = dict(os.environ, **extra)
    for name in ("WORLD_SIZE", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.pop(name, None)
    return env


def run_single(out, args, **env):
    return subprocess.run([sys.executable, "-m", "lantern", "sample", str(out), *args], capture_output=True,
                          text=True, timeout=300, env=_env(**env))


def run_torchrun(out, args, nproc=2, **env):
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                           str(nproc), "-m", "lantern", "sample", str(out), *args], capture_output=True, text=True,
                          timeout=300, env=_env(**env))


def numerics(folder) -> dict:
    return json.loads((folder / sampling.CONFIG_FILE).read_text())["numerics"]


def arr_0(folder):
    with np.load(folder / sampling.NPZ_FILE) as data:
        return data["arr_0"]


def assert_ok(proc):
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.fixture(scope="module")
def ar_reference(tmp_path_factory):
    out = tmp_path_factory.mktemp("single") / "ar"
    assert_ok(run_single(out, TINY_AR))
    return out


# ---------------------------------------------------------------------------------------------- ids and seeds


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_rank_shares_are_disjoint_and_cover_every_block(world):
    n_blocks = 11
    shares = [rank_blocks(n_blocks, sampling.Ranks(rank, world)) for rank in range(world)]
    flat = sorted(j for share in shares for j in share)
    assert flat == list(range(n_blocks))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1


def test_block_ids_and_labels():
    assert block_ids(2, 7, 3).tolist() == [6]
    assert torch.cat([block_ids(j, 10, 4) for j in range(3)]).tolist() == list(range(10))
    assert labels_of(torch.arange(7), [3, 1, 4]).tolist() == [3, 1, 4, 3, 1, 4, 3]


def test_discrete_blocks_are_generate_calls_keyed_by_image_id(tmp_path):
    """Block j of a discrete run is lantern.generate on its ids' labels with the job's seed and image_ids = its
    ids. Negative control: the same call keyed by row (image_ids=None, the batch's rows 0..b-1) gives other
    images for the second block."""
    from lantern.decoding import generate_ar
    from lantern.pretrained import load_tiny

    torch.set_num_threads(1)
    npz = sample(tmp_path / "run", 3, batch=2, seed=7, classes=[4, 9], no_progress=True)
    with np.load(npz) as data:
        images = data["arr_0"]
    tiny = load_tiny("cpu")
    side = tiny.gpt.config.grid_size
    decode = lambda tokens: np.concatenate([tiny.vq.to_uint8(tiny.vq.decode_codes(row[None], side, side)).numpy()
                                            for row in tokens])  # noqa: E731 (one image at a time, as sample)
    cfg = tiny.meta["sampling"]["cfg_scale"]
    for j in range(2):
        ids = block_ids(j, 3, 2)
        tokens = generate_ar(tiny.gpt, labels_of(ids, [4, 9]), cfg_scale=cfg, seed=7, image_ids=ids)
        assert np.array_equal(images[ids.numpy()], decode(tokens))
    by_row = generate_ar(tiny.gpt, labels_of(block_ids(1, 3, 2), [4, 9]), cfg_scale=cfg, seed=7)
    assert not np.array_equal(images[2:], decode(by_row))
    for i in range(3):  # each PNG is its image, losslessly
        assert np.array_equal(np.asarray(Image.open(tmp_path / "run" / "images" / f"{i:06d}.png")), images[i])


def test_mar_blocks_are_generate_calls_keyed_by_image_id(tmp_path):
    """Block j of a MAR run is lantern.generate on its ids' labels with the run's settings and image_ids = its
    ids, each image decoded alone. Negative control: keyed by row, the second block's image is another."""
    from lantern.generate_mar_cli import _decode
    from lantern.models import to_uint8
    from lantern.tiny_mar import load_tiny_mar

    torch.set_num_threads(1)
    npz = sample(tmp_path / "run", 3, batch=2, seed=7, model="tiny-mar", num_iter=4, classes=[4, 1],
                 no_progress=True)
    config = json.loads((tmp_path / "run" / sampling.CONFIG_FILE).read_text())
    with np.load(npz) as data:
        images = data["arr_0"]
    tiny = load_tiny_mar("cpu")
    options = dict(method="ar", cfg_scale=config["cfg_scale"], temperature=config["temperature"],
                   num_iter=config["num_iter"], cfg_schedule=config["cfg_schedule"], seed=7)
    decode = lambda tokens: np.concatenate([to_uint8(_decode(tiny.mar, tiny.vae, row[None])).numpy()
                                            for row in tokens])  # noqa: E731
    for j in range(2):
        ids = block_ids(j, 3, 2)
        tokens, _ = lantern.generate(tiny.mar, labels_of(ids, [4, 1]), image_ids=ids, **options)
        assert np.array_equal(images[ids.numpy()], decode(tokens))
    by_row, _ = lantern.generate(tiny.mar, labels_of(block_ids(1, 3, 2), [4, 1]), **options)
    assert not np.array_equal(images[2:], decode(by_row))


@pytest.mark.parametrize("method,batches", [("ar", (1, 4)), ("lantern", (2, 3)), ("sjd", (1, 4))])
def test_discrete_images_do_not_depend_on_the_batch(tmp_path, method, batches):
    """Every draw is keyed by (seed, image id) and each image is decoded alone: two batch sizes give the same
    images. float64 (--dtype float64) under one-ulp rounding by the call's row count (tests/rounding.py), so
    the test does not rely on batch-invariant matrix products: the logits of a row then differ between
    batch sizes by ~1e-16 relative, and a sampling decision (a float32 uniform against a float64
    probability, or the race's argmin) changes only if a uniform or a competing key falls within that of
    the threshold: ~1e-16 x 2^24 < 1e-8 per decision, < 1e-4 over the test's ~10^4 decisions."""
    torch.set_num_threads(1)
    options = dict(method=method, seed=4, num_images=4, no_progress=True, fused="cpu", dtype="float64")
    if method != "ar":
        options.update(tree="chain", depth=3, k=100)
    if method == "sjd":
        options.update(window=4, k=0)
    runs = []
    with shape_dependent_rounding():
        for batch in batches:
            npz = sample(tmp_path / f"b{batch}", batch=batch, **options)
            with np.load(npz) as data:
                runs.append(data["arr_0"])
    assert np.array_equal(*runs)
    assert not np.array_equal(runs[0][:2], runs[0][2:])  # the images differ from one another
    assert numerics(tmp_path / f"b{batches[0]}")["dtype"] == "float64"


# ---------------------------------------------------------------------------------------------- processes


def test_two_processes_give_the_single_process_images_ar(tmp_path, ar_reference):
    """One process (the machine's default thread count) and two torchrun processes (one thread each by
    torchrun) compute at the pinned --threads 1 alike: the same images, and the same numerics recorded."""
    out = tmp_path / "ar2"
    assert_ok(run_torchrun(out, TINY_AR))
    assert np.array_equal(arr_0(out), arr_0(ar_reference))
    assert numerics(out) == numerics(ar_reference) and numerics(out)["threads"] == 1
    run = json.loads((out / "runs" / "run-000.json").read_text())
    assert run["world_size"] == 2 and [r["rank"] for r in run["per_rank"]] == [0, 1]
    assert [r["blocks"] for r in run["per_rank"]] == [2, 1]  # blocks 0, 2 and 1 of 3
    assert run["tau"] == 1.0 and run["totals"]["images"] == 6
    assert all(r["wall_s"] > 0 for r in run["per_rank"])


def test_two_processes_give_the_single_process_images_lantern(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    assert_ok(run_single(one, TINY_LANTERN))
    assert_ok(run_torchrun(two, TINY_LANTERN))
    assert np.array_equal(arr_0(one), arr_0(two))
    assert numerics(one) == numerics(two) and numerics(one)["threads"] == 1
    run = json.loads((two / "runs" / "run-000.json").read_text())
    assert run["tau"] > 1.0 and run["totals"]["draft_forwards"] > 0
    assert run["settings"]["method"] == "lantern" and run["settings"]["delta"] == 0.1


def test_pinned_threads_beyond_one_match_across_processes(tmp_path):
    """--threads 2 pins two threads in one process and in each of two torchrun processes (which torchrun would
    give one): the same images, and threads 2 recorded."""
    args = ["--num-images", "2", "--batch", "1", "--seed", "8", "--no-progress", "--threads", "2"]
    one, two = tmp_path / "one", tmp_path / "two"
    passive = dict(OMP_WAIT_POLICY="PASSIVE")  # four threads on a small machine: no spinning (same arithmetic)
    assert_ok(run_single(one, args, OMP_NUM_THREADS="1", **passive))
    assert_ok(run_torchrun(two, args, **passive))
    assert np.array_equal(arr_0(one), arr_0(two))
    assert numerics(one) == numerics(two) and numerics(one)["threads"] == 2


def test_pinned_threads_make_the_callers_thread_count_irrelevant(tmp_path):
    """lantern.sample runs at its --threads (default 1) whatever the caller's torch thread count, and restores
    the caller's thread count and fused backend afterwards. Under arithmetic that depends on the thread count
    (tests/rounding.py, exaggerated to 5 % so that any dependence shows in the tokens; torch's matrix products
    may split their sums by thread), a caller at 2 threads gets the 1-thread caller's images; negative control:
    --threads 2 gives other images."""
    def run(name, caller_threads, **options):
        torch.set_num_threads(caller_threads)
        with shape_dependent_rounding(threads=True, relative=0.05):
            npz = sample(tmp_path / name, 2, batch=2, seed=3, fused="cpu", no_progress=True, **options)
        assert torch.get_num_threads() == caller_threads and lantern.active_backend() == "reference"
        with np.load(npz) as data:
            return data["arr_0"]

    before = torch.get_num_threads()
    try:
        one, two = run("one", 1), run("two", 2)
        other = run("other", 1, threads=2)
    finally:
        torch.set_num_threads(before)
    assert np.array_equal(one, two)
    assert numerics(tmp_path / "one") == numerics(tmp_path / "two")
    assert not np.array_equal(one, other) and numerics(tmp_path / "other")["threads"] == 2


def test_resume_with_other_numerics_is_refused(small_run):
    """config.json records what the images depend on; --resume with another dtype, fused backend or thread
    count is refused, naming each differing item, before any image is made."""
    saved = numerics(small_run)
    assert saved["threads"] == 1 and saved["device"] == "cpu" and saved["fused"]["verify"] == "reference"
    assert saved["torch"] == torch.__version__ and saved["cpu_capability"].startswith(
        torch.backends.cpu.get_cpu_capability())
    other_dtype = "bfloat16" if saved["dtype"] == "float32" else "float32"
    shards = sorted(p.name for p in (small_run / "shards").iterdir())
    for options, named in ((dict(dtype=other_dtype), rf"numerics\.dtype \(the folder's run: '{saved['dtype']}', "
                                                     rf"now: '{other_dtype}'\)"),
                           (dict(fused="cpu"), r"numerics\.fused\.tree_attention \(the folder's run: 'reference', "
                                               r"now: 'cpu'\).*numerics\.fused\.verify"),
                           (dict(threads=2), r"numerics\.threads \(the folder's run: 1, now: 2\)")):
        with pytest.raises(SystemExit, match="cannot resume it.*" + named):
            sample(small_run, 2, batch=2, seed=1, resume=True, no_progress=True, **options)
    assert sorted(p.name for p in (small_run / "shards").iterdir()) == shards
    assert numerics(small_run) == saved


def test_ranks_with_other_numerics_are_refused(tmp_path, monkeypatch):
    """Every rank's numerics reach rank 0 before any image; one that differs from rank 0's (here a stand-in
    for a second rank on another processor at another thread count) stops the run with a message naming the
    rank and each differing item, and nothing is written."""
    def gather(value, ranks):
        return [value, dict(value, processor="another CPU", threads=4)]

    monkeypatch.setattr(sampling, "_all_gather", gather)
    with pytest.raises(SystemExit, match=r"rank 1: processor \(rank 0: .*, rank 1: 'another CPU'\); "
                                         r"threads \(rank 0: 1, rank 1: 4\)"):
        sample(tmp_path / "run", 2, batch=2, seed=1, no_progress=True)
    assert not (tmp_path / "run" / sampling.CONFIG_FILE).exists()


def test_kill_and_resume_loses_and_duplicates_nothing(tmp_path, ar_reference):
    """Rank 0 SIGKILLs itself after its first block (torchrun then ends rank 1); --resume completes the run."""
    out = tmp_path / "killed"
    killed = run_torchrun(out, TINY_AR, **{sampling.STOP_AFTER_ENV: "1"})
    assert killed.returncode != 0
    assert not (out / sampling.NPZ_FILE).exists()
    done = SampleFolder(out).done_blocks()
    assert 0 in done and 2 not in done  # rank 0 stopped after block 0, before block 2
    (out / "shards" / ".tmp-half-written").write_bytes(b"PK\x03")  # what a kill during a write leaves
    refused = run_torchrun(out, TINY_AR)  # the same command without --resume: refused
    assert refused.returncode != 0 and "--resume" in refused.stderr
    assert_ok(run_torchrun(out, [*TINY_AR, "--resume"]))
    assert np.array_equal(arr_0(out), arr_0(ar_reference))
    assert sorted(p.name for p in (out / "shards").iterdir()) == [f"{j:06d}.npz" for j in range(3)]
    assert len(list((out / "images").iterdir())) == 6
    resumed = json.loads((out / "runs" / "run-000.json").read_text())
    assert resumed["images_this_run"] == 6 - 2 * len(done)


# ---------------------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    torch.set_num_threads(1)
    out = tmp_path_factory.mktemp("small") / "run"
    sample(out, 2, batch=2, seed=1, no_progress=True)
    return out


def test_unwritable_output_folder_is_refused(tmp_path):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    for bad in (a_file, a_file / "sub", "/proc/lantern-sample-test"):
        with pytest.raises(SystemExit, match="output folder .*(is a file|cannot be written)"):
            sample(bad, 2, no_progress=True)


def test_existing_run_needs_resume_and_the_same_settings(small_run, tmp_path):
    with pytest.raises(SystemExit, match="already holds this run .*pass --resume"):
        sample(small_run, 2, batch=2, seed=1, no_progress=True)
    with pytest.raises(SystemExit, match=r"other settings; refusing .*seed \(the folder's run: 1, now: 2\)"):
        sample(small_run, 2, batch=2, seed=2, no_progress=True)
    with pytest.raises(SystemExit, match=r"cannot resume it.*batch \(the folder's run: 2, now: 1\).*num_images"):
        sample(small_run, 3, batch=1, seed=1, resume=True, no_progress=True)
    with pytest.raises(SystemExit, match="cannot resume it.*method"):
        sample(small_run, 2, batch=2, seed=1, method="lantern", resume=True, no_progress=True)
    before = arr_0(small_run)
    sample(small_run, 2, batch=2, seed=1, resume=True, no_progress=True)  # complete: gathered again
    assert np.array_equal(arr_0(small_run), before)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="not empty and holds no config.json"):
        sample(other, 2, no_progress=True)


@pytest.mark.parametrize("options, message", [
    (dict(num_images=0), "--num-images must be >= 1"),
    (dict(batch=0), "--batch must be >= 1"),
    (dict(threads=0), r"--threads must be an integer in \[1, 1024\], got 0"),
    (dict(threads=2.5), "--threads must be an integer"),
    (dict(classes=[3, 10]), r"--classes must be class ids in \[0, 10\)"),
    (dict(method="lantern", tree="auto"), "fixed draft tree"),
    (dict(method="cspd"), "for MAR models"),
    (dict(model="tiny-mar", method="lantern"), "for the discrete models"),
    (dict(model="checkpoint"), "needs --gpt PATH and --vq PATH"),
])
def test_bad_options_are_refused(tmp_path, options, message):
    n = options.pop("num_images", 2)
    with pytest.raises(SystemExit, match=message):
        sample(tmp_path / "run", n, no_progress=True, **options)
    with pytest.raises(TypeError, match="unknown option 'per_class'"):
        sample(tmp_path / "run", 2, per_class=3)


def test_gather_finds_gaps_and_duplicates(tmp_path):
    folder = SampleFolder(tmp_path / "run")
    folder.prepare({"format": 1}, resume=False)
    pixels = np.zeros((2, 4, 4, 3), dtype=np.uint8)
    folder.write_block(0, torch.tensor([0, 1]), pixels)
    with pytest.raises(RuntimeError, match="2 missing ids, e.g. \\[2, 3\\]"):
        folder.gather(4, 2)
    folder.write_block(1, torch.tensor([1, 2]), pixels)  # a corrupt shard: id 1 twice, id 3 never
    with pytest.raises(RuntimeError, match="1 duplicated ids, e.g. \\[1\\].*1 missing ids, e.g. \\[3\\]"):
        folder.gather(4, 2)
    folder.write_block(1, torch.tensor([2, 3]), pixels + 7)
    npz = folder.gather(4, 2)
    with np.load(npz) as data:
        assert data["arr_0"].shape == (4, 4, 4, 3) and data["arr_0"][2:].min() == 7 and data["arr_0"][:2].max() == 0
    (folder.images / "000003.png").unlink()
    with pytest.raises(RuntimeError, match="1 PNG files are missing, e.g. ids \\[3\\]"):
        folder.gather(4, 2)


# ---------------------------------------------------------------------------------------------- eval


def test_eval_tiny_folder_reports_accuracy_and_fd(small_run, tmp_path, capsys):
    from lantern.cli import main

    js = tmp_path / "eval.json"
    assert main(["eval", str(small_run), "--json", str(js)]) == 0
    figures = json.loads(js.read_text())
    assert figures["metrics"] == "tiny" and figures["n"] == 2 and 0.0 <= figures["class_accuracy"] <= 1.0
    assert figures["fd"] >= 0


def test_eval_official_path_names_the_missing_files(small_run, tmp_path):
    from lantern.cli import main

    npz = str(small_run / sampling.NPZ_FILE)
    with pytest.raises(SystemExit, match="--reference PATH is needed.*arr_0"):
        main(["eval", npz, "--metrics", "inception"])
    with pytest.raises(SystemExit, match="--reference: .*is not a file"):
        main(["eval", npz, "--metrics", "inception", "--reference", str(tmp_path / "absent.npz")])
    no_arr = tmp_path / "stats.npz"
    np.savez(no_arr, mu=np.zeros(3))
    with pytest.raises(SystemExit, match="has no arr_0"):
        main(["eval", npz, "--metrics", "inception", "--reference", str(no_arr)])
    with pytest.raises(SystemExit, match="--inception PATH is needed.*never downloads"):
        main(["eval", npz, "--metrics", "inception", "--reference", npz])
    with pytest.raises(SystemExit, match="--inception .*is not a file"):
        main(["eval", npz, "--metrics", "inception", "--reference", npz, "--inception", str(tmp_path / "w.pth")])
    pickled = tmp_path / "code.pth"
    pickled.write_bytes(pickle.dumps(os.getcwd))  # not a plain state dict: weights_only refuses it
    with pytest.raises(SystemExit, match="cannot be read as a weights file"):
        main(["eval", npz, "--metrics", "inception", "--reference", npz, "--inception", str(pickled)])
    with pytest.raises(SystemExit, match="no arr_0|cannot be read"):
        main(["eval", str(no_arr), "--classes", "1"])


def test_inception_metrics_plumbing_with_a_stand_in_extractor():
    """torch-fidelity's FID / IS / precision / recall through inception_figures, with a small registered
    feature extractor in place of Inception (whose weights CI does not have)."""
    fidelity = pytest.importorskip("torch_fidelity")
    from torch_fidelity.feature_extractor_base import FeatureExtractorBase

    from lantern.sample_eval import inception_figures

    class StandIn(FeatureExtractorBase):
        def __init__(self, name, features_list, **kwargs):
            super().__init__(name, features_list)
            self.proj = torch.nn.Linear(48, 5)
            torch.nn.init.normal_(self.proj.weight, generator=torch.Generator().manual_seed(0))

        @staticmethod
        def get_provided_features_list():
            return ("pooled", "logits")

        @staticmethod
        def get_default_feature_layer_for_metric(metric):
            return {"isc": "logits"}.get(metric, "pooled")

        @staticmethod
        def can_be_compiled():
            return False

        @staticmethod
        def get_dummy_input_for_compile():
            return None

        def forward(self, x):  # uint8 [B, 3, H, W]
            pooled = torch.nn.functional.adaptive_avg_pool2d(x.float() / 255, 4).flatten(1)  # [B, 48]
            out = {"pooled": pooled, "logits": self.proj(pooled)}
            return tuple(out[name] for name in self.features_list)

    if "lantern-standin" not in fidelity.registry.FEATURE_EXTRACTORS_REGISTRY:
        fidelity.register_feature_extractor("lantern-standin", StandIn)
    rng = np.random.default_rng(0)
    real = rng.integers(0, 256, (40, 8, 8, 3), dtype=np.uint8)
    layers = {"fid": "pooled", "prc": "pooled", "isc": "logits"}
    same = inception_figures(real, real, None, feature_extractor="lantern-standin", layers=layers, batch=16)
    assert abs(same["fid"]) < 1e-3 and same["precision"] == 1.0 and same["recall"] == 1.0
    assert same["inception_score"] >= 1.0 and same["n"] == same["reference_n"] == 40
    darker = inception_figures(real // 2, real, None, feature_extractor="lantern-standin", layers=layers, batch=16)
    assert darker["fid"] > 1.0 and darker["precision"] < 1.0
