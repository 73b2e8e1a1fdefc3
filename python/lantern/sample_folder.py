"""The folder of a `lantern sample` run (docs/sampling.md "The folder"): its lock, config.json, the shards and
PNGs of the blocks, the run records and the final samples.npz.

Rank 0 holds the folder's lock (``flock`` on DIR/.lock) from before the model is loaded until the run ends;
everything that removes or rewrites a file another run could be writing (stale temporary files, damaged
shards, config.json) happens under it."""
from __future__ import annotations

import json
import os
import re
import socket
import stat
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import List, NamedTuple, Optional, Tuple

import numpy as np
import torch

from .npz_io import NpzError, images_check, open_npz, read_member
from .outputs import TMP_PREFIX, atomic_write

FORMAT = 4  # of config.json and the folder layout (2: discrete images keyed by image id; 4: the numerics record)
CONFIG_FILE, IMAGES, SHARDS, RUNS, NPZ_FILE, LOCK_FILE = "config.json", "images", "shards", "runs", "samples.npz", \
    ".lock"
MAX_CONFIG_BYTES = 1 << 20
_SHARD_NAME = re.compile(r"^(\d{6,})\.npz$")
_RUN_NAME = re.compile(r"^run-(\d+)\.json$")


def block_ids(j: int, n: int, batch: int) -> torch.Tensor:
    """The image ids of block j: [j * batch, min((j + 1) * batch, n)) as int64."""
    return torch.arange(j * batch, min((j + 1) * batch, n), dtype=torch.int64)


