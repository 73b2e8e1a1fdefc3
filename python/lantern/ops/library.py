"""The ops as torch.library operators: one schema per op, shared by every backend (docs/dispatch.md).

Three namespaces hold the same schema for an op:
- ``lantern::<op>``: the C++ kernels of ``lantern._C`` (csrc/ops.cpp declares the five fused ops there, with a
  CPU and a CUDA kernel each). This module adds their fake (meta) implementations.
- ``lantern_triton::<op>``: the Triton kernels of ``lantern_kernels``, declared with ``declare_triton``:
  ``torch.library.triton_op`` on a GPU, so inductor sees the kernels (wrap_triton) and can optimise around
  them; under Triton's interpreter an opaque custom op (the interpreter needs real tensors, so the body
  cannot be traced), with the fake below.
- ``lantern_reference::<op>``: the PyTorch reference of every op (the five fused ones and the reference-only
  ``process_logits``, ``ancestor_mask``, ``build_tree``) as an opaque custom op for all devices. Eager code
  calls the reference functions directly; while torch.compile traces, ``lantern._backend`` routes to these
  ops instead, because the reference code has value-dependent control flow (loops run until a tree is
  exhausted, fast paths that skip an all-off filter, internal consistency checks) that a graph cannot hold.

The public ops (``lantern.ops``) take Python numbers or tensors for settings and seeds; the schemas take
tensors only (a device tensor can change between CUDA-graph replays). ``verify_args`` and ``philox_args``
convert one to the other, the same way for every backend.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Tuple, Union

import torch

from .reference.continuous_verify import ContinuousVerifyResult, default_keys
from .reference.verify import VerifyResult

# The schemas of csrc/ops.cpp (tests/test_compile_step.py compares them with lantern._C's).
SCHEMAS: Dict[str, str] = {
    "verify": (
        "(Tensor logits, Tensor tokens, Tensor parents, Tensor? neighbours, Tensor? uncond_logits, "
        "Tensor cfg_scale, Tensor temperature, Tensor top_k, Tensor top_p, Tensor? draft_probs, int k, float delta, "
        "float? lam, bool node_budget, Tensor seed, Tensor offset, Tensor? rows=None) "
        "-> (Tensor, Tensor, Tensor, Tensor)"),
    "latent_neighbours": "(Tensor codebook, int K, bool normalize) -> Tensor",
    "tree_attention": "(Tensor q, Tensor k_cache, Tensor v_cache, Tensor cache_len, Tensor tree_mask) -> Tensor",
    "compact_kv": "(Tensor(a!) cache, Tensor cache_len, Tensor path_nodes, Tensor n_keep) -> Tensor",
    "philox_uniform": "(Tensor seed, Tensor c0, Tensor c1, Tensor c2, Tensor c3) -> Tensor",
    "continuous_verify": (
        "(Tensor draft, Tensor mu_p, Tensor sigma_p, Tensor mu_q, Tensor sigma_q, Tensor logsig_p, Tensor logsig_q, "
        "Tensor rows, Tensor positions, str rule, float bandwidth, str sigma_ratio, int max_tries, Tensor seed, "
        "Tensor offset) -> (Tensor, Tensor, Tensor)"),
}
FUSED_OPS = tuple(SCHEMAS)
# Ops that only have the reference: declared in lantern_reference:: so that torch.compile can trace a step.
REFERENCE_ONLY_SCHEMAS: Dict[str, str] = {
    "process_logits": ("(Tensor logits, Tensor? uncond_logits, Tensor cfg_scale, Tensor temperature, Tensor top_k, "
                       "Tensor top_p) -> Tensor"),
    "ancestor_mask": "(Tensor parents) -> Tensor",
    "build_tree": ("(Tensor cand_tokens, Tensor cand_parents, Tensor cand_scores, Tensor root_token, int n_nodes) "
                   "-> (Tensor, Tensor)"),
}
MUTATES: Dict[str, Tuple[str, ...]] = {"compact_kv": ("cache",)}

IntLike = Union[int, torch.Tensor]
MASK64 = 2**64 - 1


# ---- fake implementations: output shapes, dtypes and devices from the inputs' ----------------------------

def _verify_fake(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
                 draft_probs, k, delta, lam, node_budget, seed, offset, rows=None):
    B, T = tokens.shape
    i64 = dict(dtype=torch.int64, device=logits.device)
    return (logits.new_empty((B,), **i64), logits.new_empty((B, max(T - 1, 0)), **i64),
            logits.new_empty((B,), **i64), logits.new_empty((B, T), dtype=torch.int8))


def _latent_neighbours_fake(codebook, K, normalize):
    return codebook.new_empty((codebook.shape[0], K), dtype=torch.int32)


def _tree_attention_fake(q, k_cache, v_cache, cache_len, tree_mask):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _compact_kv_fake(cache, cache_len, path_nodes, n_keep):
    return torch.empty_like(cache_len)


def _philox_uniform_fake(seed, c0, c1, c2, c3):
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
    return c0.new_empty(shape, dtype=torch.float32)


def _continuous_verify_fake(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions, rule,
                            bandwidth, sigma_ratio, max_tries, seed, offset):
    B, N, C = draft.shape
    return (draft.new_empty((B, N, C), dtype=torch.float32), draft.new_empty((B, N), dtype=torch.bool),
            draft.new_empty((B, N), dtype=torch.int32))


def _process_logits_fake(logits, uncond_logits, cfg_scale, temperature, top_k, top_p):
    return logits.new_empty(logits.shape, dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)


def _ancestor_mask_fake(parents):
    B, T = parents.shape
    return parents.new_empty((B, T, (T + 31) // 32), dtype=torch.int32)


def _build_tree_fake(cand_tokens, cand_parents, cand_scores, root_token, n_nodes):
    B = cand_tokens.shape[0]
    return (cand_tokens.new_empty((B, n_nodes + 1), dtype=torch.int64),
            cand_tokens.new_empty((B, n_nodes + 1), dtype=torch.int64))


FAKES: Dict[str, Callable] = {
    "verify": _verify_fake,
    "latent_neighbours": _latent_neighbours_fake,
    "tree_attention": _tree_attention_fake,
    "compact_kv": _compact_kv_fake,
    "philox_uniform": _philox_uniform_fake,
    "continuous_verify": _continuous_verify_fake,
    "process_logits": _process_logits_fake,
    "ancestor_mask": _ancestor_mask_fake,
    "build_tree": _build_tree_fake,
}


def register_extension_fakes() -> None:
    """The fake implementations of lantern._C's ops (call once, after importing lantern._C)."""
    for name in FUSED_OPS:
        torch.library.register_fake(f"lantern::{name}")(FAKES[name])


