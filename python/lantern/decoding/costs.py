"""The planner's cost model: seconds per decoding step for each plan against the row count, measured on the
device by a short calibration and cached on disk.

One point is a whole step of the real loop (drafter catch-up and tree growth, the target forward over
rows x nodes tokens, verify, compaction and bookkeeping), timed on a fresh decoding state; between the
measured row counts the time is interpolated linearly, past the largest one extrapolated along the last
segment (time grows linearly with the tokens per forward once the device is busy).

The cache is one small JSON file per (device, target and drafter fingerprints, dtype, threads, sampling
mode) under ``lantern.neighbours.cache_dir()``. A file is measured again when stale (another format, torch
version or fused backend, or older than ``MAX_AGE_DAYS``) or corrupt (with a warning; never trusted).

The cache is only a shortcut and never a reason to fail. A reader takes only a regular file of at most
``MAX_FILE_BYTES``: it does not follow a symbolic link and does not block on a FIFO. The whole schema is
checked: every type, rows in [1, ``MAX_ROWS``], seconds in [``MIN_STEP_S``, ``MAX_STEP_S``], an AR entry, and
acceptance rates in [0, 1). Anything else is reported as corrupt (a RuntimeWarning) and measured again.
A write goes to a new ``tempfile.mkstemp`` file beside the entry (the user's umask applies), which then
replaces the entry. A failed write (a read-only folder, ``LANTERN_CACHE`` naming a file) warns, and the
run uses its measurement.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import platform
import re
import stat
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

from .planner import checked_rates

FORMAT = 2
MAX_AGE_DAYS = 30
MAX_FILE_BYTES = 4 << 20  # a cache file holds tens of points per plan: a few KB
# A step's seconds are bounded because the planner divides tokens by them. No decoding step (a forward)
# takes under 100 ns, and none takes hours.
MIN_STEP_S, MAX_STEP_S = 1e-7, 1e4
MAX_ROWS = 2**31 - 1


class CostModel:
    """points[plan name] = {rows: seconds per step}; acceptance[family] = the chain-equivalent acceptance per
    draft level that the calibration's steps measured on these models (``planner.FAMILIES``; a Jacobi window
    also has its own levels' rates under its name; the planner's prior, ``planner.AcceptanceModel``), or
    empty."""

    def __init__(self, points: Mapping[str, Mapping[int, float]], meta: Optional[dict] = None,
                 acceptance: Optional[Mapping[str, List[float]]] = None):
        self.points: Dict[str, Dict[int, float]] = {}
        for name, by_rows in points.items():
            if not by_rows:
                raise ValueError(f"cost model: plan {name!r} has no measured point")
            clean = {}
            for rows, seconds in by_rows.items():
                if not 1 <= int(rows) <= MAX_ROWS or not MIN_STEP_S <= float(seconds) <= MAX_STEP_S:
                    raise ValueError(f"cost model: plan {name!r} needs rows in [1, {MAX_ROWS}] and seconds in "
                                     f"[{MIN_STEP_S}, {MAX_STEP_S}], got {rows} rows, {seconds} s")
                clean[int(rows)] = float(seconds)
            self.points[name] = dict(sorted(clean.items()))
        self.meta = dict(meta or {})
        self.acceptance: Dict[str, List[float]] = checked_rates("cost model: acceptance", acceptance)

    def knows(self, plan_name: str) -> bool:
        return plan_name in self.points

    def step_seconds(self, plan_name: str, rows: int) -> float:
        """Predicted seconds of one step of ``plan_name`` over ``rows`` rows (linear between points,
        the last segment's slope (never negative) past the largest, the smallest point's time below it)."""
        pts = list(self.points[plan_name].items())
        if rows <= pts[0][0] or len(pts) == 1:
            if len(pts) == 1 and rows > pts[0][0]:
                return pts[0][1] * rows / pts[0][0]  # one point: proportional to the rows (pessimistic)
            return pts[0][1]
        for (r0, t0), (r1, t1) in zip(pts, pts[1:]):
            if rows <= r1:
                return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
        (r0, t0), (r1, t1) = pts[-2], pts[-1]
        return t1 + max(t1 - t0, 0.0) / (r1 - r0) * (rows - r1)

    def to_json(self) -> dict:
        return {"format": FORMAT, "meta": self.meta, "acceptance": self.acceptance,
                "points": {name: {str(r): s for r, s in pts.items()} for name, pts in self.points.items()}}

    @classmethod
    def from_json(cls, data) -> "CostModel":
        """The model a cache file holds; a ValueError naming the first field that breaks the schema (every
        field of ``to_json``, no other, each of its type and range; an AR entry)."""
        _fields(data, "the file", ("format", "meta", "acceptance", "points"))
        if not _is_int(data["format"]) or data["format"] != FORMAT:
            raise ValueError(f"format must be {FORMAT}, got {data['format']!r}")
        return cls(_checked_points(data["points"]), _checked_meta(data["meta"]),
                   _checked_acceptance(data["acceptance"]))


# -- the cache file's schema ------------------------------------------------------------------------------

def _fields(data, what: str, names: Sequence[str]) -> None:
    """ValueError unless ``data`` is a dict with exactly the keys ``names``."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    if set(data) != set(names):
        raise ValueError(f"{what} must have the fields {sorted(names)}, got {sorted(data)}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _finite_number(what: str, x) -> float:
    """x as a float when it is a finite JSON number (not a bool), else a ValueError naming ``what``."""
    if _is_int(x) and abs(x) <= sys.float_info.max:
        return float(x)
    if not isinstance(x, float) or not math.isfinite(x):
        raise ValueError(f"{what} must be a finite number, got {x!r:.40}")
    return x


ROW_KEY = re.compile(r"[1-9][0-9]{0,9}")  # a row count as to_json writes it (no sign, zeros or spaces)


def _checked_points(points) -> Dict[str, Dict[int, float]]:
    if not isinstance(points, dict) or "ar" not in points:
        raise ValueError(f"points must be a JSON object with an 'ar' entry, got {type(points).__name__}")
    out = {}
    for name, by_rows in points.items():
        if not isinstance(by_rows, dict):
            raise ValueError(f"points[{name!r}] must be a JSON object, got {type(by_rows).__name__}")
        out[name] = {}
        for rows, seconds in by_rows.items():
            if not ROW_KEY.fullmatch(rows) or int(rows) > MAX_ROWS:
                raise ValueError(f"points[{name!r}]: a row count must be an int in [1, {MAX_ROWS}], got {rows!r}")
            out[name][int(rows)] = _finite_number(f"points[{name!r}][{rows!r}]", seconds)
    return out  # the ranges: CostModel's


META_FIELDS = ("key", "stamp", "created", "calibration_s")  # what a cache file's meta holds


def _checked_meta(meta) -> dict:
    """meta's fields, each of its type; a model's own JSON may leave them out, a cache file may not
    (``parse_entry``)."""
    if not isinstance(meta, dict) or not set(meta) <= set(META_FIELDS):
        raise ValueError(f"meta must be a JSON object with fields among {list(META_FIELDS)}, got "
                         f"{sorted(meta) if isinstance(meta, dict) else type(meta).__name__}")
    for name in ("key", "stamp"):
        if name in meta and not isinstance(meta[name], dict):
            raise ValueError(f"meta.{name} must be a JSON object, got {type(meta[name]).__name__}")
    if "created" in meta:
        _finite_number("meta.created", meta["created"])
    if "calibration_s" in meta and _finite_number("meta.calibration_s", meta["calibration_s"]) < 0:
        raise ValueError(f"meta.calibration_s must be >= 0, got {meta['calibration_s']!r}")
    return meta


def _checked_acceptance(acceptance) -> Dict[str, List[float]]:
    if not isinstance(acceptance, dict):
        raise ValueError(f"acceptance must be a JSON object, got {type(acceptance).__name__}")
    for family, rates in acceptance.items():
        if not isinstance(rates, list):
            raise ValueError(f"acceptance[{family!r}] must be a list, got {type(rates).__name__}")
        for r in rates:
            _finite_number(f"acceptance[{family!r}]", r)
    return acceptance  # the families and ranges: checked_rates


# -- keys -------------------------------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{platform.machine()}:{platform.processor() or 'cpu'}:{os.cpu_count()}cpus"


def model_fingerprint(model) -> dict:
    """Cheap identity of a model: its class, config, parameter count and dtype (no weight hashing); None (no
    drafter: Jacobi self-drafting) -> {"class": "none"}."""
    if model is None:
        return {"class": "none"}
    module = getattr(model, "model", model)  # GPTDrafter wraps a Transformer
    params = list(module.parameters())
    config = getattr(module, "config", None)
    return {"class": type(model).__name__, "config": repr(config),
            "parameters": sum(p.numel() for p in params),
            "dtype": str(params[0].dtype) if params else "none"}


def cache_key(device: torch.device, target, drafter, mode: dict) -> dict:
    return {"device": device_name(device), "target": model_fingerprint(target),
            "drafter": model_fingerprint(drafter), "threads": torch.get_num_threads(), "mode": mode}


def staleness_stamp() -> dict:
    """What invalidates a measured cost model without changing its key: the cache format, torch, the active
    backend, and lantern's code (its source and built extension: a faster kernel or loop changes the costs)."""
    from .._backend import active_backend
    from .._version import source_digest

    return {"format": FORMAT, "torch": torch.__version__, "backend": active_backend(), "lantern": source_digest()}


def cache_path(key: dict, directory: Optional[Path] = None) -> Path:
    from ..neighbours import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory or cache_dir()) / f"costs-{digest}.json"


