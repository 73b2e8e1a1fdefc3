"""lantern's version, and digests of its code for the caches whose contents depend on it (AOT packages, the
cost models of tree="auto")."""
from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Optional

__version__ = "0.1.0"

_SOURCE_DIGEST: Optional[str] = None


def source_digest() -> str:
    """sha256 of lantern's Python source (every ``.py`` of the package) and of its built extension's file:
    anything a cached graph or a measured cost could depend on. Computed once per process (milliseconds)."""
    global _SOURCE_DIGEST
    if _SOURCE_DIGEST is None:
        root = Path(__file__).resolve().parent
        digest = hashlib.sha256()
        for path in sorted(root.rglob("*.py")) + sorted(root.glob("_C*.so")) + sorted(root.glob("_C*.pyd")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
        _SOURCE_DIGEST = digest.hexdigest()
    return _SOURCE_DIGEST
