"""The argument checks' building blocks, shared by the op modules (each op's own checks are its module's
``check``; SPEC §9): each raises ValueError/TypeError naming the argument. Data-dependent checks (token ranges,
tree order, NaN) inspect values, which costs a host sync on GPU tensors; they run once here, before any backend,
so all backends raise the same errors.
Type, shape, dtype and device checks always run; the value scans run in eager mode only (``scan_values``)."""
from __future__ import annotations

import contextlib
import math
import numbers
import threading
import weakref
from typing import Optional, Sequence

import numpy as np
import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
INT_DTYPES = (torch.int32, torch.int64)


def tensor(name: str, t, *, ndim: Optional[int] = None, dtypes: Optional[Sequence[torch.dtype]] = None,
           device: Optional[torch.device] = None, shape: Optional[Sequence[Optional[int]]] = None) -> None:
    """Check that ``t`` is a tensor with the given rank, dtype, device and shape (None = any size)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device} (like the other inputs), got {t.device}")
    if shape is not None:
        if len(shape) != t.dim() or any(s is not None and s != n for s, n in zip(shape, t.shape)):
            want = "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"
            raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")


def memory_span(t: torch.Tensor):
    """[first byte, one past the last byte) of the elements of ``t`` (torch strides are never negative), or
    None when ``t`` holds no elements or has no real memory (meta tensors, or fake tensors while
    torch.compile traces)."""
    if t.numel() == 0 or t.device.type == "meta" or torch.compiler.is_compiling():
        return None
    try:
        start = t.data_ptr()
    except RuntimeError:  # a fake or functional tensor of a trace (make_fx, inductor's lowering): no memory
        return None
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))  # elements from the first to the last
    return start, start + (extent + 1) * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory spans of ``a`` and ``b`` intersect (on one device). Conservative: two strided views
    that interleave without sharing an element count as overlapping."""
    if a.device != b.device:
        return False
    span_a, span_b = memory_span(a), memory_span(b)
    return span_a is not None and span_b is not None and span_a[0] < span_b[1] and span_b[0] < span_a[1]


def not_overlapping(output_name: str, output: torch.Tensor, **inputs: torch.Tensor) -> None:
    """An op that writes ``output`` in place must not read an input from the same memory: a kernel that
    overwrites its own lengths or indices mid-copy reads garbage (and may leave the tensor)."""
    for name, t in inputs.items():
        if overlaps(output, t):
            raise ValueError(f"{name} overlaps the memory of {output_name}, which the op modifies in place; "
                             f"pass a copy ({name}.clone())")


def plain(value):
    """A numpy scalar (np.float32(0.5), np.int64(3)) as the Python number it holds, so that settings given
    through numpy mean the same as Python numbers on every backend; anything else unchanged (np.bool_
    becomes a bool, which the checks refuse as a number)."""
    return value.item() if isinstance(value, np.generic) else value


_caller = threading.local()


def scan_values() -> bool:
    """Whether the value-dependent checks run: in eager mode unless the caller checks the values itself
    (``values_checked_by_caller``), never while torch.compile (or export) traces. A traced graph holds no
    values to test, and a test there would be a host sync in every replay, so compiled code skips them
    (docs/dispatch.md); shapes, dtypes and devices are still checked at trace time, and the kernels never
    read or write out of bounds whatever the values."""
    return not torch.compiler.is_compiling() and not getattr(_caller, "checks_values", False)


@contextlib.contextmanager
def values_checked_by_caller():
    """Within this block (this thread), the ops and models skip their value scans: for a caller that builds
    the ops' inputs itself and checks what it does not build in one folded test per step (the decoding
    loops: at most one host sync per step, docs/dispatch.md). Shape, dtype and device checks still run."""
    before = getattr(_caller, "checks_values", False)
    _caller.checks_values = True
    try:
        yield
    finally:
        _caller.checks_values = before


def finite(name: str, t: torch.Tensor) -> None:
    if not scan_values():
        return
    if t.is_floating_point() and not bool(torch.isfinite(t).all()):
        raise ValueError(f"{name} contains NaN or infinite values")


def no_nan(name: str, t: torch.Tensor) -> None:
    """-inf logits are allowed (masked tokens); NaN and +inf are not. One reduction pass and no temporary:
    the maximum is NaN if any value is NaN (torch's max propagates NaN) and +inf if any value is +inf."""
    if not t.is_floating_point() or t.numel() == 0 or not scan_values():
        return
    top = float(t.detach().amax())
    if math.isnan(top) or top == math.inf:
        raise ValueError(f"{name} contains NaN or +inf values")


