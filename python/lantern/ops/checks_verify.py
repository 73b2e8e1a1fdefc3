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


# Every backend computes §1 in float32 or finer: the triton backend narrows float64 logits and settings to
# float32 (docs/semantics.md "Precision"). So the checks bound inputs and settings by what float32 holds.
# float32 rounding of a positive double x: inf iff x >= 2^128 - 2^103 (FLT_MAX plus half an ulp), 0 iff
# x <= 2^-150.
FLOAT32_OVERFLOW = 2.0**128 - 2.0**103
FLOAT32_UNDERFLOW = 2.0**-150
FLOAT32_MAX = float(torch.finfo(torch.float32).max)
INT64_END = 2**63


def fits_float32(x) -> bool:
    """Whether the number x is finite in float32 (an int too large for a double is not)."""
    try:
        x = float(x)
    except OverflowError:
        return False
    return math.isfinite(x) and abs(x) < FLOAT32_OVERFLOW


def _plain_settings_valid(cfg_scale, temperature, top_k, top_p) -> bool:
    """Python numbers that every backend represents and accepts (the common case of every decoding step:
    decided without tensor work)."""
    numbers = [v for v in (cfg_scale, temperature, top_k, top_p) if not isinstance(v, torch.Tensor)]
    return (len(numbers) == 4 and fits_float32(cfg_scale) and fits_float32(temperature)
            and (temperature == 0 or temperature > FLOAT32_UNDERFLOW) and 0 <= top_k < INT64_END and 0 < top_p <= 1)


def _check_sampling_settings(cfg_scale, temperature, top_k, top_p, B, V, device) -> None:
    """cfg_scale finite and temperature 0 or positive, both in float32 (a setting that overflows the
    kernels' type, or a temperature that rounds to 0 there, would mean something else on each backend);
    top_k an int64 >= 0; top_p in (0, 1]."""
    c.per_row("cfg_scale", cfg_scale, B, device)
    c.per_row("temperature", temperature, B, device)
    c.per_row("top_k", top_k, B, device, integer=True)
    c.per_row("top_p", top_p, B, device)
    if not c.scan_values() or _plain_settings_valid(cfg_scale, temperature, top_k, top_p):
        return
    s = c.values(cfg_scale)
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"cfg_scale must be finite, got {cfg_scale}")
    if not bool(torch.isfinite(s.float()).all()):
        raise ValueError(f"cfg_scale must be finite in float32 (the kernels' type), got {cfg_scale}")
    t = c.values(temperature)
    if not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
        raise ValueError(f"temperature must be finite and >= 0, got {temperature}")
    if not bool(torch.isfinite(t.float()).all()):
        raise ValueError(f"temperature must be finite in float32 (the kernels' type), got {temperature}")
    if bool(((t > 0) & (t.float() == 0)).any()):
        raise ValueError(f"temperature must be 0 (greedy) or a positive value that stays positive in float32, "
                         f"got {temperature} (it rounds to 0)")
    if isinstance(top_k, torch.Tensor):
        negative = bool((top_k.detach().to("cpu", torch.int64) < 0).any())  # uint64 >= 2^63 wraps negative
    else:
        negative = not 0 <= top_k < INT64_END
    if negative:
        raise ValueError(f"top_k must be in [0, 2^63) (0 = off), got {top_k}")
    p = c.values(top_p)
    if not bool(((p > 0) & (p <= 1)).all()):
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _logit_range(name: str, t: torch.Tensor):
    """(least, largest) value of ``t`` as floats, in one pass. NaN and +inf raise (-inf is a masked token),
    and so do finite values beyond float32's range (float64 logits are narrowed to float32 by a backend)."""
    least, most = (float(v) for v in torch.aminmax(t.detach()))
    if math.isnan(least) or math.isnan(most) or most == math.inf:
        raise ValueError(f"{name} contains NaN or +inf values")
    if most >= FLOAT32_OVERFLOW or -math.inf < least <= -FLOAT32_OVERFLOW:
        raise ValueError(f"{name} holds finite values beyond float32's range ({least}, {most}); every backend "
                         f"must be able to compute in float32")
    return least, most


def _check_logits_pair(logits, uncond_logits, name="logits", ndim=None):
    """Shapes and dtypes; when values are scanned, no NaN / +inf and the range of every value, returned
    as [(least, largest)] (one per tensor; None when not scanned)."""
    c.tensor(name, logits, dtypes=c.FLOAT_DTYPES, ndim=ndim)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have a non-empty last (vocabulary) dimension, got {list(logits.shape)}")
    if uncond_logits is not None:
        c.tensor("uncond_logits", uncond_logits, dtypes=c.FLOAT_DTYPES, device=logits.device,
                 shape=list(logits.shape))
    if not c.scan_values() or logits.numel() == 0:
        return None
    ranges = [_logit_range(name, logits)]
    if uncond_logits is not None:
        ranges.append(_logit_range("uncond_logits", uncond_logits))
    return ranges


def _least_divisor(temperature) -> float:
    """The smallest number a row's logits are divided by: its temperature, or 1 for a greedy row."""
    t = c.values(temperature)
    return float(torch.where(t > 0, t, torch.ones_like(t)).min())


