"""Neighbour tables per VQ codebook: built once with ``lantern.ops.latent_neighbours`` and cached on disk
(safetensors, keyed by a hash of the codebook, K and normalisation), so decoding never rebuilds them.

Each file records what it was built from (the codebook's full SHA-256, V, K, the normalisation and the
table's dtype) in its safetensors metadata, and a read checks them and the table's shape, dtype and id
range. A file that does not match (another codebook's table copied over the key, a wrong K or dtype, an
older file without the record) or cannot be read (corrupt, truncated) is rebuilt and replaced, with a
``RuntimeWarning`` naming the file and the reason: a cache entry is only ever a shortcut, never an input.

Writes go to a unique temporary file in the cache directory and are moved over the entry with
``os.replace`` (atomic), so concurrent writers never collide and a reader sees one whole table or another.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Dict, Optional

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from . import ops

FORMAT = "lantern-neighbours-1"


def cache_dir() -> Path:
    """$LANTERN_CACHE, else $XDG_CACHE_HOME/lantern, else ~/.cache/lantern."""
    if os.environ.get("LANTERN_CACHE"):
        return Path(os.environ["LANTERN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lantern"


def _codebook_bytes(codebook: torch.Tensor) -> bytes:
    return codebook.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()


def codebook_key(codebook: torch.Tensor, K: int, normalize: bool) -> str:
    return _key(table_record(codebook, K, normalize))


def _key(record: Dict[str, str]) -> str:
    """The cache entry's name for a table record (a prefix of the codebook's hash, V, K, normalisation)."""
    norm = "norm" if record["normalize"] == "True" else "raw"
    return f"neighbours-{record['codebook_sha256'][:16]}-V{record['V']}-K{record['K']}-{norm}"


def table_record(codebook: torch.Tensor, K: int, normalize: bool) -> Dict[str, str]:
    """The metadata a cached table of this codebook, K and normalisation must carry."""
    return {"format": FORMAT, "codebook_sha256": hashlib.sha256(_codebook_bytes(codebook)).hexdigest(),
            "V": str(codebook.shape[0]), "K": str(K), "normalize": str(bool(normalize)), "dtype": "int32"}


def _mismatch(record: Dict[str, str], stored: Dict[str, str], table: torch.Tensor) -> Optional[str]:
    """Why the stored table is not this record's table, or None when it is."""
    for key, want in record.items():
        if stored.get(key) != want:
            return f"{key} is {stored.get(key)!r}, expected {want!r}"
    V, K = int(record["V"]), int(record["K"])
    if table.dtype != torch.int32 or tuple(table.shape) != (V, K):
        return f"table is {table.dtype} {list(table.shape)}, expected torch.int32 [{V}, {K}]"
    if table.numel() and not bool(((table >= 0) & (table < V)).all()):
        return f"table holds ids outside [0, {V})"
    return None


def _read_cached(path: Path, record: Dict[str, str]) -> Optional[torch.Tensor]:
    """The cached table at path when it is this record's, else None (a warning says why when a file was
    there but is unusable)."""
    try:
        with safe_open(str(path), "pt") as f:
            stored = f.metadata() or {}
            table = f.get_tensor("neighbours")
    except FileNotFoundError:
        return None
    except Exception as e:  # noqa: BLE001 - any unreadable file (safetensors' own error, OSError, ...) is rebuilt
        reason = f"unreadable ({type(e).__name__}: {e})"
    else:
        reason = _mismatch(record, stored, table)
        if reason is None:
            return table
    warnings.warn(f"neighbour cache {path}: {reason}; rebuilding it", RuntimeWarning, stacklevel=3)
    return None


def _write_atomic(path: Path, table: torch.Tensor, record: Dict[str, str]) -> None:
    """Write to a unique temporary file next to path, then replace path by it (atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        save_file({"neighbours": table.contiguous()}, tmp, metadata=record)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; the cache entry is an ordinary readable file
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def neighbour_table(codebook: torch.Tensor, K: int, normalize: bool = True, *, directory: Optional[Path] = None,
                    rebuild: bool = False) -> torch.Tensor:
    """int32 [V, K] for this codebook, from the disk cache when present and recorded as built from this
    codebook, K and normalisation (built and saved otherwise; a mismatching or corrupt entry is rebuilt
    with a RuntimeWarning). ``normalize=True`` matches how LlamaGen's quantiser looks codes up."""
    record = table_record(codebook, K, normalize)  # hashes the codebook once, for the name and the check
    path = Path(directory or cache_dir()) / (_key(record) + ".safetensors")
    if not rebuild:
        table = _read_cached(path, record)
        if table is not None:
            return table
    table = ops.latent_neighbours(codebook.detach().to("cpu", torch.float32), K, normalize=normalize)
    _write_atomic(path, table, record)
    return table
