"""latent_neighbours (SPEC §2): the K nearest other codes of each code of a VQ codebook, nearest first."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import checks as c
from . import library
from .reference.latent_neighbours import latent_neighbours as reference

# codebook [V, d] float -> int32 [V, K]: the K nearest other codes of each code by (float32 squared distance,
# index), nearest first; rows L2-normalised first when normalize.
SCHEMA = "(Tensor codebook, int K, bool normalize) -> Tensor"


def fake(codebook, K, normalize):
    return codebook.new_empty((codebook.shape[0], K), dtype=torch.int32)


def to_schema(backend: str, codebook, K, normalize=False) -> tuple:
    return codebook, int(K), bool(normalize)


OP = library.Op("latent_neighbours", SCHEMA, fake, to_schema=to_schema, backends={
    "reference": reference,                      # ops/reference/latent_neighbours.py
    "cpu": library.EXTENSION,                    # csrc/cpu/latent_neighbours.cpp
    "cuda": library.EXTENSION,                   # csrc/cuda/latent_neighbours.cu
    "triton": "lantern.kernels.latent_neighbours",
})


def latent_neighbours(codebook: torch.Tensor, K: int, normalize: bool = False, *,
                      backend: Optional[str] = None) -> torch.Tensor:
    """§2: int32 ``[V, K]``, the K nearest other codes of each code, nearest first. ``backend``: which backend
    runs it (default: the one ``lantern.enable_fused`` / ``lantern.fused`` chose)."""
    K = c.plain(K)
    check(codebook, K, normalize)
    return _backend.dispatch("latent_neighbours", codebook.device, backend)(codebook, K, normalize)


def check(codebook, K, normalize) -> None:
    """codebook [V, d] float, finite in float32 (and, to be normalised, with finite float32 row norms), V >= 2,
    d >= 1; K int in [1, V-1]; normalize bool."""
    c.tensor("codebook", codebook, ndim=2, dtypes=c.FLOAT_DTYPES)
    V, d = codebook.shape
    if V < 2 or d < 1:
        raise ValueError(f"codebook must have at least 2 rows and 1 column, got shape {list(codebook.shape)}")
    c.int_arg("K", K, 1, V - 1)
    if not isinstance(normalize, bool):
        raise TypeError(f"normalize must be a bool, got {type(normalize).__name__}")
    if not c.scan_values():
        return
    rows = codebook.detach().to(torch.float32).contiguous()  # [V, d] what every backend computes with
    if not bool(torch.isfinite(rows).all()):
        raise ValueError("codebook contains NaN or infinite values (in float32)")
    if normalize:  # a row whose float32 norm overflows would be "normalised" to zero
        norms = rows.norm(2, dim=1)  # [V]
        if not bool(torch.isfinite(norms).all()):
            row = int((~torch.isfinite(norms)).nonzero()[0])
            raise ValueError(f"codebook row {row}: its L2 norm overflows float32, so it cannot be normalised "
                             f"(normalize=True); scale the codebook down")
