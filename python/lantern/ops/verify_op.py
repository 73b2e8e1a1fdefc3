"""verify (SPEC §3-§5, §7): verify a batch of draft trees in one call, under LANTERN's relaxed acceptance
(neighbour merging, δ or λ budget) or exact speculative sampling, and sample each row's next token."""
from __future__ import annotations

import weakref
from typing import Optional, Union

import torch

from .. import _backend
from . import checks as c
from . import library
from .reference.verify import VerifyResult
from .reference.verify import verify as reference

BUDGETS = ("candidate", "node")
ScalarOrTensor = Union[int, float, torch.Tensor]

# One call for the whole batch. logits [B, T, V] (float32/bfloat16/float16/float64); tokens, parents int64
# [B, T]; neighbours int32 [V, K] (needed when k > 0); uncond_logits and draft_probs like logits; per-row
# settings cfg_scale, temperature [B] in the compute type (float64 for float64 logits on the C++ kernels,
# float32 otherwise), top_k int64 [B], top_p float64 [B]; lam given = lambda mode; node_budget = budget "node";
# seed, offset one-element int64 (seed's 64 bits; offset taken modulo 2^32); rows int64 [B] or None: the Philox
# counter's row word of each row (taken modulo 2^32; None: the row index b). Returns (accept_len [B] int64,
# path [B, T-1] int64 (-1 padded), next_token [B] int64, node_status [B, T] int8: 1 accepted / passed,
# 0 rejected, -1 not tested).
SCHEMA = ("(Tensor logits, Tensor tokens, Tensor parents, Tensor? neighbours, Tensor? uncond_logits, "
          "Tensor cfg_scale, Tensor temperature, Tensor top_k, Tensor top_p, Tensor? draft_probs, int k, float delta, "
          "float? lam, bool node_budget, Tensor seed, Tensor offset, Tensor? rows=None) "
          "-> (Tensor, Tensor, Tensor, Tensor)")


def fake(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p, draft_probs, k,
         delta, lam, node_budget, seed, offset, rows=None):
    B, T = tokens.shape
    i64 = dict(dtype=torch.int64, device=logits.device)
    return (logits.new_empty((B,), **i64), logits.new_empty((B, max(T - 1, 0)), **i64),
            logits.new_empty((B,), **i64), logits.new_empty((B, T), dtype=torch.int8))


def to_schema(backend: str, logits, tokens, parents, neighbours=None, *, uncond_logits=None, cfg_scale=1.0,
              temperature=1.0, top_k=0, top_p=1.0, draft_probs=None, k=0, delta=0.0, lam=None, budget="candidate",
              seed=0, offset=0, rows=None) -> tuple:
    """The schema's arguments; cfg_scale and temperature in the backend's compute type, the row keys as
    contiguous int64 [B] (None: the kernels use b)."""
    B, dev = logits.shape[0], logits.device
    real = library.compute_dtype(logits, backend)
    return (logits, tokens, parents, neighbours if k > 0 else None, uncond_logits,
            library.row_setting(cfg_scale, B, real, dev), library.row_setting(temperature, B, real, dev),
            library.row_setting(top_k, B, torch.int64, dev), library.row_setting(top_p, B, torch.float64, dev),
            draft_probs, int(k), float(delta), None if lam is None else float(lam), budget == "node",
            library.seed_tensor(seed, dev), library.offset_tensor(offset, dev),
            None if rows is None else rows.to(device=dev, dtype=torch.int64).contiguous())


def _reference_kernel(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
                      draft_probs, k, delta, lam, node_budget, seed, offset, rows=None):
    return tuple(reference(
        logits, tokens, parents, neighbours, uncond_logits=uncond_logits, cfg_scale=cfg_scale,
        temperature=temperature, top_k=top_k, top_p=top_p, draft_probs=draft_probs, k=k, delta=delta, lam=lam,
        budget="node" if node_budget else "candidate", seed=library.unsigned(seed), offset=int(offset), rows=rows))


def _result(out) -> VerifyResult:
    return VerifyResult(*out)


OP = library.Op("verify", SCHEMA, fake, to_schema=to_schema, from_schema=_result, reference_kernel=_reference_kernel,
                backends={
                    "reference": reference,      # ops/reference/verify.py
                    "cpu": library.EXTENSION,    # csrc/cpu/verify.cpp
                    "cuda": library.EXTENSION,   # csrc/cuda/verify.cu
                    "triton": "lantern.kernels.verify",
                })


def verify(
    logits,
    tokens,
    parents,
    neighbours=None,
    *,
    uncond_logits=None,
    cfg_scale=1.0,
    temperature=1.0,
    top_k=0,
    top_p=1.0,
    draft_probs=None,
    k: int = 0,
    delta: float = 0.0,
    lam: Optional[float] = None,
    budget: str = "candidate",
    seed: ScalarOrTensor = 0,
    offset: ScalarOrTensor = 0,
    rows: Optional[torch.Tensor] = None,
    backend: Optional[str] = None,
) -> VerifyResult:
    """§3-5: verify a batch of draft trees in one call (see ``reference.verify`` for the definition).
    rows [B] (integer, values in [0, 2^32)): the Philox counter's row word of each row (default b), e.g. the
    image ids, so that a row's draws do not depend on its place in the batch. ``backend``: which backend runs
    it (default: the one ``lantern.enable_fused`` / ``lantern.fused`` chose)."""
    cfg_scale, temperature, top_k, top_p, k, delta, lam, seed, offset = map(
        c.plain, (cfg_scale, temperature, top_k, top_p, k, delta, lam, seed, offset))
    check(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p, draft_probs, k,
          delta, lam, budget, seed, offset, rows)
    impl = _backend.dispatch("verify", logits.device, backend)
    return impl(
        logits, tokens, parents, neighbours, uncond_logits=uncond_logits, cfg_scale=cfg_scale,
        temperature=temperature, top_k=top_k, top_p=top_p, draft_probs=draft_probs, k=k, delta=delta,
        lam=lam, budget=budget, seed=seed, offset=offset, rows=rows,
    )


