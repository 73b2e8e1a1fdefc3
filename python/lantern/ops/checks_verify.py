"""Argument checks for process_logits, verify and philox_uniform (SPEC §9)."""
from __future__ import annotations

import math
import weakref

import torch

from . import checks as c

BUDGETS = ("candidate", "node")


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


def _check_sampling_settings(cfg_scale, temperature, top_k, top_p, B, V, device) -> None:
    c.per_row("cfg_scale", cfg_scale, B, device)
    c.per_row("temperature", temperature, B, device)
    c.per_row("top_k", top_k, B, device, integer=True)
    c.per_row("top_p", top_p, B, device)
    if not c.scan_values():
        return
    numbers = [v for v in (cfg_scale, temperature, top_k, top_p) if not isinstance(v, torch.Tensor)]
    if len(numbers) == 4 and math.isfinite(cfg_scale) and math.isfinite(temperature) and temperature >= 0 \
            and top_k >= 0 and 0 < top_p <= 1:
        return  # Python numbers, all valid: no tensor work (the common case of every decoding step)
    if not bool(torch.isfinite(c.values(cfg_scale)).all()):
        raise ValueError(f"cfg_scale must be finite, got {cfg_scale}")
    t = c.values(temperature)
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    kk = c.values(top_k)
    if bool((kk < 0).any()):
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    p = c.values(top_p)
    if not bool(((p > 0) & (p <= 1)).all()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _check_logits_pair(logits, uncond_logits, name="logits", ndim=None):
    c.tensor(name, logits, dtypes=c.FLOAT_DTYPES, ndim=ndim)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have a non-empty last (vocabulary) dimension, got {list(logits.shape)}")
    c.no_nan(name, logits)
    if uncond_logits is not None:
        c.tensor("uncond_logits", uncond_logits, dtypes=c.FLOAT_DTYPES, device=logits.device,
                 shape=list(logits.shape))
        c.no_nan("uncond_logits", uncond_logits)


def check_process_logits(logits, uncond_logits, cfg_scale, temperature, top_k, top_p) -> None:
    _check_logits_pair(logits, uncond_logits)
    rows = logits.shape[0] if logits.dim() >= 2 else 1
    _check_sampling_settings(cfg_scale, temperature, top_k, top_p, rows, logits.shape[-1], logits.device)


def check_verify(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
                 draft_probs, k, delta, lam, budget, seed, offset) -> None:
    _check_logits_pair(logits, uncond_logits, ndim=3)
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
    _check_sampling_settings(cfg_scale, temperature, top_k, top_p, B, V, dev)
    if draft_probs is not None:
        c.tensor("draft_probs", draft_probs, shape=[B, T, V], dtypes=c.FLOAT_DTYPES, device=dev)
        if c.scan_values() and (not bool(torch.isfinite(draft_probs).all()) or bool((draft_probs < 0).any())):
            raise ValueError("draft_probs must be finite and >= 0")
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
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta) or delta < 0:
        raise ValueError(f"delta must be a finite number >= 0, got {delta!r}")
    if lam is not None:
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not math.isfinite(lam) or lam < 1:
            raise ValueError(f"lam must be a finite number >= 1 (or None for delta mode), got {lam!r}")
        if budget != "candidate":
            raise ValueError("budget='node' applies to delta mode; lambda mode (lam given) needs budget='candidate'")
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    _check_counter("seed", seed, 64)
    _check_counter("offset", offset, 32)


def _check_counter(name: str, value, bits: int) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point():
            raise ValueError(f"{name} must be an int or a one-element integer tensor, got {value.dtype} "
                             f"{list(value.shape)}")
        return  # a tensor's value is read inside the op (no host sync here)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or a one-element integer tensor, got {type(value).__name__}")
    if not 0 <= value < 2**bits:
        raise ValueError(f"{name} must be in [0, 2^{bits}), got {value}")


def check_philox(seed, c0, c1, c2, c3) -> torch.device:
    """Returns the device of the counter tensors (CPU if all counters are ints)."""
    _check_counter("seed", seed, 64)
    device = None
    for name, v in zip(("c0", "c1", "c2", "c3"), (c0, c1, c2, c3)):
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() or v.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer tensor, got {v.dtype}")
            if device is not None and v.device != device:
                raise ValueError(f"{name} is on {v.device} but another counter is on {device}")
            device = v.device
            c.in_range(name, v, 0, 2**32)
        elif isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32:
            raise ValueError(f"{name} must be an int in [0, 2^32) or an integer tensor, got {v!r}")
    return device or torch.device("cpu")
