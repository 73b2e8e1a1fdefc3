"""The planner's cost model: seconds per decoding step for each plan against the row count, measured on the
device by a short calibration and cached on disk.

One point is a whole step of the real loop (drafter catch-up and tree growth, the target forward over
rows x nodes tokens, verify, compaction and bookkeeping), timed on a fresh decoding state; between the
measured row counts the time is interpolated linearly, past the largest one extrapolated along the last
segment (time grows linearly with the tokens per forward once the device is busy).

The cache is one small JSON file per (device, target and drafter fingerprints, dtype, threads, sampling
mode) under ``lantern.neighbours.cache_dir()``. A file is measured again when stale (another format, torch
version or fused backend, or older than ``MAX_AGE_DAYS``) or corrupt (with a warning; never trusted).
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import time
import warnings
from pathlib import Path
from typing import Callable, Dict, List, Mapping, Optional, Sequence

import torch

FORMAT = 2
MAX_AGE_DAYS = 30


class CostModel:
    """points[plan name] = {rows: seconds per step}; acceptance[family] = the chain-equivalent acceptance per
    draft level that the calibration's steps measured on these models ("sampled" / "top" drafts; the
    planner's prior, ``planner.AcceptanceModel``), or empty."""

    def __init__(self, points: Mapping[str, Mapping[int, float]], meta: Optional[dict] = None,
                 acceptance: Optional[Mapping[str, List[float]]] = None):
        self.points: Dict[str, Dict[int, float]] = {}
        for name, by_rows in points.items():
            if not by_rows:
                raise ValueError(f"cost model: plan {name!r} has no measured point")
            clean = {}
            for rows, seconds in by_rows.items():
                if int(rows) < 1 or not float(seconds) > 0.0:
                    raise ValueError(f"cost model: plan {name!r} needs rows >= 1 and seconds > 0, "
                                     f"got {rows} rows, {seconds} s")
                clean[int(rows)] = float(seconds)
            self.points[name] = dict(sorted(clean.items()))
        self.meta = dict(meta or {})
        self.acceptance: Dict[str, List[float]] = {}
        for family, rates in (acceptance or {}).items():
            if family not in ("sampled", "top") or not all(0.0 <= float(r) < 1.0 for r in rates):
                raise ValueError(f"cost model: acceptance must map 'sampled' / 'top' to rates in [0, 1), "
                                 f"got {family!r}: {rates!r}")
            self.acceptance[family] = [float(r) for r in rates]

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
    def from_json(cls, data: dict) -> "CostModel":
        if not isinstance(data, dict) or not isinstance(data.get("points"), dict):
            raise ValueError("not a lantern cost model (no 'points' table)")
        return cls({name: {int(r): float(s) for r, s in pts.items()} for name, pts in data["points"].items()},
                   data.get("meta", {}), data.get("acceptance") or {})


# -- keys -------------------------------------------------------------------------------------------------

def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"{device.type}:{platform.machine()}:{platform.processor() or 'cpu'}:{os.cpu_count()}cpus"


def model_fingerprint(model) -> dict:
    """Cheap identity of a model: its class, config, parameter count and dtype (no weight hashing)."""
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
    """What invalidates a measured cost model without changing its key."""
    from .._backend import active_backend

    return {"format": FORMAT, "torch": torch.__version__, "backend": active_backend()}


def cache_path(key: dict, directory: Optional[Path] = None) -> Path:
    from ..neighbours import cache_dir

    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    return Path(directory or cache_dir()) / f"costs-{digest}.json"


# -- the cache --------------------------------------------------------------------------------------------

def _read(path: Path, key: dict, stamp: dict, max_age_days: float) -> Optional[CostModel]:
    """The cached model, or None when absent or stale; a corrupt file warns and gives None."""
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
        model = CostModel.from_json(data)
        meta = model.meta
        if meta.get("key") != key:
            raise ValueError("its key does not match its file name")
    except (ValueError, TypeError, KeyError, AttributeError) as err:  # JSONDecodeError is a ValueError
        warnings.warn(f"lantern: the cost-model cache {path} is corrupt ({err}); measuring again", RuntimeWarning)
        return None
    if meta.get("stamp") != stamp:
        return None
    age_days = (time.time() - float(meta.get("created", 0.0))) / 86400.0
    if not 0.0 <= age_days <= max_age_days:
        return None
    return model


def _write(path: Path, model: CostModel) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(model.to_json(), indent=1, sort_keys=True))
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file


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
