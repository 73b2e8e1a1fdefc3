"""Test-side stand-in for matrix products whose last bits depend on the shape of the call, as CPUs with AVX-512 /
AMX (oneDNN / MKL pick their blocking by the row count) and GPUs (split-K heuristics) give them.

``shape_dependent_rounding()`` patches ``torch.nn.functional.linear`` and ``scaled_dot_product_attention`` (what
nn.Linear and lantern's models call) so that each result is moved by one ulp, towards +inf, in the output
columns picked by a hash of the call's row count (linear: rows = every leading dimension; attention: batch,
heads and queries), and optionally of the thread count. A row's result then differs in its last bit between a
batch of 1 and a batch of 4, on every machine: a test that passes under it does not rely on batch-invariant
(or, with ``threads=True``, thread-invariant) matrix products. The shift is one ulp of the result's dtype:
2^-23 relative in float32, 2^-52 in float64; ``relative=r`` scales the picked results by 1 + r instead (a
negative control that must see a difference at all)."""
from __future__ import annotations

import contextlib
import math
from typing import Optional

import torch
import torch.nn.functional as F

_MIX_COLUMN, _MIX_SHAPE = 2654435761, 2246822519


def nudge(out: torch.Tensor, key: int, relative: Optional[float] = None) -> torch.Tensor:
    """out moved by one ulp towards +inf (or scaled by 1 + relative) in the last-dimension columns j whose hash
    of (j, key) has bit 13 set (about half of them)."""
    j = torch.arange(out.shape[-1], device=out.device, dtype=torch.int64)
    picked = (((j * _MIX_COLUMN + (key % 2**31) * _MIX_SHAPE) >> 13) & 1).bool()  # [N]
    moved = torch.nextafter(out, torch.full_like(out, math.inf)) if relative is None else out * (1 + relative)
    return torch.where(picked, moved, out)


@contextlib.contextmanager
def shape_dependent_rounding(threads: bool = False, relative: Optional[float] = None):
    """Within the block, F.linear and F.scaled_dot_product_attention round by the shape of the call (and, with
    ``threads``, by torch.get_num_threads()): see the module docstring."""
    linear, attention = F.linear, F.scaled_dot_product_attention
    threads_at_entry = torch.get_num_threads()

    def salt() -> int:
        if not threads:
            return 0
        # torch.compile cannot trace get_num_threads: a compiled call sees the count the block started with
        return 7919 * (threads_at_entry if torch.compiler.is_compiling() else torch.get_num_threads())

    def rounded_linear(x, weight, bias=None):
        out = linear(x, weight, bias)
        return nudge(out, out.numel() // max(out.shape[-1], 1) + salt(), relative)

    def rounded_attention(q, k, v, *args, **kwargs):
        out = attention(q, k, v, *args, **kwargs)
        return nudge(out, math.prod(out.shape[:-1]) + salt(), relative)

    F.linear, F.scaled_dot_product_attention = rounded_linear, rounded_attention
    try:
        yield
    finally:
        F.linear, F.scaled_dot_product_attention = linear, attention
