"""The "cpu" and "cuda" backends: the C++/CUDA kernels of ``lantern._C``, exposed as ``torch.ops.lantern.*``.

Importing this module registers, for each op the extension implements:
- a fake (meta) implementation, so ``torch.compile`` can trace the op without running it;
- a ``_backend`` wrapper for "cpu" and "cuda" that adapts the public op's arguments to the op schema.
If ``lantern._C`` cannot be imported, both backends report why they are unavailable and nothing else runs.
Every op has a kernel for both device keys (csrc/cpu/<op>.cpp, csrc/cuda/<op>.cu); the wrappers below are the
same for both backends, torch's dispatcher picks the kernel from the tensors' device.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .. import _backend
from .reference.verify import VerifyResult

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

    # ---- verify (SPEC §3-§5) ---------------------------------------------------------------------------

    @torch.library.register_fake("lantern::verify")
    def _verify_fake(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
                     draft_probs, k, delta, lam, node_budget, seed, offset):
        B, T = tokens.shape
        i64 = dict(dtype=torch.int64, device=logits.device)
        return (logits.new_empty((B,), **i64), logits.new_empty((B, max(T - 1, 0)), **i64),
                logits.new_empty((B,), **i64), logits.new_empty((B, T), dtype=torch.int8))

    def _row_setting(value, B: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scalar or [B] setting as a contiguous [B] tensor of ``dtype``, converted as the reference does
        (a Python number straight to ``dtype``: 0.9 becomes float64 0.9, not float64(float32(0.9)))."""
        if not isinstance(value, torch.Tensor):  # one allocation (this wrapper's cost shows at B = 1)
            return torch.full((B,), value, dtype=dtype, device=device)
        t = value.to(device=device, dtype=dtype)
        return t.expand(B).contiguous() if t.dim() == 0 else t.contiguous()

    def _offset_tensor(offset: IntLike, device: torch.device) -> torch.Tensor:
        if isinstance(offset, torch.Tensor):
            return offset.reshape(()).to(device=device, dtype=torch.int64)
        return torch.tensor(int(offset) & 0xFFFFFFFF, dtype=torch.int64, device=device)

    def verify(logits, tokens, parents, neighbours=None, *, uncond_logits=None, cfg_scale=1.0, temperature=1.0,
               top_k=0, top_p=1.0, draft_probs=None, k=0, delta=0.0, lam=None, budget="candidate", seed=0,
               offset=0):
        """The fused verify (one op call for the batch); see ``lantern.ops.verify``. Like the reference, it
        computes in float64 for float64 logits and in float32 for every other dtype (cfg_scale and temperature
        are converted to that type first)."""
        B, dev = logits.shape[0], logits.device
        real = torch.float64 if logits.dtype == torch.float64 else torch.float32
        out = torch.ops.lantern.verify(
            logits, tokens, parents, neighbours if k > 0 else None, uncond_logits,
            _row_setting(cfg_scale, B, real, dev), _row_setting(temperature, B, real, dev),
            _row_setting(top_k, B, torch.int64, dev), _row_setting(top_p, B, torch.float64, dev), draft_probs,
            int(k), float(delta), None if lam is None else float(lam), budget == "node",
            _seed_tensor(seed, dev), _offset_tensor(offset, dev))
        return VerifyResult(*out)

    for _name in ("cpu", "cuda"):
        _backend.register(_name, "verify")(verify)

    # ---- latent_neighbours (SPEC §2) and tree_attention (SPEC §6) -------------------------------------

    @torch.library.register_fake("lantern::latent_neighbours")
    def _latent_neighbours_fake(codebook, K, normalize):
        return codebook.new_empty((codebook.shape[0], K), dtype=torch.int32)

    @torch.library.register_fake("lantern::tree_attention")
    def _tree_attention_fake(q, k_cache, v_cache, cache_len, tree_mask):
        return torch.empty_like(q, memory_format=torch.contiguous_format)

    def latent_neighbours(codebook: torch.Tensor, K: int, normalize: bool = False) -> torch.Tensor:
        """codebook [V, d] -> int32 [V, K] (tiled distances, running per-row top-K; see the reference)."""
        return torch.ops.lantern.latent_neighbours(codebook, int(K), bool(normalize))

    def tree_attention(q, k_cache, v_cache, cache_len, tree_mask) -> torch.Tensor:
        """q [B, H, T, Dh], k/v_cache [B, Hkv, Lmax, Dh], cache_len int64 [B], tree_mask int32 [B, T, W]."""
        return torch.ops.lantern.tree_attention(q, k_cache, v_cache, cache_len, tree_mask)

    for _name in ("cpu", "cuda"):
        _backend.register(_name, "latent_neighbours")(latent_neighbours)
        _backend.register(_name, "tree_attention")(tree_attention)
