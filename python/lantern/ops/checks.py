"""Argument checks shared by every backend (SPEC §9): each raises ValueError/TypeError naming the
argument. Data-dependent checks (token ranges, tree order, NaN) inspect values, which costs a host
sync on GPU tensors; they run once here, before any backend, so all backends raise the same errors.
Type, shape, dtype and device checks always run; the value scans run in eager mode only (``scan_values``)."""
from __future__ import annotations

import contextlib
import math
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


from .checks_verify import check_philox, check_process_logits, check_verify  # noqa: E402,F401
from .checks_continuous import check_continuous_verify  # noqa: E402,F401
from .checks_tree import (  # noqa: E402,F401
    check_build_tree,
    check_compact_kv,
    check_latent_neighbours,
    check_tree_attention,
)