# -- the cache --------------------------------------------------------------------------------------------

class Unusable(ValueError):
    """A cache entry that is not a regular file of at most MAX_FILE_BYTES."""


KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISLNK, "a symbolic link"), (stat.S_ISFIFO, "a FIFO"),
         (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a device"), (stat.S_ISBLK, "a device"))


def _regular(mode: int, size: int) -> None:
    if not stat.S_ISREG(mode):
        kind = next((name for test, name in KINDS if test(mode)), "not a regular file")
        raise Unusable(f"it is {kind}, not a regular file")
    if size > MAX_FILE_BYTES:
        raise Unusable(f"it holds {size} bytes, more than a cost model's {MAX_FILE_BYTES}")


def read_entry(path: Path) -> Optional[bytes]:
    """The bytes of the cache entry at ``path``, or None when there is none (no entry, or its folder is
    missing or not a folder). Unusable when it is not a regular file of at most MAX_FILE_BYTES. lstat
    judges the entry before it is opened; the open neither follows a link nor waits for a FIFO's writer,
    and the opened file is judged again (it may have been swapped between the two), then read up to the
    cap."""
    try:
        info = os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    _regular(info.st_mode, info.st_size)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:  # removed since the lstat
        return None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        _regular(info.st_mode, info.st_size)
        data = f.read(MAX_FILE_BYTES + 1)
    _regular(stat.S_IFREG, len(data))  # it grew after the fstat
    return data


def _no_constants(name: str):
    raise ValueError(f"{name} is not a number a cost model holds")


def parse_entry(data: bytes) -> Optional[CostModel]:
    """The model in a cache file's bytes: UTF-8 JSON of ``CostModel.to_json``'s schema (no NaN or
    Infinity), else a ValueError (or RecursionError, for JSON nested too deep to parse). None for a file
    of another FORMAT: stale, not corrupt (another lantern version wrote it)."""
    parsed = json.loads(data.decode("utf-8"), parse_constant=_no_constants)
    if isinstance(parsed, dict) and _is_int(parsed.get("format")) and parsed["format"] != FORMAT:
        return None
    model = CostModel.from_json(parsed)
    _fields(model.meta, "meta", META_FIELDS)
    return model


def _warn(path: Path, reason: str) -> None:
    warnings.warn(f"lantern: the cost-model cache {path} is corrupt or unreadable ({reason}); measuring again",
                  RuntimeWarning, stacklevel=3)


def _read(path: Path, key: dict, stamp: dict, max_age_days: float) -> Optional[CostModel]:
    """The cached model, or None when absent or stale; a corrupt or unreadable entry warns and gives None."""
    try:
        data = read_entry(path)
        model = None if data is None else parse_entry(data)
    except (ValueError, TypeError, RecursionError, OSError) as err:  # JSONDecodeError, UnicodeError: ValueError
        _warn(path, f"{type(err).__name__}: {err}")
        return None
    if model is None:
        return None
    meta = model.meta
    if meta["key"] != key:
        _warn(path, "its key does not match its file name")
        return None
    if meta["stamp"] != stamp:
        return None
    age_days = (time.time() - meta["created"]) / 86400.0
    if not 0.0 <= age_days <= max_age_days:
        return None
    return model


def _umask() -> int:
    """The process's umask: from /proc where Linux shows it, else set and restored at once."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write(path: Path, model: CostModel) -> None:
    """Write the model to a new unique file beside ``path`` (created exclusively, so never through a link
    someone placed there; mode 0666 less the umask), then move it over ``path`` (atomic: a concurrent reader
    sees the old file or the new one). A failure warns: the caller's model is good without the cache."""
    text = json.dumps(model.to_json(), indent=1, sort_keys=True, allow_nan=False)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp makes 0600
                f.write(text)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
    except OSError as err:
        warnings.warn(f"lantern: the cost-model cache {path} could not be written ({type(err).__name__}: {err}); "
                      f"this run uses its measurement without caching it", RuntimeWarning, stacklevel=3)


def cached_cost_model(key: dict, measure: Callable[..., Mapping], *, rows: Optional[Sequence[int]] = None,
                      directory: Optional[Path] = None, max_age_days: float = MAX_AGE_DAYS,
                      remeasure: bool = False) -> CostModel:
    """The cost model for ``key``: read from the cache when fresh, else measured and written back.

    Without ``rows``, ``measure()`` measures everything. With ``rows`` (the row counts a run needs), a fresh
    cached model that has AR points at all of them is used as it is; otherwise ``measure(missing, known)``
    measures the missing row counts (``known``: the cached model, or None) and its points are merged into the
    cached ones (the cached acceptance rates are kept), so a new batch size costs one row count's calibration.
    ``measure`` returns the points ({plan: {rows: seconds}}), or {"points": ..., "acceptance": ...}.
    ``meta['source']`` says 'cache', 'measured' or 'extended'; ``meta['calibration_s']`` how long measuring
    took (this call's measurement, for 'extended')."""
    path = cache_path(key, directory)
    stamp = staleness_stamp()
    known = None if remeasure else _read(path, key, stamp, max_age_days)
    missing = None
    if rows is not None:
        have = known.points.get("ar", {}) if known is not None else {}
        missing = sorted({int(r) for r in rows} - set(have))
    if known is not None and not missing:
        known.meta.update(source="cache", path=str(path))
        return known
    t0 = time.perf_counter()
    measured = measure() if rows is None else measure(missing, known)
    points, acceptance = (measured["points"], measured.get("acceptance")) if "points" in measured else (measured, None)
    source = "measured"
    if known is not None:  # extend the cached model with the new row counts
        merged = {name: dict(by_rows) for name, by_rows in known.points.items()}
        for name, by_rows in points.items():
            merged.setdefault(name, {}).update(by_rows)
        points, acceptance, source = merged, known.acceptance or acceptance, "extended"
    created = known.meta["created"] if known is not None else time.time()  # the oldest points' age counts
    meta = {"key": key, "stamp": stamp, "created": created, "calibration_s": time.perf_counter() - t0}
    model = CostModel(points, meta, acceptance)
    _write(path, model)
    model.meta.update(source=source, path=str(path))
    return model