def block_count(n: int, batch: int) -> int:
    return -(-n // batch)


def images_in(done: np.ndarray, n: int, batch: int) -> int:
    """Images held by the blocks marked in ``done`` (bool [blocks]): every block has ``batch`` but the last."""
    if not len(done):
        return 0
    last_short = batch - (n - (len(done) - 1) * batch)
    return int(done.sum()) * batch - (last_short if done[-1] else 0)


def warn(message: str) -> None:
    print(f"lantern sample: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------- config.json


def read_config(path) -> Optional[dict]:
    """A run folder's config.json -> its settings, or None when there is none. SystemExit naming the file
    unless it is a regular file of at most 1 MiB holding a JSON object."""
    path = Path(path)
    if not os.path.lexists(path):
        return None
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode):
            raise SystemExit(f"{path} is not a regular file; give a new folder")
        if info.st_size > MAX_CONFIG_BYTES:
            raise SystemExit(f"{path} holds {info.st_size} bytes, more than a lantern sample config "
                             f"({MAX_CONFIG_BYTES} at most); give a new folder")
        settings = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as e:
        raise SystemExit(f"{path} cannot be read as JSON ({type(e).__name__}: {e}); give a new folder") from e
    if not isinstance(settings, dict):
        raise SystemExit(f"{path} holds a JSON {type(settings).__name__}, not the settings object of a lantern "
                         f"sample run; give a new folder")
    return settings


class Difference(NamedTuple):
    key: str  # dotted for nested settings: "sha256.gpt"
    saved: object  # the folder's run's value (MISSING when unset)
    now: object


MISSING = "<unset>"


def flatten(settings: dict, prefix: str = "") -> dict:
    """Nested settings as one level of dotted keys ({"sha256": {"gpt": h}} -> {"sha256.gpt": h})."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            flat.update(flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def differences(saved: dict, now: dict) -> List[Difference]:
    """Every setting whose value differs between the two, key by key (nested dicts compared entry by entry)."""
    a, b = flatten(saved), flatten(now)
    return [Difference(key, a.get(key, MISSING), b.get(key, MISSING)) for key in sorted(set(a) | set(b))
            if a.get(key, MISSING) != b.get(key, MISSING)]


def describe(difference: Difference, now: dict) -> str:
    """One line for a refusal message. A weight file's digest names the file."""
    key, saved, new = difference
    if key.startswith("sha256.") and new is not MISSING and saved is not MISSING:
        name = key.split(".", 1)[1]
        if "hf" in now:  # a transformers model directory: the digests are of its files
            path = os.path.join(now["hf"], name)
        else:
            path = now.get(name) or f"the shipped {now.get('model')} model's {name} weights"
        return (f"the contents of {path} ({name}) are not those the folder's run used (sha256 {str(saved)[:12]}... "
                f"then, {str(new)[:12]}... now)")
    return f"{key} (the folder's run: {saved!r}, now: {new!r})"


# ---------------------------------------------------------------------------------------------- the folder


class SampleFolder:
    """DIR's files (module docstring, docs/sampling.md)."""

    def __init__(self, root):
        self.root = Path(root)
        self.images, self.shards, self.runs = self.root / IMAGES, self.root / SHARDS, self.root / RUNS
        self._lock_fd: Optional[int] = None

    # ------------------------------------------------------------------ before the model is loaded (rank 0)

    def check_writable(self) -> None:
        """SystemExit naming DIR unless it is (or can be made) a folder that takes new files."""
        if self.root.exists() and not self.root.is_dir():
            raise SystemExit(f"output folder {str(self.root)!r} is a file; give a folder")
        parent = self.root if self.root.exists() else self.root.parent
        while not parent.exists():
            parent = parent.parent
        if not parent.is_dir():
            raise SystemExit(f"output folder {str(self.root)!r} cannot be made: {parent} is a file")
        reason = _unwritable(parent)
        if reason:
            raise SystemExit(f"output folder {str(self.root)!r} cannot be written ({parent}: {reason})")

    def lock(self) -> None:
        """Create DIR and take its lock (held until unlock() or the process ends). SystemExit naming DIR when
        another run holds it."""
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise SystemExit(f"output folder {str(self.root)!r} cannot be made ({e.strerror or e})") from e
        path = self.root / LOCK_FILE
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            fd = os.open(path, flags, 0o666)
        except OSError as e:
            raise SystemExit(f"{path}, the folder's lock file, cannot be opened ({e.strerror or e})") from e
        try:
            self._take(fd, path)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def _take(self, fd: int, path: Path) -> None:
        import fcntl

        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SystemExit(f"{path}, the folder's lock file, is not a regular file; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            raise SystemExit(f"output folder {str(self.root)!r} is in use by another lantern sample run ({holder}); "
                             f"wait for it to end (or stop it) before starting or resuming a run there") from None
        except OSError as e:
            raise SystemExit(f"output folder {str(self.root)!r} cannot be locked ({e.strerror or e}); lantern "
                             f"sample needs a file system with flock") from e
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def check_layout(self) -> None:
        """SystemExit naming the entry unless DIR is new, empty (but for the lock) or holds a readable
        config.json, and images/, shards/, runs/ (where they exist) are writable folders and samples.npz is not
        a folder. Writes nothing (run before taking the lock, and again holding it)."""
        if not self.root.exists():
            return
        if read_config(self.root / CONFIG_FILE) is None:
            others = sorted(name for name in os.listdir(self.root) if name != LOCK_FILE)
            if others:
                raise SystemExit(f"output folder {str(self.root)!r} is not empty and holds no {CONFIG_FILE} of a "
                                 f"lantern sample run (it holds {others[:5]}); give a new or empty folder")
        for folder in (self.images, self.shards, self.runs):
            if os.path.lexists(folder):
                self._check_subfolder(folder)
        npz = self.root / NPZ_FILE
        if os.path.lexists(npz) and not npz.is_file():
            raise SystemExit(f"{npz} is not a regular file (lantern sample writes its images there); remove it")

    @staticmethod
    def _check_subfolder(folder: Path) -> None:
        if not folder.is_dir():
            raise SystemExit(f"{folder} is not a folder (lantern sample keeps its {folder.name} there); remove it "
                             f"or give a new folder")
        reason = _unwritable(folder)
        if reason:
            raise SystemExit(f"{folder} cannot be written ({reason}); lantern sample keeps its {folder.name} there")

    # ------------------------------------------------------------------ after the model is loaded (rank 0, locked)

    def prepare(self, settings: dict, resume: bool, n: int, batch: int,
                image_shape: Optional[Tuple[int, int]] = None) -> int:
        """Check DIR against ``settings`` (docs/sampling.md "Resume"), create its folders and config, remove
        temporary files a killed run left and, on resume, every shard that is damaged or whose PNGs are gone
        (so its block is made again). -> images already done. SystemExit when DIR holds another run, or any
        run without ``resume``."""
        saved = read_config(self.root / CONFIG_FILE)
        if saved is not None:
            self._refuse_unless_resumable(saved, settings, resume, n, batch)
        self.root.mkdir(parents=True, exist_ok=True)
        if saved is None:  # first, so that DIR never holds run files without it
            text = json.dumps(settings, indent=2, sort_keys=True, allow_nan=False) + "\n"
            atomic_write(self.root / CONFIG_FILE, lambda f: f.write(text.encode()))
        for folder in (self.images, self.shards, self.runs):
            folder.mkdir(exist_ok=True)
            self._check_subfolder(folder)
        self._remove_stale_temporaries()
        if saved is not None:
            self._redo_damaged_blocks(n, batch, image_shape)
        return images_in(self.done_blocks(block_count(n, batch)), n, batch)

    def _refuse_unless_resumable(self, saved: dict, settings: dict, resume: bool, n: int, batch: int) -> None:
        differing = differences(saved, settings)
        if differing:
            verb = "cannot resume it" if resume else "refusing to write into it"
            raise SystemExit(f"output folder {str(self.root)!r} holds a run with other settings; {verb}. "
                             f"Differing: {'; '.join(describe(d, settings) for d in differing)}. Give a new "
                             f"folder, or the run's settings")
        if not resume:
            done = int(self.done_blocks(block_count(n, batch)).sum())
            raise SystemExit(f"output folder {str(self.root)!r} already holds this run ({done} blocks done); "
                             f"pass --resume to continue it, or give a new folder")

    def _remove_stale_temporaries(self) -> None:
        """The temporary files (.tmp-*) a killed run left; anything else by that name is left alone, named."""
        for folder in (self.root, self.images, self.shards, self.runs):
            with os.scandir(folder) as entries:
                for entry in entries:
                    if not entry.name.startswith(TMP_PREFIX):
                        continue
                    if entry.is_file(follow_symlinks=False) or entry.is_symlink():
                        os.unlink(entry.path)
                    else:
                        warn(f"{entry.path} is not a file lantern wrote (a folder or a special file); left alone")

    def _redo_damaged_blocks(self, n: int, batch: int, image_shape) -> None:
        """Resume: a shard is kept only when it is this run's block, readable, with the right ids and images,
        and each of its PNGs is there; any other is removed (named) so its block is made again. Other files in
        shards/ are named and ignored."""
        n_blocks = block_count(n, batch)
        with os.scandir(self.shards) as entries:
            for entry in entries:
                j = _block_of(entry.name, n_blocks)
                if j is None or not entry.is_file(follow_symlinks=False):
                    if not entry.name.startswith(TMP_PREFIX):
                        warn(f"{entry.path} is not a shard of this run (shards are 000000.npz .. "
                             f"{n_blocks - 1:06d}.npz, regular files); ignored")
                    continue
                problem = self.shard_problem(j, n, batch, image_shape)
                if problem:
                    warn(f"{problem}; block {j} will be made again")
                    os.unlink(entry.path)

    def shard_problem(self, j: int, n: int, batch: int, image_shape=None, full: bool = False) -> Optional[str]:
        """None when shard j holds block j (ids, uint8 images [b, H, W, 3]) and its PNGs exist, else what is
        wrong, naming the file. Reads the ids and the images' header (``full``: the images too, CRC-checked)."""
        ids = block_ids(j, n, batch).numpy()
        path = self.shard_path(j)
        try:
            arrays = read_shard(path, len(ids), image_shape, full)
        except NpzError as e:
            return str(e)
        if not np.array_equal(arrays["ids"], ids):
            return f"{path} holds ids {arrays['ids'][:8].tolist()}..., not block {j}'s {ids[:8].tolist()}..."
        for image_id in ids.tolist():
            png = self.png_path(image_id)
            if not png.is_file() or png.stat().st_size == 0:
                return f"{png} of block {j} ({path.name}) is missing or empty"
        return None

    def done_blocks(self, n_blocks: int) -> np.ndarray:
        """bool [n_blocks]: the blocks whose shard exists (written last and atomically: the block is complete).
        One scan of shards/; only this run's shard names count."""
        done = np.zeros(n_blocks, dtype=bool)
        if not self.shards.is_dir():
            return done
        with os.scandir(self.shards) as entries:
            for entry in entries:
                j = _block_of(entry.name, n_blocks)
                if j is not None and entry.is_file(follow_symlinks=False):
                    done[j] = True
        return done

    def png_path(self, image_id: int) -> Path:
        return self.images / f"{image_id:06d}.png"

    def shard_path(self, j: int) -> Path:
        return self.shards / f"{j:06d}.npz"

    def write_block(self, j: int, ids: torch.Tensor, pixels: np.ndarray) -> None:
        """pixels uint8 [b, H, W, 3] of ids [b]: each PNG, then the shard (atomically, each)."""
        from PIL import Image

        for image_id, picture in zip(ids.tolist(), pixels):
            atomic_write(self.png_path(image_id), lambda f, p=picture: Image.fromarray(p).save(f, format="PNG"))
        ids_np = ids.numpy().astype(np.int64)
        atomic_write(self.shard_path(j), lambda f: np.savez(f, ids=ids_np, images=pixels))

    # ------------------------------------------------------------------ the end (rank 0, locked)

    def gather(self, n: int, batch: int, image_shape: Optional[Tuple[int, int]] = None) -> Path:
        """Check that every block's shard and each PNG is there, then write samples.npz (arr_0 uint8 [n, H, W,
        3] in id order) one shard at a time, atomically, checking each shard as it is read. A shard found
        damaged is removed (so --resume makes its block again) and named in the RuntimeError. -> the path."""
        n_blocks = block_count(n, batch)
        missing = np.flatnonzero(~self.done_blocks(n_blocks))
        if missing.size:
            raise RuntimeError(f"{missing.size} of {n_blocks} blocks have no shard in {self.shards}, e.g. blocks "
                               f"{missing[:10].tolist()}; --resume makes them")
        self._check_pngs(n)
        if image_shape is None:
            shape = read_shard(self.shard_path(0), len(block_ids(0, n, batch)))["images"]
            image_shape = shape[1:3]
        path = self.root / NPZ_FILE
        atomic_write(path, lambda f: self._write_npz(f, n, batch, tuple(image_shape)))
        return path

    def _check_pngs(self, n: int) -> None:
        absent, first = 0, []
        for i in range(n):
            if not self.png_path(i).is_file():
                absent += 1
                if len(first) < 10:
                    first.append(i)
        if absent:
            raise RuntimeError(f"{absent} PNG files are missing, e.g. ids {first}")

    def _write_npz(self, f, n: int, batch: int, image_shape: Tuple[int, int]) -> None:
        """np.savez's layout (a stored zip member arr_0.npy), streamed one shard at a time."""
        header = {"descr": np.lib.format.dtype_to_descr(np.dtype(np.uint8)), "fortran_order": False,
                  "shape": (n, *image_shape, 3)}
        with zipfile.ZipFile(f, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            with zf.open("arr_0.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, header)
                for j in range(block_count(n, batch)):
                    member.write(self._checked_images(j, n, batch, image_shape).tobytes())

    def _checked_images(self, j: int, n: int, batch: int, image_shape) -> np.ndarray:
        ids = block_ids(j, n, batch).numpy()
        path = self.shard_path(j)
        try:
            arrays = read_shard(path, len(ids), image_shape, full=True)
        except NpzError as e:
            path.unlink()
            raise RuntimeError(f"{e}; the shard was removed: --resume makes block {j} again") from e
        if not np.array_equal(arrays["ids"], ids):
            path.unlink()
            raise RuntimeError(f"{path} holds ids {arrays['ids'][:8].tolist()}..., not block {j}'s "
                               f"{ids[:8].tolist()}...; the shard was removed: --resume makes block {j} again")
        return np.ascontiguousarray(arrays["images"])

    def write_run(self, record: dict) -> Path:
        """runs/run-<k>.json, k = one more than the highest k there (0 for the first run)."""
        from .outputs import finite_or_none

        taken = [int(m.group(1)) for m in map(_RUN_NAME.match, os.listdir(self.runs)) if m]
        path = self.runs / f"run-{max(taken, default=-1) + 1:03d}.json"
        text = json.dumps(finite_or_none(record), indent=2, allow_nan=False) + "\n"
        atomic_write(path, lambda f: f.write(text.encode()))
        return path


def read_shard(path: Path, b: int, image_shape=None, full: bool = False) -> dict:
    """A shard's arrays, checked before anything is allocated: ids int64 [b] and images uint8 [b, H, W, 3]
    (H, W = image_shape when given). ``full``: {"ids": array, "images": array}; else the images' header only,
    {"ids": array, "images": their shape}. NpzError naming the file."""
    def ids_check(header):
        shape, dtype = header
        return None if dtype == np.int64 and shape == (b,) else f"must be int64 [{b}], got {dtype} {list(shape)}"

    with open_npz(path) as zf:
        if sorted(zf.namelist()) != ["ids.npy", "images.npy"]:
            raise NpzError(f"{path} must hold the arrays ids and images only, it holds {zf.namelist()}")
        ids = read_member(zf, "ids", ids_check)
        images = read_member(zf, "images", images_check(size=image_shape, count=b), header_only=not full)
    return {"ids": ids, "images": images if full else images[0]}


def _block_of(name: str, n_blocks: int) -> Optional[int]:
    """j when ``name`` is shard j's file name (six digits or more, no leading zero beyond them) and j < n_blocks."""
    m = _SHARD_NAME.match(name)
    if not m:
        return None
    j = int(m.group(1))
    return j if j < n_blocks and name == f"{j:06d}.npz" else None


def _unwritable(folder: Path) -> Optional[str]:
    """None when a new file can be made in ``folder`` (it is removed at once), else the reason."""
    try:
        with tempfile.TemporaryFile(dir=folder):
            return None
    except OSError as e:
        return str(e.strerror or e)


def digest(path) -> str:
    """sha256 of a file's contents (hex), read in 1 MiB pieces."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        for piece in iter(lambda: f.read(1 << 20), b""):
            h.update(piece)
    return h.hexdigest()


__all__ = ["FORMAT", "CONFIG_FILE", "IMAGES", "SHARDS", "RUNS", "NPZ_FILE", "LOCK_FILE", "SampleFolder",
           "read_config", "read_shard", "differences", "describe", "flatten", "digest", "block_ids", "block_count",
           "images_in"]