# ---- public arguments -> schema arguments ---------------------------------------------------------------

def seed_tensor(seed: IntLike, device: torch.device) -> torch.Tensor:
    """The seed as the schemas take it: a 0-d int64 tensor on ``device`` holding the seed's 64 bits."""
    if isinstance(seed, torch.Tensor):
        return seed.reshape(()).to(device=device, dtype=torch.int64)
    seed = int(seed) & MASK64
    return torch.tensor(seed - 2**64 if seed >= 2**63 else seed, dtype=torch.int64, device=device)


def offset_tensor(offset: IntLike, device: torch.device) -> torch.Tensor:
    if isinstance(offset, torch.Tensor):
        return offset.reshape(()).to(device=device, dtype=torch.int64)
    return torch.tensor(int(offset) & 0xFFFFFFFF, dtype=torch.int64, device=device)


def row_setting(value, B: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar or [B] setting as a contiguous [B] tensor of ``dtype``, converted as the reference does
    (a Python number straight to ``dtype``: 0.9 becomes float64 0.9, not float64(float32(0.9)))."""
    if not isinstance(value, torch.Tensor):  # one allocation (this conversion's cost shows at B = 1)
        return torch.full((B,), value, dtype=dtype, device=device)
    t = value.to(device=device, dtype=dtype)
    return t.expand(B).contiguous() if t.dim() == 0 else t.contiguous()


def verify_args(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
                draft_probs, k, delta, lam, budget, seed, offset, real: torch.dtype,
                rows: Optional[torch.Tensor] = None) -> tuple:
    """The verify schema's arguments; cfg_scale and temperature as ``real`` (the kernel's compute type), the
    row keys as contiguous int64 [B] (None: the kernels use b)."""
    B, dev = logits.shape[0], logits.device
    return (logits, tokens, parents, neighbours if k > 0 else None, uncond_logits,
            row_setting(cfg_scale, B, real, dev), row_setting(temperature, B, real, dev),
            row_setting(top_k, B, torch.int64, dev), row_setting(top_p, B, torch.float64, dev), draft_probs,
            int(k), float(delta), None if lam is None else float(lam), budget == "node",
            seed_tensor(seed, dev), offset_tensor(offset, dev),
            None if rows is None else rows.to(device=dev, dtype=torch.int64).contiguous())


def philox_args(seed: IntLike, c0: IntLike, c1: IntLike, c2: IntLike, c3: IntLike) -> tuple:
    """(seed, c0, c1, c2, c3) as tensors on the counters' device (CPU when every counter is an int)."""
    tensors = [c for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    counters = [c if isinstance(c, torch.Tensor) else torch.tensor(int(c), dtype=torch.int64, device=device)
                for c in (c0, c1, c2, c3)]
    return (seed_tensor(seed, device), *counters)


def continuous_verify_args(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio,
                           max_tries, seed, offset, rows, positions) -> tuple:
    """The continuous_verify schema's arguments: the keys as contiguous int64 (rows [B] default b, positions
    [B, N] default n), seed and offset as 0-d int64 tensors on the block's device."""
    B, N, _ = draft.shape
    dev = draft.device
    rows, positions = default_keys(B, N, dev, rows, positions)
    return (draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows.contiguous(), positions.contiguous(),
            str(rule), float(bandwidth), str(sigma_ratio), int(max_tries), seed_tensor(seed, dev),
            offset_tensor(offset, dev))


def _setting(value, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A scalar (0-d) or per-row setting as a tensor of ``dtype`` (process_logits broadcasts either)."""
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype)
    return torch.tensor(value, dtype=dtype, device=device)


# ---- Triton ops ----------------------------------------------------------------------------------------

def declare_triton(name: str, launch: Callable, interpreting: bool):
    """Declare ``lantern_triton::<name>`` with ``launch`` (schema arguments) as its kernel for every device.
    On a GPU it is a ``triton_op`` (``launch`` calls its kernels through ``torch.library.wrap_triton``, and is
    traced with fake tensors as its own fake implementation); under the interpreter an opaque custom op."""
    qualname = f"lantern_triton::{name}"
    mutates = MUTATES.get(name, ())
    if interpreting:
        op = torch.library.custom_op(qualname, launch, mutates_args=mutates, schema=SCHEMAS[name])
        op.register_fake(FAKES[name])
        return op
    return torch.library.triton_op(qualname, launch, mutates_args=mutates, schema=SCHEMAS[name])


# ---- reference ops (what torch.compile traces for the reference backend and the reference-only ops) --------

def _unsigned(seed: torch.Tensor) -> int:
    return int(seed) & MASK64


def _declare_reference_ops() -> Dict[str, Callable]:
    """Declare ``lantern_reference::<op>`` for every op; returns op name -> its public-signature caller."""
    from .reference import (compact_kv, continuous_verify, latent_neighbours, philox, process_logits, tree,
                            tree_attention, verify)

    def verify_kernel(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
                      draft_probs, k, delta, lam, node_budget, seed, offset, rows=None):
        return tuple(verify.verify(
            logits, tokens, parents, neighbours, uncond_logits=uncond_logits, cfg_scale=cfg_scale,
            temperature=temperature, top_k=top_k, top_p=top_p, draft_probs=draft_probs, k=k, delta=delta, lam=lam,
            budget="node" if node_budget else "candidate", seed=_unsigned(seed), offset=int(offset), rows=rows))

    def philox_kernel(seed, c0, c1, c2, c3):
        return philox.philox_uniform(_unsigned(seed), c0, c1, c2, c3)

    def continuous_verify_kernel(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions, rule,
                                 bandwidth, sigma_ratio, max_tries, seed, offset):
        return tuple(continuous_verify.continuous_verify(
            draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio, max_tries,
            _unsigned(seed), int(offset), rows=rows, positions=positions))

    kernels = {
        "verify": verify_kernel,
        "continuous_verify": continuous_verify_kernel,
        "latent_neighbours": latent_neighbours.latent_neighbours,
        "tree_attention": tree_attention.tree_attention,
        "compact_kv": compact_kv.compact_kv,
        "philox_uniform": philox_kernel,
        "process_logits": process_logits.process_logits,
        "ancestor_mask": tree.ancestor_mask,
        "build_tree": lambda *args: tuple(tree.build_tree(*args)),
    }
    schemas = dict(SCHEMAS, **REFERENCE_ONLY_SCHEMAS)
    for name, kernel in kernels.items():
        op = torch.library.custom_op(f"lantern_reference::{name}", kernel, mutates_args=MUTATES.get(name, ()),
                                     schema=schemas[name])
        op.register_fake(FAKES[name])
    ops = torch.ops.lantern_reference

    def verify_op(logits, tokens, parents, neighbours=None, *, uncond_logits=None, cfg_scale=1.0, temperature=1.0,
                  top_k=0, top_p=1.0, draft_probs=None, k=0, delta=0.0, lam=None, budget="candidate", seed=0,
                  offset=0, rows=None):
        real = torch.float64 if logits.dtype == torch.float64 else torch.float32
        return VerifyResult(*ops.verify(*verify_args(
            logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p, draft_probs,
            k, delta, lam, budget, seed, offset, real, rows)))

    def process_logits_op(logits, uncond_logits=None, cfg_scale=1.0, temperature=1.0, top_k=0, top_p=1.0):
        real, dev = (torch.float64 if logits.dtype == torch.float64 else torch.float32), logits.device
        return ops.process_logits(logits, uncond_logits, _setting(cfg_scale, real, dev),
                                  _setting(temperature, real, dev), _setting(top_k, torch.int64, dev),
                                  _setting(top_p, torch.float64, dev))

    def build_tree_op(cand_tokens, cand_parents, cand_scores, root_token, n_nodes):
        return tuple(ops.build_tree(cand_tokens, cand_parents, cand_scores, root_token, int(n_nodes)))

    def continuous_verify_op(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule="exact", bandwidth=1.0,
                             sigma_ratio="paper", max_tries=1000, seed=0, offset=0, *, rows=None, positions=None):
        return ContinuousVerifyResult(*ops.continuous_verify(*continuous_verify_args(
            draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rule, bandwidth, sigma_ratio, max_tries, seed,
            offset, rows, positions)))

    return {
        "verify": verify_op,
        "continuous_verify": continuous_verify_op,
        "latent_neighbours": lambda codebook, K, normalize=False: ops.latent_neighbours(codebook, int(K),
                                                                                          bool(normalize)),
        "tree_attention": ops.tree_attention,
        "compact_kv": ops.compact_kv,
        "philox_uniform": lambda seed, c0, c1, c2, c3: ops.philox_uniform(*philox_args(seed, c0, c1, c2, c3)),
        "process_logits": process_logits_op,
        "ancestor_mask": ops.ancestor_mask,
        "build_tree": build_tree_op,
    }


_reference_ops: Optional[Dict[str, Callable]] = None


def reference_ops() -> Dict[str, Callable]:
    """op name -> a function with the public op's signature that calls ``lantern_reference::<op>``."""
    global _reference_ops
    if _reference_ops is None:
        _reference_ops = _declare_reference_ops()
    return _reference_ops
