"""The command line's output files: checked before any work starts, and JSON that is always valid JSON."""
from __future__ import annotations

import json
import math
import os
import secrets
import tempfile
from pathlib import Path
from typing import Callable, Iterable

TMP_PREFIX = ".tmp-"  # temporary files of atomic_write, beside their target


def image_suffixes() -> list:
    """File extensions Pillow can write (".png", ".jpg", ...), sorted."""
    from PIL import Image

    Image.init()
    return sorted(ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE)


def check_output_path(path: str, flag: str, suffixes: Iterable[str], what: str) -> None:
    """SystemExit naming ``flag`` unless ``path`` can be written as ``what``: its extension is one of
    ``suffixes``, its folder exists and takes a new file, and it is not a folder or a read-only file.
    Run it before sampling, so a bad path costs nothing."""
    suffixes = list(suffixes)
    name = os.path.basename(path)
    if not name or os.path.isdir(path):
        raise SystemExit(f"{flag} {path!r} is a folder; give a file name")
    suffix = os.path.splitext(name)[1].lower()
    if suffix not in suffixes:
        shown = ", ".join(suffixes[:8]) + (", ..." if len(suffixes) > 8 else "")
        raise SystemExit(f"{flag} {path!r} must name {what} ending in one of {shown}")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise SystemExit(f"{flag} {path!r}: the folder {folder!r} does not exist")
    try:
        if os.path.exists(path):
            with open(path, "ab"):  # opened for writing, nothing written
                pass
        else:
            with tempfile.TemporaryFile(dir=folder):  # a file can be created there (removed at once)
                pass
    except OSError as e:
        raise SystemExit(f"{flag} {path!r} cannot be written: {e.strerror or e}") from e


def finite_or_none(value):
    """value with every non-finite float (NaN, +-inf) inside dicts / lists / tuples replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def write_json(path: str, figures: dict) -> None:
    """figures as JSON (indent 2); a figure that is not a finite number (the Frechet distance of one image,
    the accuracy of an absent class) is written as null, never as the invalid bare NaN / Infinity."""
    text = json.dumps(finite_or_none(figures), indent=2, allow_nan=False) + "\n"
    atomic_write(path, lambda f: f.write(text.encode()))


def atomic_write(path, write: Callable, durable: bool = True) -> None:
    """write(binary file object) into a new temporary file beside ``path`` (a unique name, created exclusively,
    never through a symlink, with the mode the user's umask gives a new file), then rename it onto ``path``: a
    reader sees the whole old file or the whole new one. ``durable``: fsync before the rename."""
    path = Path(path)
    fd, tmp = _create_unique(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _create_unique(path: Path):
    """(fd, path) of a new empty file .tmp-<random>-<name> in path's folder. Mode 0o666 less the umask (as
    open() gives), unlike tempfile.mkstemp's 0o600."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        tmp = path.parent / f"{TMP_PREFIX}{secrets.token_hex(8)}-{path.name[:64]}"
        try:
            return os.open(tmp, flags, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")