def check(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
                 draft_probs, k, delta, lam, budget, seed, offset, rows=None) -> None:
    ranges = c.check_logits_pair(logits, uncond_logits, ndim=3)
    B, T, V = logits.shape
    dev = logits.device
    c.tensor("tokens", tokens, shape=[B, T], dtypes=(torch.int64,), device=dev)
    c.tensor("parents", parents, shape=[B, T], dtypes=(torch.int64,), device=dev)
    c.check_parents(parents)
    if c.scan_values():
        is_pad = torch.zeros_like(parents, dtype=torch.bool)
        is_pad[:, 1:] = parents[:, 1:] < 0
        bad = torch.where(is_pad, tokens != -1, (tokens < 0) | (tokens >= V))  # [B, T]
        if bool(bad.any()):  # one host sync; then the message
            c.in_range("tokens", tokens[~is_pad], 0, V)
            raise ValueError("tokens of padding nodes (parents == -1, i > 0) must be -1")
    c.check_sampling_settings(cfg_scale, temperature, top_k, top_p, B, dev)
    c.check_processed_logits(logits, uncond_logits, cfg_scale, temperature, ranges)
    if draft_probs is not None:
        c.tensor("draft_probs", draft_probs, shape=[B, T, V], dtypes=c.FLOAT_DTYPES, device=dev)
        if c.scan_values() and draft_probs.numel() and not 0 <= float(draft_probs.detach().amin()) <= \
                float(draft_probs.detach().amax()) < c.FLOAT32_OVERFLOW:  # NaN fails the comparisons too
            raise ValueError("draft_probs must be finite (in float32) and >= 0")
    if isinstance(k, bool) or not isinstance(k, int):
        raise TypeError(f"k must be an int, got {type(k).__name__}")
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if k > 0:
        if neighbours is None:
            raise ValueError(f"neighbours must be given when k > 0 (k={k})")
    if neighbours is not None:
        c.tensor("neighbours", neighbours, ndim=2, dtypes=(torch.int32,), device=dev)
        if neighbours.shape[0] != V:
            raise ValueError(f"neighbours must have V={V} rows (one per token), got {list(neighbours.shape)}")
        if k > neighbours.shape[1]:
            raise ValueError(f"k={k} exceeds the neighbour table width K={neighbours.shape[1]}")
        if k > 0 and c.scan_values() and not _NEIGHBOUR_TABLES.known_valid(neighbours, k):
            c.in_range("neighbours", neighbours[:, :k], 0, V)
            _NEIGHBOUR_TABLES.remember(neighbours, k)
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not c.fits_float32(delta) or delta < 0:
        raise ValueError(f"delta must be a number >= 0, finite in float32 (the kernels' type), got {delta!r}")
    if lam is not None:
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not c.fits_float32(lam - 1.0) or lam < 1:
            raise ValueError(f"lam must be a number >= 1 with lam - 1 finite in float32 (or None for delta mode), "
                             f"got {lam!r}")
        if budget != "candidate":
            raise ValueError("budget='node' applies to delta mode; lambda mode (lam given) needs budget='candidate'")
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    c.check_counter("seed", seed, 64)
    c.check_counter("offset", offset, 32)
    if rows is not None:
        check_row_keys(rows, B, dev)


def check_row_keys(rows, B: int, device) -> None:
    """rows: an integer tensor [B] on ``device`` of Philox row words, each in [0, 2^32)."""
    c.tensor("rows", rows, dtypes=c.INT_DTYPES, device=device, shape=(B,))
    if c.scan_values() and rows.numel() and bool((rows.min() < 0) | (rows.max() >= 2**32)):
        c.in_range("rows", rows, 0, 2**32)


class ValidatedTables:
    """Neighbour tables whose first k columns were already checked to hold ids in [0, V) (V = the table's
    row count), so that decoding, which passes the same table to every verify call, scans its V·k ids once
    instead of on every call. An entry is keyed on the tensor object itself (held by a weak reference) and
    remembers its data_ptr, shape, strides and version counter: an in-place edit of the tensor or of any
    view of its storage bumps the shared version counter (torch's autograd bookkeeping), so the table is
    checked again. Writes that bypass the version counter (through .data, numpy or DLPack aliases) are not
    seen, and inference-mode tensors (no version counter) are checked on every call."""

    def __init__(self, capacity: int = 8) -> None:
        self.capacity = capacity
        self.entries: "dict[int, tuple]" = {}  # id(tensor) -> (weakref, fingerprint, k checked)

    fingerprint = staticmethod(c.tensor_fingerprint)

    def known_valid(self, t: torch.Tensor, k: int) -> bool:
        entry = self.entries.get(id(t))
        if entry is None:
            return False
        ref, fingerprint, k_checked = entry
        return ref() is t and k <= k_checked and fingerprint is not None and fingerprint == self.fingerprint(t)

    def remember(self, t: torch.Tensor, k: int) -> None:
        fingerprint = self.fingerprint(t)
        if fingerprint is None:
            return
        key = id(t)
        self.entries.pop(key, None)
        while len(self.entries) >= self.capacity:
            self.entries.pop(next(iter(self.entries)))  # the oldest
        self.entries[key] = (weakref.ref(t, lambda _, key=key: self.entries.pop(key, None)), fingerprint, k)


_NEIGHBOUR_TABLES = ValidatedTables()