def check_processed_logits(logits, uncond_logits, cfg_scale, temperature, ranges, name="logits") -> None:
    """SPEC §1 gives a distribution only if every row's processed logits l = (lu + s (lc - lu)) / temperature
    have a finite maximum. Finite inputs can still overflow float32 (logits near its largest value, a huge
    cfg_scale, a tiny temperature): l then holds NaN or +inf, and each backend would make something else of
    it. A row with every token masked (-inf after guidance) has no distribution at all. Both raise
    ValueError, the same on every backend. The test is made in float32 (float64 inputs narrowed), the
    coarsest type a backend computes in: inputs and settings that pass it cannot overflow float64 either.
    ``ranges``: the inputs' (least, largest) values, from ``_check_logits_pair``. A cheap bound settles the
    common case (no -inf anywhere, no possible overflow) without a pass over the logits; otherwise the
    processed logits are computed as the reference does."""
    if ranges is None:
        return
    if all(lo > -math.inf for lo, _ in ranges):
        largest = max(max(abs(lo), abs(hi)) for lo, hi in ranges)
        scale = float(c.values(cfg_scale).abs().max()) if uncond_logits is not None else 0.0
        bound = largest * (1 + 2 * scale) / _least_divisor(temperature)  # |l| at any step (double: no overflow)
        if bound <= FLOAT32_MAX / 4:  # l - max l stays finite too
            return
    from .reference.process_logits import guide, row_setting

    narrow = lambda t: None if t is None else t.detach().float()  # noqa: E731
    with torch.no_grad():
        guided = guide(narrow(logits), narrow(uncond_logits), cfg_scale)  # [..., V] float32
        temp = row_setting(temperature, guided, torch.float32)
        scaled = guided / torch.where(temp == 0, torch.ones_like(temp), temp)  # greedy rows are not divided
        top = scaled.amax(-1)  # [...] each row's largest processed logit
    bad = ~(top < math.inf) | torch.isnan(scaled).any(-1)
    if bool(bad.any()):
        row = tuple(int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"{name}: guidance and temperature overflow float32: the processed logits (uncond_logits + cfg_scale "
            f"* ({name} - uncond_logits)) / temperature of row {row} hold NaN or +inf; use a smaller cfg_scale or "
            f"a larger temperature (or smaller logits)")
    masked = top == -math.inf
    if bool(masked.any()):
        row = tuple(int(i) for i in masked.nonzero()[0])
        raise ValueError(f"{name}: row {row} has every token masked (-inf after guidance): it has no distribution")


def check_process_logits(logits, uncond_logits, cfg_scale, temperature, top_k, top_p) -> None:
    ranges = _check_logits_pair(logits, uncond_logits)
    rows = logits.shape[0] if logits.dim() >= 2 else 1
    _check_sampling_settings(cfg_scale, temperature, top_k, top_p, rows, logits.shape[-1], logits.device)
    check_processed_logits(logits, uncond_logits, cfg_scale, temperature, ranges)


def check_verify(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
                 draft_probs, k, delta, lam, budget, seed, offset, rows=None) -> None:
    ranges = _check_logits_pair(logits, uncond_logits, ndim=3)
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
    check_processed_logits(logits, uncond_logits, cfg_scale, temperature, ranges)
    if draft_probs is not None:
        c.tensor("draft_probs", draft_probs, shape=[B, T, V], dtypes=c.FLOAT_DTYPES, device=dev)
        if c.scan_values() and draft_probs.numel() and not 0 <= float(draft_probs.detach().amin()) <= \
                float(draft_probs.detach().amax()) < FLOAT32_OVERFLOW:  # NaN fails the comparisons too
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
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not fits_float32(delta) or delta < 0:
        raise ValueError(f"delta must be a number >= 0, finite in float32 (the kernels' type), got {delta!r}")
    if lam is not None:
        if isinstance(lam, bool) or not isinstance(lam, (int, float)) or not fits_float32(lam - 1.0) or lam < 1:
            raise ValueError(f"lam must be a number >= 1 with lam - 1 finite in float32 (or None for delta mode), "
                             f"got {lam!r}")
        if budget != "candidate":
            raise ValueError("budget='node' applies to delta mode; lambda mode (lam given) needs budget='candidate'")
    if budget not in BUDGETS:
        raise ValueError(f"budget must be one of {BUDGETS}, got {budget!r}")
    _check_counter("seed", seed, 64)
    _check_counter("offset", offset, 32)
    if rows is not None:
        check_row_keys(rows, B, dev)


def check_row_keys(rows, B: int, device) -> None:
    """rows: an integer tensor [B] on ``device`` of Philox row words, each in [0, 2^32)."""
    c.tensor("rows", rows, dtypes=c.INT_DTYPES, device=device, shape=(B,))
    if c.scan_values() and rows.numel() and bool((rows.min() < 0) | (rows.max() >= 2**32)):
        c.in_range("rows", rows, 0, 2**32)


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
    shapes = [tuple(v.shape) for v in (c0, c1, c2, c3) if isinstance(v, torch.Tensor)]
    try:
        torch.broadcast_shapes(*shapes)
    except RuntimeError as e:
        raise ValueError(f"c0, c1, c2, c3 must broadcast together, got shapes {shapes}") from e
    return device or torch.device("cpu")