def in_range(name: str, t: torch.Tensor, lo: int, hi: int, allow: Optional[int] = None) -> None:
    """Every value v satisfies lo <= v < hi (or v == allow)."""
    if t.numel() == 0 or not scan_values():
        return
    if allow is None:  # fast path: two reductions, no [*t.shape] boolean temporaries
        least, most = torch.aminmax(t.detach())
        if lo <= int(least) and int(most) < hi:
            return
    bad = (t < lo) | (t >= hi)
    if allow is not None:
        bad &= t != allow
    if bool(bad.any()):
        v = t[bad].flatten()[0].item()
        raise ValueError(f"{name} has value {v} outside [{lo}, {hi})")


def per_row(name: str, value, B: int, device: torch.device, *, integer: bool = False) -> None:
    """A setting given as a Python number or a ``[B]`` (or 0-d) tensor."""
    if isinstance(value, torch.Tensor):
        if value.dim() > 1 or (value.dim() == 1 and value.shape[0] != B):
            raise ValueError(f"{name} must be a number or a tensor of shape [{B}], got {list(value.shape)}")
        if value.device != device:
            raise ValueError(f"{name} must be on {device} (like the logits), got {value.device}")
        if integer and value.is_floating_point():
            raise TypeError(f"{name} must be an integer tensor, got {value.dtype}")
    elif isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
    elif integer and not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")


def values(value) -> torch.Tensor:
    """A setting's values as a float64 CPU tensor (an int too large for a double becomes +-inf)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", torch.float64)
    try:
        number = float(value)
    except OverflowError:
        number = math.inf if value > 0 else -math.inf
    return torch.tensor(number, dtype=torch.float64)


def tensor_fingerprint(t: torch.Tensor):
    """What identifies a tensor's current contents for a skipped re-scan (storage, layout, version counter);
    None for inference tensors, which have no version counter (they are always scanned)."""
    try:
        version = t._version
    except RuntimeError:
        return None
    return (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, t.device, version)


class RecentlyValid:
    """The inputs of the last few calls whose value scans passed, so that the same tensors passed again
    unchanged (every layer of a forward passes tree_attention the same cache_len and tree_mask) are not
    scanned again. An entry holds weak references to the tensors, the call's other parameters, and each
    tensor's data_ptr, shape, strides, dtype, device and version counter: an in-place edit of the tensor or
    of any view of its storage bumps the version, so it is scanned again. Writes that bypass the version
    counter (through .data, numpy or DLPack aliases) are not seen, and inference-mode tensors (no version
    counter) are scanned on every call."""

    def __init__(self, capacity: int = 4) -> None:
        self.capacity = capacity
        self.entries: list = []  # [(weakrefs, params, fingerprints)], newest last

    fingerprint = staticmethod(tensor_fingerprint)

    def known(self, tensors: tuple, params: tuple) -> bool:
        for refs, entry_params, fingerprints in reversed(self.entries):
            if entry_params == params and all(r() is t for r, t in zip(refs, tensors)):
                prints = tuple(self.fingerprint(t) for t in tensors)
                return None not in prints and prints == fingerprints
        return False

    def remember(self, tensors: tuple, params: tuple) -> None:
        prints = tuple(self.fingerprint(t) for t in tensors)
        if None in prints:
            return
        self.entries = self.entries[-(self.capacity - 1):] + [
            (tuple(weakref.ref(t) for t in tensors), params, prints)]


def check_parents(parents: torch.Tensor, name: str = "parents") -> None:
    """parents [B, T] int64: parents[:, 0] == -1; each other node is padding (-1) or has a parent
    that comes before it and is not padding itself."""
    tensor(name, parents, ndim=2, dtypes=(torch.int64,))
    B, T = parents.shape
    if T < 1:
        raise ValueError(f"{name} must have at least one node (the root), got shape {list(parents.shape)}")
    if not scan_values() or _PARENTS.known((parents,), ()):
        return
    if _parents_valid(parents):
        _PARENTS.remember((parents,), ())
        return
    # something is wrong: the rules one by one, to name the first that fails
    if bool((parents[:, 0] != -1).any()):
        raise ValueError(f"{name}[:, 0] must be -1 (node 0 is the root)")
    if T == 1:
        return
    idx = torch.arange(T, device=parents.device)
    rest = parents[:, 1:]
    if bool(((rest < -1) | (rest >= idx[1:])).any()):
        raise ValueError(f"{name} must be topologically ordered: parents[b, i] < i (or -1 for padding)")
    # a real node's parent must itself be real (the root, or a node with a parent)
    is_real = torch.cat([torch.ones_like(parents[:, :1], dtype=torch.bool), parents[:, 1:] >= 0], 1)
    parent_real = torch.gather(is_real, 1, rest.clamp(min=0))
    if bool(((rest >= 0) & ~parent_real).any()):
        raise ValueError(f"{name} links a node to a padding node (parents[b, i] names a node whose parent is -1)")


_PARENTS = RecentlyValid()  # decoding checks each step's tree twice (ancestor_mask, verify)


def _parents_valid(parents: torch.Tensor) -> bool:
    """Every rule of check_parents at once (one host sync)."""
    T = parents.shape[1]
    bad = (parents[:, 0] != -1).any()
    if T > 1:
        rest = parents[:, 1:]  # [B, T - 1]
        is_real = torch.cat([torch.ones_like(parents[:, :1], dtype=torch.bool), rest >= 0], 1)  # [B, T]
        parent_real = torch.gather(is_real, 1, rest.clamp(0, T - 1))
        ids = torch.arange(1, T, device=parents.device)
        bad = bad | ((rest < -1) | (rest >= ids) | ((rest >= 0) & ~parent_real)).any()
    return not bool(bad)


def int_arg(name: str, value, lo: int, hi: int) -> int:
    """A Python (or numpy) integer, not a bool, with lo <= value <= hi."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"{name} must be in [{lo}, {hi}], got {int(value)}")
    return int(value)


