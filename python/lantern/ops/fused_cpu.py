"""The "cpu" and "cuda" backends: the C++/CUDA kernels of ``lantern._C``, the ops ``torch.ops.lantern.*``.

csrc/ops.cpp declares the ops (their schemas) and registers a CPU and a CUDA kernel for each; importing
this module adds their fake implementations (``lantern.ops.library``) and defines, per op, the function
with the public op's signature that converts the arguments to the schema's and calls the op. Both backends
run the same functions; torch's dispatcher picks the kernel from the tensors' device. ``implementations``
lists the ops that have a kernel for a dispatch key, asked of the dispatcher. If ``lantern._C`` cannot be
imported, both backends report why they are unavailable and nothing else runs.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import torch

from .. import _backend
from . import library
from .library import IntLike
from .reference.continuous_verify import ContinuousVerifyResult
from .reference.verify import VerifyResult

try:
    from .. import _C
except ImportError as e:  # not built, or built against another torch
    _C = None
    _IMPORT_ERROR: Optional[str] = (
        f"the C++ extension lantern._C is not built (pip install --no-build-isolation -e .): {e}")
else:
    _IMPORT_ERROR = None
    library.register_extension_fakes()


def cuda_compiled() -> bool:
    """Whether lantern._C was built with its CUDA kernels (csrc/cuda)."""
    return _C is not None and bool(_C.cuda_compiled())


def build_info() -> str:
    """One line: how lantern._C was built (with or without CUDA kernels, for which architectures), or why it
    cannot be imported."""
    if _C is None:
        return _IMPORT_ERROR
    if not hasattr(_C, "build_info"):  # built before the build recorded its line
        return f"lantern._C {'with' if cuda_compiled() else 'without'} CUDA kernels"
    return _C.build_info()


def cpu_unavailable() -> Optional[str]:
    return _IMPORT_ERROR


def cuda_unavailable() -> Optional[str]:
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if not cuda_compiled():
        return ("lantern._C was built without CUDA kernels (no CUDA toolkit at build time, or LANTERN_NO_CUDA=1); "
                "rebuild with CUDA_HOME set")
    if not torch.cuda.is_available():
        return "no CUDA device is available (torch.cuda.is_available() is False)"
    return None


def _count(op: str, tensor) -> None:
    """One call of lantern._C's ``op`` kernel on ``tensor``'s device, for ``_backend.kernel_calls``."""
    device = tensor.device.type if isinstance(tensor, torch.Tensor) else "cpu"
    _backend.count_kernel("cuda" if device == "cuda" else "cpu", op)


def compact_kv(cache: torch.Tensor, cache_len: torch.Tensor, path_nodes: torch.Tensor,
               n_keep: torch.Tensor) -> torch.Tensor:
    """cache [..., B, Hkv, Lmax, Dh] (contiguous, modified in place); cache_len, n_keep int64 [B];
    path_nodes int64 [B, P]. Returns cache_len + n_keep."""
    _count("compact_kv", cache)
    return torch.ops.lantern.compact_kv(cache, cache_len, path_nodes, n_keep)


def philox_uniform(seed: IntLike, c0: IntLike, c1: IntLike, c2: IntLike, c3: IntLike) -> torch.Tensor:
    """float32 uniforms for the broadcast counters; seed an int in [0, 2^64) or a one-element tensor."""
    _count("philox_uniform", next((c for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)), None))
    return torch.ops.lantern.philox_uniform(*library.philox_args(seed, c0, c1, c2, c3))


def verify(logits, tokens, parents, neighbours=None, *, uncond_logits=None, cfg_scale=1.0, temperature=1.0,
           top_k=0, top_p=1.0, draft_probs=None, k=0, delta=0.0, lam=None, budget="candidate", seed=0,
           offset=0, rows=None):
    """The fused verify (one op call for the batch); see ``lantern.ops.verify``. Like the reference, it
    computes in float64 for float64 logits and in float32 for every other dtype (cfg_scale and temperature
    are converted to that type first)."""
    _count("verify", logits)
    real = torch.float64 if logits.dtype == torch.float64 else torch.float32
    return VerifyResult(*torch.ops.lantern.verify(*library.verify_args(
        logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p, draft_probs,
        k, delta, lam, budget, seed, offset, real, rows)))


def latent_neighbours(codebook: torch.Tensor, K: int, normalize: bool = False) -> torch.Tensor:
    """codebook [V, d] -> int32 [V, K] (tiled distances, running per-row top-K; see the reference)."""
    _count("latent_neighbours", codebook)
    return torch.ops.lantern.latent_neighbours(codebook, int(K), bool(normalize))


def tree_attention(q, k_cache, v_cache, cache_len, tree_mask) -> torch.Tensor:
    """q [B, H, T, Dh], k/v_cache [B, Hkv, Lmax, Dh], cache_len int64 [B], tree_mask int32 [B, T, W]."""
    _count("tree_attention", q)
    return torch.ops.lantern.tree_attention(q, k_cache, v_cache, cache_len, tree_mask)


def continuous_verify(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule="exact", bandwidth=1.0,
                      sigma_ratio="paper", max_tries=1000, seed=0, offset=0, *, rows=None, positions=None):
    """The fused continuous_verify (one op call for the block); see ``lantern.ops.continuous_verify``."""
    _count("continuous_verify", draft)
    return ContinuousVerifyResult(*torch.ops.lantern.continuous_verify(*library.continuous_verify_args(
        draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio, max_tries, seed,
        offset, rows, positions)))


_CALLERS: Dict[str, Callable] = {"verify": verify, "continuous_verify": continuous_verify, "latent_neighbours": latent_neighbours,
                                 "tree_attention": tree_attention, "compact_kv": compact_kv,
                                 "philox_uniform": philox_uniform}


def implementations(dispatch_key: str) -> Dict[str, Callable]:
    """op name -> its caller, for the ops of lantern._C with a kernel for ``dispatch_key`` ("CPU", "CUDA")."""
    if _C is None:
        return {}
    return {name: _CALLERS[name] for name in library.FUSED_OPS
            if getattr(torch.ops.lantern, name).default.has_kernel_for_dispatch_key(dispatch_key)}
