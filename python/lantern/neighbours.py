"""Neighbour tables per VQ codebook: built once with ``lantern.ops.latent_neighbours`` and cached on disk
(safetensors, keyed by a hash of the codebook, K and normalisation), so decoding never rebuilds them."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file

from . import ops


def cache_dir() -> Path:
    """$LANTERN_CACHE, else $XDG_CACHE_HOME/lantern, else ~/.cache/lantern."""
    if os.environ.get("LANTERN_CACHE"):
        return Path(os.environ["LANTERN_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "lantern"


def codebook_key(codebook: torch.Tensor, K: int, normalize: bool) -> str:
    data = codebook.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    digest = hashlib.sha256(data).hexdigest()[:16]
    return f"neighbours-{digest}-V{codebook.shape[0]}-K{K}-{'norm' if normalize else 'raw'}"


def neighbour_table(codebook: torch.Tensor, K: int, normalize: bool = True, *, directory: Optional[Path] = None,
                    rebuild: bool = False) -> torch.Tensor:
    """int32 [V, K] for this codebook, from the disk cache when present (built and saved otherwise).
    ``normalize=True`` matches how LlamaGen's quantiser looks codes up."""
    path = Path(directory or cache_dir()) / (codebook_key(codebook, K, normalize) + ".safetensors")
    if path.exists() and not rebuild:
        return load_file(str(path))["neighbours"]
    table = ops.latent_neighbours(codebook.detach().to("cpu", torch.float32), K, normalize=normalize)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"neighbours": table.contiguous()}, str(tmp))
    os.replace(tmp, path)  # atomic: a concurrent reader never sees half a file
    return table