def last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension (stride 1), got strides {t.stride()}")


# ---- settings shared by process_logits, verify, philox_uniform and continuous_verify (SPEC §1, §5, §9) ----

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


def check_sampling_settings(cfg_scale, temperature, top_k, top_p, B, device) -> None:
    """cfg_scale finite and temperature 0 or positive, both in float32 (a setting that overflows the
    kernels' type, or a temperature that rounds to 0 there, would mean something else on each backend);
    top_k an int64 >= 0; top_p in (0, 1]."""
    per_row("cfg_scale", cfg_scale, B, device)
    per_row("temperature", temperature, B, device)
    per_row("top_k", top_k, B, device, integer=True)
    per_row("top_p", top_p, B, device)
    if not scan_values() or _plain_settings_valid(cfg_scale, temperature, top_k, top_p):
        return
    s = values(cfg_scale)
    if not bool(torch.isfinite(s).all()):
        raise ValueError(f"cfg_scale must be finite, got {cfg_scale}")
    if not bool(torch.isfinite(s.float()).all()):
        raise ValueError(f"cfg_scale must be finite in float32 (the kernels' type), got {cfg_scale}")
    t = values(temperature)
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
    p = values(top_p)
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


def check_logits_pair(logits, uncond_logits, name="logits", ndim=None):
    """Shapes and dtypes; when values are scanned, no NaN / +inf and the range of every value, returned
    as [(least, largest)] (one per tensor; None when not scanned)."""
    tensor(name, logits, dtypes=FLOAT_DTYPES, ndim=ndim)
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"{name} must have a non-empty last (vocabulary) dimension, got {list(logits.shape)}")
    if uncond_logits is not None:
        tensor("uncond_logits", uncond_logits, dtypes=FLOAT_DTYPES, device=logits.device,
                 shape=list(logits.shape))
    if not scan_values() or logits.numel() == 0:
        return None
    ranges = [_logit_range(name, logits)]
    if uncond_logits is not None:
        ranges.append(_logit_range("uncond_logits", uncond_logits))
    return ranges


def _least_divisor(temperature) -> float:
    """The smallest number a row's logits are divided by: its temperature, or 1 for a greedy row."""
    t = values(temperature)
    return float(torch.where(t > 0, t, torch.ones_like(t)).min())


def check_processed_logits(logits, uncond_logits, cfg_scale, temperature, ranges, name="logits") -> None:
    """SPEC §1 gives a distribution only if every row's processed logits l = (lu + s (lc - lu)) / temperature
    have a finite maximum. Finite inputs can still overflow float32 (logits near its largest value, a huge
    cfg_scale, a tiny temperature): l then holds NaN or +inf, and each backend would make something else of
    it. A row with every token masked (-inf after guidance) has no distribution at all. Both raise
    ValueError, the same on every backend. The test is made in float32 (float64 inputs narrowed), the
    coarsest type a backend computes in: inputs and settings that pass it cannot overflow float64 either.
    ``ranges``: the inputs' (least, largest) values, from ``check_logits_pair``. A cheap bound settles the
    common case (no -inf anywhere, no possible overflow) without a pass over the logits; otherwise the
    processed logits are computed as the reference does."""
    if ranges is None:
        return
    if all(lo > -math.inf for lo, _ in ranges):
        largest = max(max(abs(lo), abs(hi)) for lo, hi in ranges)
        scale = float(values(cfg_scale).abs().max()) if uncond_logits is not None else 0.0
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


def check_counter(name: str, value, bits: int) -> None:
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_floating_point():
            raise ValueError(f"{name} must be an int or a one-element integer tensor, got {value.dtype} "
                             f"{list(value.shape)}")
        return  # a tensor's value is read inside the op (no host sync here)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int or a one-element integer tensor, got {type(value).__name__}")
    if not 0 <= value < 2**bits:
        raise ValueError(f"{name} must be in [0, 2^{bits}), got {value}")
