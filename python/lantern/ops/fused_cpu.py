"""The "cpu" and "cuda" backends: the C++/CUDA kernels of ``lantern._C``, exposed as ``torch.ops.lantern.*``.

Importing this module registers, for each op the extension implements:
- a fake (meta) implementation, so ``torch.compile`` can trace the op without running it;
- a ``_backend`` wrapper for "cpu" and "cuda" that adapts the public op's arguments to the op schema.
If ``lantern._C`` cannot be imported, both backends report why they are unavailable and nothing else runs.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _backend

try:
    from .. import _C
except ImportError as e:  # not built, or built against another torch
    _C = None
    _IMPORT_ERROR: Optional[str] = (
        f"the C++ extension lantern._C is not built (pip install --no-build-isolation -e .): {e}")
else:
    _IMPORT_ERROR = None


def cuda_compiled() -> bool:
    """Whether lantern._C was built with its CUDA kernels (csrc/cuda)."""
    return _C is not None and bool(_C.cuda_compiled())


def _cpu_unavailable() -> Optional[str]:
    return _IMPORT_ERROR


def _cuda_unavailable() -> Optional[str]:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not cuda_compiled():
        return ("lantern._C was built without CUDA kernels (no CUDA toolkit at build time, or LANTERN_NO_CUDA=1); "
                "rebuild with CUDA_HOME set")
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


_backend.set_availability("cpu", _cpu_unavailable)
_backend.set_availability("cuda", _cuda_unavailable)

IntLike = Union[int, torch.Tensor]


def _seed_tensor(seed: IntLike, device: torch.device) -> torch.Tensor:
    """The seed as the op wants it: a 0-d int64 tensor on ``device`` holding the seed's 64 bits."""
    if isinstance(seed, torch.Tensor):
        return seed.reshape(()).to(device=device, dtype=torch.int64)
    seed = int(seed) & (2**64 - 1)
    return torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64, device=device)


if _C is not None:

    @torch.library.register_fake("lantern::compact_kv")
    def _compact_kv_fake(cache, cache_len, path_nodes, n_keep):
        return torch.empty_like(cache_len)

    @torch.library.register_fake("lantern::philox_uniform")
    def _philox_uniform_fake(seed, c0, c1, c2, c3):
        shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
        return c0.new_empty(shape, dtype=torch.float32)

    def compact_kv(cache: torch.Tensor, cache_len: torch.Tensor, path_nodes: torch.Tensor,
                   n_keep: torch.Tensor) -> torch.Tensor:
        """cache [..., B, Hkv, Lmax, Dh] (contiguous, modified in place); cache_len, n_keep int64 [B];
        path_nodes int64 [B, P]. Returns cache_len + n_keep."""
        return torch.ops.lantern.compact_kv(cache, cache_len, path_nodes, n_keep)

    def philox_uniform(seed: IntLike, c0: IntLike, c1: IntLike, c2: IntLike, c3: IntLike) -> torch.Tensor:
        """float32 uniforms for the broadcast counters; seed an int in [0, 2^64) or a one-element tensor."""
        tensors = [c for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)]
        device = tensors[0].device if tensors else torch.device("cpu")
        cs = [c if isinstance(c, torch.Tensor) else torch.tensor(int(c), dtype=torch.int64, device=device)
              for c in (c0, c1, c2, c3)]
        return torch.ops.lantern.philox_uniform(_seed_tensor(seed, device), *cs)

    for _name in ("cpu", "cuda"):
        _backend.register(_name, "compact_kv")(compact_kv)
        _backend.register(_name, "philox_uniform")(philox_uniform)
