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
import re
import shutil
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
    assert all(isinstance(share, range) for share in shares)  # no list of every block id
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
    from lantern.models import to_uint8
    from lantern.sources import decode_mar
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
    decode = lambda tokens: np.concatenate([to_uint8(decode_mar(tiny.mar, tiny.vae, row[None])).numpy()
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
    if method == "lantern":
        options.update(tree="chain", depth=3, k=100)
    if method == "sjd":  # exact: no neighbour table
        options.update(tree="chain", window=4)
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


@pytest.mark.parametrize("old_format", [2, 3])
def test_a_folder_of_an_earlier_format_is_refused_on_resume(small_run, tmp_path, old_format):
    """A folder written before the numerics record (format 2, or 3 without the weight digests) is refused on
    resume, naming the format and what it lacks, and left as it was."""
    old = tmp_path / "old"
    shutil.copytree(small_run, old)
    config = json.loads((old / sampling.CONFIG_FILE).read_text())
    config = {key: value for key, value in config.items() if key not in ("numerics", "sha256")}
    config["format"] = old_format
    (old / sampling.CONFIG_FILE).write_text(json.dumps(config))
    assert sampling.FORMAT == 4
    with pytest.raises(SystemExit, match=rf"cannot resume it.*format \(the folder's run: {old_format}, now: 4\).*"
                                         r"numerics\.dtype \(the folder's run: '<unset>'"):
        sample(old, 2, batch=2, seed=1, resume=True, no_progress=True)
    assert json.loads((old / sampling.CONFIG_FILE).read_text()) == config


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
    """Rank 0, which holds DIR's lock, SIGKILLs itself after its first block; torchrun then ends rank 1 wherever
    it is (before, during or after its block: either rank may be the first to stop). --resume completes the run
    with every id once."""
    out = tmp_path / "killed"
    killed = run_torchrun(out, TINY_AR, **{sampling.STOP_AFTER_ENV: "1"})
    assert killed.returncode != 0
    assert not (out / sampling.NPZ_FILE).exists()
    done = np.flatnonzero(SampleFolder(out).done_blocks(3)).tolist()
    assert 0 in done and 2 not in done  # rank 0 wrote its first block and never reached its second; block 1: either
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
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]  # refused before the lock: nothing written


@pytest.mark.parametrize("options, message", [
    (dict(num_images=0), r"--num-images must be in \[1, "),
    (dict(batch=0), r"--batch must be in \[1, "),
    (dict(classes=[3, 10]), r"--classes must be class ids in \[0, 10\)"),
    (dict(method="lantern", tree="auto"), "fixed draft tree"),
    (dict(method="cspd"), "for MAR models"),
    (dict(model="tiny-mar", method="lantern"), "--method must be 'ar' .* or 'cspd' .* for a MAR model"),
    (dict(model="checkpoint"), "needs --gpt PATH and --vq PATH"),
])
def test_bad_options_are_refused(tmp_path, options, message):
    n = options.pop("num_images", 2)
    with pytest.raises(SystemExit, match=message):
        sample(tmp_path / "run", n, no_progress=True, **options)
    with pytest.raises(TypeError, match="unknown option 'per_class'"):
        sample(tmp_path / "run", 2, per_class=3)


def _fake_run(root, n=4, batch=2, shape=(4, 4)):
    """A prepared folder with every block written (pixels: the block index), without a model."""
    folder = SampleFolder(root)
    folder.prepare({"format": sampling.FORMAT, "num_images": n}, resume=False, n=n, batch=batch)
    for j in range(sampling.block_count(n, batch)):
        ids = block_ids(j, n, batch)
        folder.write_block(j, ids, np.full((len(ids), *shape, 3), j, dtype=np.uint8))
    return folder


def test_gather_names_missing_blocks_and_wrong_shards(tmp_path):
    folder = _fake_run(tmp_path / "run")
    folder.shard_path(1).unlink()
    with pytest.raises(RuntimeError, match=r"1 of 2 blocks have no shard .*blocks \[1\]"):
        folder.gather(4, 2)
    folder.write_block(1, torch.tensor([1, 2]), np.zeros((2, 4, 4, 3), np.uint8))  # block 1 holds ids 2, 3
    with pytest.raises(RuntimeError, match=r"000001.npz holds ids \[1, 2\].*not block 1's \[2, 3\].*removed"):
        folder.gather(4, 2)
    assert not folder.shard_path(1).exists()  # so --resume makes it again
    folder.write_block(1, torch.tensor([2, 3]), np.full((2, 4, 4, 3), 7, np.uint8))
    npz = folder.gather(4, 2)
    with np.load(npz) as data:
        assert data["arr_0"].shape == (4, 4, 4, 3) and data["arr_0"][2:].min() == 7 and data["arr_0"][:2].max() == 0
    (folder.images / "000003.png").unlink()
    with pytest.raises(RuntimeError, match="1 PNG files are missing, e.g. ids \\[3\\]"):
        folder.gather(4, 2)


# ---------------------------------------------------------------------------------------------- the folder's lock


def test_a_live_folder_is_refused_and_keeps_its_temporary_files(tmp_path):
    """While a run holds DIR's lock, another start (this process or another, with or without --resume) is
    refused before anything is loaded, and the live run's temporary files stay."""
    live = _fake_run(tmp_path / "live", n=4, batch=2)
    live.lock()  # what a running `lantern sample` holds
    try:
        being_written = live.shards / ".tmp-being-written"
        being_written.write_bytes(b"PK")
        for resume in (False, True):
            with pytest.raises(SystemExit, match=r"in use by another lantern sample run \(pid \d+ on "):
                sample(live.root, 4, batch=2, resume=resume, no_progress=True)
        refused = run_single(live.root, ["--num-images", "4", "--batch", "2", "--resume", "--no-progress"])
        assert refused.returncode != 0 and "in use by another lantern sample run" in refused.stderr
        assert "Traceback" not in refused.stderr
        assert being_written.exists()
    finally:
        live.unlock()
    again = SampleFolder(live.root)
    again.lock()  # free again: the lock went with the run
    again.unlock()
    only_lock = tmp_path / "refused-late"
    only_lock.mkdir()
    (only_lock / sampling.LOCK_FILE).write_text("")
    SampleFolder(only_lock).check_layout()  # a lock file alone does not make DIR "not empty"


# ---------------------------------------------------------------------------------------------- bookkeeping


class _FlatSampler:
    """Blocks of constant images without a model: the job's bookkeeping alone."""
    image_shape = (2, 2)

    def sample(self, ids, labels, seed):
        return np.full((len(ids), 2, 2, 3), 9, dtype=np.uint8), {"emitted": len(ids)}

    @staticmethod
    def figures(counts, images):
        return dict(counts)


@pytest.mark.parametrize("n_blocks", [3, 30])
def test_progress_bookkeeping_scans_the_folder_once_whatever_the_blocks(tmp_path, monkeypatch, capsys, n_blocks):
    """One scan of shards/ when the share starts, then O(1) per block: the folder listings do not grow with the
    number of blocks (the bar still counts every image)."""
    folder = SampleFolder(tmp_path / "run")
    folder.prepare({"format": sampling.FORMAT}, resume=False, n=n_blocks, batch=1)
    listings = []
    real_scandir, real_listdir = os.scandir, os.listdir
    monkeypatch.setattr(os, "scandir", lambda path=".": listings.append(str(path)) or real_scandir(path))
    monkeypatch.setattr(os, "listdir", lambda path=".": listings.append(str(path)) or real_listdir(path))
    args = sampling.SampleSettings(str(folder.root), n_blocks, batch=1, classes=[0])
    record = sampling._generate_share(args, sampling.Ranks(), folder, _FlatSampler(), 0, "token")
    assert record["blocks"] == record["images"] == n_blocks
    assert listings == [str(folder.shards)]
    assert f"{n_blocks}/{n_blocks}" in capsys.readouterr().err  # the bar reached every image
    assert folder.done_blocks(n_blocks).all()


# ---------------------------------------------------------------------------------------------- resume checks


def test_resume_names_the_weight_file_whose_contents_changed(tmp_path):
    """config.json holds the sha256 of each weight file; a resume with other contents behind the same path is
    refused, naming the file (checked on a copy of the tiny MAR as an official-format checkpoint)."""
    weights = tmp_path / "weights"
    weights.mkdir()
    from lantern.tiny_mar import TINY_MAR_DIR

    for name in ("mar", "vae"):
        (weights / f"{name}.safetensors").write_bytes((TINY_MAR_DIR / f"{name}.safetensors").read_bytes())
    options = dict(model="mar-checkpoint", mar=str(weights / "mar.safetensors"), mar_name="MAR-tiny",
                   vae=str(weights / "vae.safetensors"), vae_name="KL-tiny", num_sampling_steps="50", num_iter=2,
                   classes=[0], batch=1, no_progress=True)
    sample(tmp_path / "run", 1, **options)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert set(config["sha256"]) == {"mar", "vae"} and len(config["sha256"]["mar"]) == 64
    sample(tmp_path / "run", 1, resume=True, **options)  # the same contents: resumes (complete: gathers again)
    from safetensors.torch import load_file, save_file

    state = load_file(weights / "mar.safetensors")
    key = sorted(state)[0]
    state[key] = state[key] + 1e-3  # the same names and shapes, other numbers
    save_file(state, weights / "mar.safetensors")
    with pytest.raises(SystemExit, match=r"cannot resume it.*the contents of .*weights/mar.safetensors \(mar\) are "
                                         r"not those the folder's run used") as refused:
        sample(tmp_path / "run", 1, resume=True, **options)
    assert "vae.safetensors" not in str(refused.value)


def test_settings_are_compared_key_by_key_through_nested_records(tmp_path):
    """The comparison of config.json is general: a nested record (e.g. the numerics of a run) is compared
    entry by entry and each differing entry named."""
    from lantern.sample_folder import differences

    saved = {"seed": 1, "numerics": {"dtype": "float32", "threads": 2}}
    assert differences(saved, saved) == []
    assert [d.key for d in differences(saved, {"seed": 1, "numerics": {"dtype": "float32", "threads": 1}})] == \
        ["numerics.threads"]
    assert [(d.key, d.saved) for d in differences(saved, {"seed": 1})] == \
        [("numerics.dtype", "float32"), ("numerics.threads", 2)]


def test_damaged_and_foreign_shards_are_named_and_their_blocks_redone(tmp_path, capsys):
    """Resume keeps a shard only when it is a readable block of this run with its PNGs: a truncated shard,
    garbage, another block's shard, images of the wrong size and a deleted PNG each get their block made
    again (named); files that are not this run's shard names are named and ignored."""
    folder = _fake_run(tmp_path / "run", n=12, batch=2)
    settings = json.loads((folder.root / "config.json").read_text())
    whole = folder.shard_path(0).read_bytes()
    folder.shard_path(0).write_bytes(whole[: len(whole) // 2])  # truncated
    folder.shard_path(1).write_bytes(b"not a zip file")  # garbage
    folder.shard_path(2).write_bytes(folder.shard_path(3).read_bytes())  # block 3's ids
    np.savez(folder.shard_path(4), ids=np.arange(8, 10), images=np.zeros((2, 5, 4, 3), np.uint8))  # 5 x 4 images
    folder.png_path(10).unlink()  # block 5's first image
    (folder.shards / "1.npz").write_bytes(b"stray")  # not a shard name of this run
    (folder.shards / "000099.npz").write_bytes(b"stray")  # beyond the run's 6 blocks
    done = folder.prepare(settings, resume=True, n=12, batch=2, image_shape=(4, 4))
    err = capsys.readouterr().err
    assert done == 2 and np.flatnonzero(folder.done_blocks(6)).tolist() == [3]  # block 3 alone was sound
    for name, why in (("000000.npz", "not a readable .npz"), ("000001.npz", "not a readable .npz"),
                      ("000002.npz", r"holds ids \[6, 7\]"), ("000004.npz", r"must be uint8 \[2, 4, 4, 3\]"),
                      ("000010.png", "missing or empty")):
        assert re.search(f"{name}.*{why}.*made again", err), (name, err)
    assert re.search(r"shards/1.npz is not a shard of this run.*ignored", err)
    assert re.search(r"shards/000099.npz is not a shard of this run.*ignored", err)
    assert (folder.shards / "1.npz").exists()  # left to its owner
    assert folder.prepare(settings, resume=True, n=12, batch=2, image_shape=(4, 4)) == 2


def test_resume_redoes_a_truncated_shard_and_a_deleted_png(tmp_path, capsys):
    torch.set_num_threads(1)
    out = tmp_path / "run"
    options = dict(batch=1, seed=3, classes=[2, 7], no_progress=True)
    sample(out, 2, **options)
    before = arr_0(out)
    shard = out / "shards" / "000000.npz"
    shard.write_bytes(shard.read_bytes()[:100])
    (out / "images" / "000001.png").unlink()
    sample(out, 2, resume=True, **options)
    err = capsys.readouterr().err
    assert "000000.npz is not a readable .npz" in err and "000001.png of block 1" in err
    assert np.array_equal(arr_0(out), before)
    run = json.loads((out / "runs" / "run-001.json").read_text())
    assert run["images_this_run"] == 2


# ---------------------------------------------------------------------------------------------- options


@pytest.mark.parametrize("options, message", [
    (dict(seed=-1), r"--seed must be in \[0, 18446744073709551615\], got -1"),
    (dict(seed=2**64), r"--seed must be in \[0, "),
    (dict(top_p=2.0), r"--top-p must be in \(0.0, 1.0\], got 2.0"),
    (dict(top_p=0.0), r"--top-p must be in \(0.0, 1.0\]"),
    (dict(temperature=-1.0), r"--temperature must be in \[0.0, 100.0\]"),
    (dict(temperature=1e-30), "--temperature must be 0 .greedy. or at least"),
    (dict(cfg_scale=float("inf")), "--cfg-scale must be a finite number"),
    (dict(cfg_scale=float("nan")), "--cfg-scale must be a finite number"),
    (dict(top_k=-1), r"--top-k must be in \[0, "),
    (dict(cfg_interval=-2), r"--cfg-interval must be in \[-1, "),
    (dict(batch=10**6), r"--batch must be in \[1, 65536\]"),
    (dict(num_images=10**8 + 1), r"--num-images must be in \[1, 100000000\]"),
    (dict(method="lantern", tree="chain", delta=1.5), r"--delta must be in \[0.0, 1.0\]"),
    (dict(method="lantern", tree="chain", lam=0.5), r"--lam must be in \[1.0, "),
    (dict(method="lantern", tree="chain", k=-1), r"--k must be in \[0, "),
    (dict(method="lantern", tree="chain", depth=0), r"--depth must be in \[1, "),
    (dict(method="sjd", tree="chain", window=0), r"--window must be in \[1, "),
    (dict(model="tiny-mar", num_iter=-5), r"--num-iter must be in \[1, "),
    (dict(model="tiny-mar", num_iter=0), r"--num-iter must be in \[1, "),
    (dict(model="tiny-mar", temperature=0.0), r"--temperature must be a number in \(0, 1000\] for MAR"),
    (dict(model="tiny-mar", method="cspd", gamma=0), r"--gamma must be in \[1, "),
    (dict(model="tiny-mar", method="cspd", prefill=1.0), r"--prefill must be in \[0.0, 1.0\)"),
    (dict(fused="fastest"), "--fused must be one of"),
    (dict(fused="cpu", device="meta"), "--fused cpu runs on cpu tensors, not on --device meta"),
    (dict(threads=0), r"--threads must be in \[1, 1024\], got 0"),
    (dict(threads=1025), r"--threads must be in \[1, 1024\], got 1025"),
    (dict(device="gpu:7"), "--device 'gpu:7' is not a device"),
])
def test_sampling_settings_are_refused_before_anything_is_written(tmp_path, options, message):
    out = tmp_path / "new" / "run"
    n = options.pop("num_images", 2)
    with pytest.raises(SystemExit, match=message):
        sample(out, n, no_progress=True, **options)
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("options, message", [
    (dict(method="lantern", tree="chain", k=5000), "--k must be at most 1023 for this model"),
    (dict(model="tiny-mar", num_iter=65), "--num-iter must be at most the image's 64 tokens"),
    (dict(classes=[3, 10]), r"--classes must be class ids in \[0, 10\)"),
])
def test_settings_bounded_by_the_model_are_refused_before_any_run_file(tmp_path, options, message):
    """Bounds that need the model are checked once it is loaded, before config.json or any image."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit, match=message):
        sample(out, 2, no_progress=True, **options)
    assert sorted(p.name for p in out.iterdir()) == [sampling.LOCK_FILE]


@pytest.mark.parametrize("model, files", [("checkpoint", ("gpt", "vq")), ("mar-checkpoint", ("mar", "vae"))])
def test_an_unreadable_checkpoint_gets_a_message_naming_it(tmp_path, model, files):
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(SystemExit, match=f"the {model} model cannot be loaded .*--{files[0]} .*garbage.pth.*Error"):
        sample(tmp_path / "run", 1, model=model, no_progress=True, **{name: str(garbage) for name in files})
    assert not (tmp_path / "run" / "config.json").exists()


def test_cli_refuses_bad_settings_before_writing(tmp_path):
    from lantern.cli import main

    for flags, message in ((["--seed", "-1"], "--seed must be in"), (["--cfg-scale", "inf"], "--cfg-scale must be a "
                           "finite"), (["--top-p", "2"], "--top-p must be in"), (["--temperature", "-1"],
                           "--temperature must be in")):
        with pytest.raises(SystemExit, match=message):
            main(["sample", str(tmp_path / "run"), "--num-images", "2", *flags])
        assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("steps", ["abc", "0", "-3", "5000", ""])
def test_num_sampling_steps_is_checked_before_the_checkpoint_is_read(tmp_path, steps):
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"not a checkpoint")  # reading it would fail with another message
    with pytest.raises(SystemExit, match=r"--num-sampling-steps must be an int in \[1, 1000\]"):
        sample(tmp_path / "run", 2, model="mar-checkpoint", mar=str(garbage), vae=str(garbage),
               num_sampling_steps=steps, no_progress=True)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("options, error, message", [
    (dict(batch=2.5), TypeError, "sample\\(\\): batch must be an int, got float 2.5"),
    (dict(classes=[1.5]), TypeError, "sample\\(\\): classes must be an int, got float 1.5"),
    (dict(classes=3), TypeError, "sample\\(\\): classes must be a list"),
    (dict(classes=[]), SystemExit, "--classes must hold between 1 and"),
    (dict(resume="no"), TypeError, "sample\\(\\): resume must be True or False, got 'no'"),
    (dict(seed=True), TypeError, "sample\\(\\): seed must be an int, got bool"),
    (dict(threads=2.5), TypeError, "sample\\(\\): threads must be an int, got float 2.5"),
    (dict(temperature="1"), TypeError, "sample\\(\\): temperature must be a number"),
    (dict(method="bogus"), ValueError, "sample\\(\\): method must be one of"),
    (dict(num_images="4"), TypeError, "sample\\(\\): num_images must be an int"),
    (dict(seed=None), TypeError, "sample\\(\\): seed cannot be None"),
])
def test_the_api_checks_its_options_as_the_cli_does(tmp_path, options, error, message):
    n = options.pop("num_images", 2)
    with pytest.raises(error, match=message):
        sample(tmp_path / "run", n, no_progress=True, **options)
    assert not (tmp_path / "run").exists()


def test_numpy_integers_and_paths_are_accepted_as_the_cli_would_read_them(tmp_path):
    from lantern.sample_settings import check_value

    assert check_value("batch", np.int64(4)) == 4
    assert check_value("classes", (np.int32(1), 2)) == [1, 2]
    assert check_value("out", tmp_path) == str(tmp_path)
    assert check_value("cfg_scale", 2) == 2.0
    # compile as lantern.generate takes it, or as the CLI spells it
    assert [check_value("compile", v) for v in (True, False, "auto", "off")] == \
        ["on", "off", "auto", "off"]
    with pytest.raises(ValueError, match="compile must be one of"):
        check_value("compile", "yes")


# ---------------------------------------------------------------------------------------------- the folder's layout


@pytest.fixture()
def finished_run(small_run, tmp_path):
    """A copy of a finished run that a test may damage."""
    copy = tmp_path / "copy"
    shutil.copytree(small_run, copy)
    return copy


SMALL = dict(batch=2, seed=1, no_progress=True)


@pytest.mark.parametrize("damage, message", [
    (lambda d: ((d / "images").rename(d / "moved"), (d / "images").write_text("x")), "images is not a folder"),
    (lambda d: ((d / "runs").rename(d / "moved"), (d / "runs").write_text("x")), "runs is not a folder"),
    (lambda d: ((d / "samples.npz").unlink(), (d / "samples.npz").mkdir()), "samples.npz is not a regular file"),
    (lambda d: (shutil.rmtree(d / "shards"), (d / "shards").symlink_to("/proc/self")), "shards cannot be written"),
    (lambda d: (d / "config.json").write_text("[1, 2]"), "holds a JSON list, not the settings object"),
    (lambda d: (d / "config.json").write_text("{garbage"), "cannot be read as JSON"),
    (lambda d: (d / "config.json").write_text("[" * 100000 + "]" * 100000), "cannot be read as JSON"),
    (lambda d: ((d / "config.json").unlink(), (d / "config.json").mkdir()), "config.json is not a regular file"),
])
def test_a_damaged_folder_is_refused_by_name_before_any_block(finished_run, damage, message):
    (finished_run / "shards" / "000000.npz").unlink()  # a block to make, if it got that far
    damage(finished_run)
    with pytest.raises(SystemExit, match=message):
        sample(finished_run, 2, resume=True, **SMALL)
    assert not (finished_run / "shards" / "000000.npz").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
@pytest.mark.parametrize("name", ["images", "shards", "runs"])
def test_a_read_only_subfolder_is_refused_before_any_block(finished_run, name):
    (finished_run / "shards" / "000000.npz").unlink()
    (finished_run / name).chmod(0o555)
    try:
        with pytest.raises(SystemExit, match=f"{name} cannot be written"):
            sample(finished_run, 2, resume=True, **SMALL)
    finally:
        (finished_run / name).chmod(0o755)
    assert not (finished_run / "shards" / "000000.npz").exists()


def test_a_temporary_folder_in_dir_is_named_and_left_alone(finished_run, capsys):
    (finished_run / ".tmp-x").mkdir()
    (finished_run / "shards" / ".tmp-stale").write_bytes(b"PK")  # a killed run's: removed by the lock holder
    sample(finished_run, 2, resume=True, **SMALL)
    assert ".tmp-x is not a file lantern wrote" in capsys.readouterr().err
    assert (finished_run / ".tmp-x").is_dir() and not (finished_run / "shards" / ".tmp-stale").exists()


def test_an_empty_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for out in ("", " "):
        with pytest.raises(SystemExit, match="DIR must name the output folder"):
            sample(out, 2, no_progress=True)
    proc = subprocess.run([sys.executable, "-m", "lantern", "sample", "", "--num-images", "2"], capture_output=True,
                          text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert proc.returncode != 0 and "DIR must name the output folder" in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_files_are_written_atomically_with_the_users_umask(tmp_path):
    previous = os.umask(0o027)
    try:
        folder = _fake_run(tmp_path / "run", n=2, batch=2)
        folder.gather(2, 2)
    finally:
        os.umask(previous)
    written = [folder.root / "config.json", folder.root / "samples.npz", folder.shard_path(0), folder.png_path(1)]
    assert [oct(p.stat().st_mode & 0o777) for p in written] == [oct(0o640)] * len(written)
    leftovers = [p for p in folder.root.rglob(".tmp-*")]
    assert leftovers == []


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
    with pytest.raises(SystemExit, match="has no array 'arr_0'"):
        main(["eval", npz, "--metrics", "inception", "--reference", str(no_arr)])
    with pytest.raises(SystemExit, match="--inception PATH is needed.*never downloads"):
        main(["eval", npz, "--metrics", "inception", "--reference", npz])
    with pytest.raises(SystemExit, match="--inception .*is not a file"):
        main(["eval", npz, "--metrics", "inception", "--reference", npz, "--inception", str(tmp_path / "w.pth")])
    pickled = tmp_path / "code.pth"
    pickled.write_bytes(pickle.dumps(os.getcwd))  # not a plain state dict: weights_only refuses it
    with pytest.raises(SystemExit, match="cannot be read as a weights file"):
        main(["eval", npz, "--metrics", "inception", "--reference", npz, "--inception", str(pickled)])
    with pytest.raises(SystemExit, match="samples: .*stats.npz has no array 'arr_0'"):
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


def _npz_claiming(path, shape):
    """An .npz whose arr_0 header declares uint8 ``shape`` but which holds 12 bytes of data."""
    import io
    import zipfile

    member = io.BytesIO()
    np.lib.format.write_array_header_1_0(member, {"descr": "|u1", "fortran_order": False, "shape": shape})
    member.write(b"x" * 12)
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("arr_0.npy", member.getvalue())


def test_eval_refuses_damaged_npz_files_by_name(small_run, tmp_path):
    """Truncated, lying about its size (refused from the header, before anything is allocated), pickled objects,
    not uint8 images: each a message naming the file, never a traceback."""
    from lantern.cli import main

    npz = small_run / sampling.NPZ_FILE
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(npz.read_bytes()[:300])
    huge = tmp_path / "huge.npz"
    _npz_claiming(huge, (10**9, 256, 256, 3))
    objects = tmp_path / "objects.npz"
    np.savez(objects, arr_0=np.array([{"a": 1}], dtype=object))
    floats = tmp_path / "floats.npz"
    np.savez(floats, arr_0=np.zeros((2, 4, 4, 3)))
    for path, message in ((truncated, "truncated.npz is not a readable .npz"),
                          (huge, r"huge.npz: arr_0 declares uint8 \[1000000000, 256, 256, 3\]"),
                          (objects, "objects.npz: arr_0 holds Python objects"),
                          (floats, r"floats.npz: arr_0 must be uint8 \[N, H, W, 3\] images")):
        with pytest.raises(SystemExit, match=message):
            main(["eval", str(path), "--classes", "1"])
        with pytest.raises(SystemExit, match="--reference: .*" + message.split(" ", 1)[1]):
            main(["eval", str(npz), "--metrics", "inception", "--reference", str(path)])


def test_eval_refuses_a_folder_whose_config_is_not_a_settings_object(finished_run):
    from lantern.cli import main

    (finished_run / "config.json").write_text('["tiny"]')
    with pytest.raises(SystemExit, match="holds a JSON list, not the settings object"):
        main(["eval", str(finished_run)])
    (finished_run / "config.json").write_text('{"model": "tiny", "classes": [1.5]}')
    with pytest.raises(SystemExit, match="classes must be a non-empty list of class ids"):
        main(["eval", str(finished_run)])


def test_eval_checks_its_numbers(small_run):
    from lantern.cli import main

    for flags, message in ((["--batch", "0"], r"--batch must be in \[1, "), (["--classes", "-1"], "--classes must be "
                           "class ids >= 0"), (["--device", "gpu:9"], "is not a device"),
                           (["--classes", "10"], "classes must be ids of the tiny models' 10 classes")):
        with pytest.raises(SystemExit, match=message):
            main(["eval", str(small_run / sampling.NPZ_FILE), "--metrics", "tiny", *flags])


def test_eval_names_an_inception_file_with_other_tensors_briefly(small_run, tmp_path):
    """torch's own error lists every key (~20 KB); the checked extractor says what is wrong in a few lines."""
    pytest.importorskip("torch_fidelity")
    from lantern.cli import main

    wrong = tmp_path / "wrong.pth"
    torch.save({"conv.weight": torch.zeros(2, 2)}, wrong)
    npz = str(small_run / sampling.NPZ_FILE)
    with pytest.raises(SystemExit) as refused:
        main(["eval", npz, "--metrics", "inception", "--reference", npz, "--inception", str(wrong), "--device", "cpu"])
    message = str(refused.value)
    assert "not Inception-v3's weights" in message and "missing tensors" in message
    assert "1 unexpected tensors, e.g. ['conv.weight']" in message and len(message) < 1000


def test_the_checked_npz_reader_reads_what_np_load_reads(tmp_path):
    from lantern.npz_io import open_npz, read_member

    arrays = dict(c=np.arange(24, dtype=np.int64).reshape(2, 3, 4), f=np.asfortranarray(np.ones((3, 5)) * 2.5),
                  big=np.arange(6, dtype=">i4"), empty=np.zeros((0, 3), np.uint8))
    for save in (np.savez, np.savez_compressed):
        path = tmp_path / f"{save.__name__}.npz"
        save(path, **arrays)
        with open_npz(path) as zf, np.load(path) as reference:
            for name in arrays:
                got = read_member(zf, name)
                assert got.dtype == reference[name].dtype and np.array_equal(got, reference[name])


def test_a_shard_damaged_inside_is_found_by_the_gather_and_removed(tmp_path):
    """A flipped byte in a shard's pixels passes the header checks; the gather reads every byte (zip CRC),
    names the shard and removes it so --resume makes its block again, and writes no samples.npz."""
    folder = _fake_run(tmp_path / "run", n=4, batch=2)
    data = bytearray(folder.shard_path(1).read_bytes())
    at = data.rindex(b"\x01\x01\x01")  # inside block 1's pixels (all 1)
    data[at] = 0
    folder.shard_path(1).write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match=r"000001.npz: images cannot be read .*CRC.*removed: --resume makes "
                                           r"block 1 again"):
        folder.gather(4, 2)
    assert not folder.shard_path(1).exists() and not (folder.root / "samples.npz").exists()
