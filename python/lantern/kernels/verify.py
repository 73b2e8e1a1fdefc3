"""verify (SPEC §1, §3-§5) as one Triton launch for the whole batch: one program per row.

Each program walks its row's tree in scalar code and computes a visited node's target distribution P_node
on the fly, with tiled passes over the vocabulary into an O(V) scratch row (never [B, T, V]):
  1. guidance and temperature: l = (lu + s (lc - lu)) / t, written to the scratch row; running max
  2. top-k threshold: radix selection on order-preserving 32-bit keys of l, 4 bits per pass (8 passes,
     16-bin histograms); no sort
  3. the normaliser Z of the top-k set
  4. top-p threshold: radix search for the smallest kept pi = w / Z: per 4-bit digit, the count and
     float64 mass of each bin; a bin may hold kept tokens iff the mass strictly above it is <= top_p
  5. the final normaliser and p = w / Z' over the kept set, written over l.
The walk then reads p at candidates, gathers neighbour probabilities (§3.1), draws acceptance uniforms
(§5) and on a rejection rewrites the scratch row as the residual (2 passes), exactly as the reference
(python/lantern/ops/reference/verify.py); the next token is an exponential race over the row (1 pass).
Greedy rows (temperature 0) test every node's children against its unfiltered softmax (§4).

Compute type: float32 for every logits dtype (float16 / bfloat16 / float32 / float64 inputs are widened or
narrowed on load); float64 only for the top-p bin masses and the neighbour cumulative sums, as the
reference's float64 cumsum / CPU double accumulators. Philox4x32-10 is Triton's own ``tl.philox`` (key =
seed low/high words, counter (i, node, row, offset), word 0) and ``uint_to_uniform_float``: bit-identical
to ``lantern.ops.reference.philox``.
"""
from __future__ import annotations

import os
from typing import Optional, Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from ._common import configs, launcher
from ._jit import (
    _argmax,
    _argmin,
    _cumsum,
    _device,
    _exp,
    _exponential_key,
    _interpreting,
    _max,
    _min,
    _sum,
    _uniform,
)

# Digit width of the radix passes: 4 bits (8 passes of 16-bin histograms) on a GPU; under the interpreter,
# where each tl op costs the same whatever its size, 8 bits (4 passes of 256 bins). Both are exact.
RADIX_BITS = 8 if os.environ.get("TRITON_INTERPRET", "0") == "1" else 4
MAX_BLOCK_K = 1024


@_device
def _order_key(l):
    """int64 keys in [0, 2^32) that order float32 values as the floats (-0.0 just below +0.0)."""
    bits = l.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits >= 0, bits + 2147483648, -bits - 1)


@_device
def _from_order_key(key):
    bits = tl.where(key >= 2147483648, key - 2147483648, -key - 1)
    return bits.to(tl.int32).to(tl.float32, bitcast=True)


@_device
def _guided_tile(lc_ptr, lu_ptr, offs, mask, cfg, HAS_UNCOND: tl.constexpr):
    """l = lu + s (lc - lu) in float32 (-inf where lc or lu is -inf), -inf outside the row."""
    lc = tl.load(lc_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    if HAS_UNCOND:
        lu = tl.load(lu_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
        guided = lu + cfg * (lc - lu)
        lc = tl.where((lc == float("-inf")) | (lu == float("-inf")), float("-inf"), guided)
    return lc


@_device
def _digit_onehot(key, in_range, shift, BINS: tl.constexpr):
    """[BLOCK, BINS] one-hot of key's digit at ``shift`` for the keys in range."""
    digit = (key >> shift) & (BINS - 1)
    bins = tl.arange(0, BINS)
    return (digit[:, None] == bins[None, :]) & in_range[:, None]


@_device
def _mass_above(hist, BINS: tl.constexpr):
    """[BINS]: sum of hist over the bins above each bin."""
    bins = tl.arange(0, BINS)
    return _sum(tl.where(bins[None, :] > bins[:, None], hist[None, :], 0), axis=1)


# ---- the target distribution (SPEC §1) ---------------------------------------------------------------

@_device
def _top_k_threshold(p_row, V, top_k, BLOCK_V: tl.constexpr, BITS: tl.constexpr):
    """The top_k-th largest of l (held in p_row[0:V]) by radix selection on its order keys."""
    BINS: tl.constexpr = 1 << BITS
    bins = tl.arange(0, BINS)
    prefix = tl.full((), 0, tl.int64)
    remaining = tl.full((), 0, tl.int64) + top_k  # rank still to find inside the current key range
    for level in range(0, 32 // BITS):  # a runtime loop: 8 unrolled copies made the kernel slow to compile
        shift = 32 - BITS * (level + 1)
        hist = tl.full((BINS,), 0, tl.int64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < V
            key = _order_key(tl.load(p_row + offs, mask=mask, other=0.0))
            in_range = mask & ((key >> (shift + BITS)) == (prefix >> (shift + BITS)))
            hist += _sum(_digit_onehot(key, in_range, shift, BINS).to(tl.int64), axis=0)
        above = _mass_above(hist, BINS)
        chosen = (above < remaining) & (above + hist >= remaining)
        remaining -= _sum(tl.where(chosen, above, 0))
        prefix += _sum(tl.where(chosen, bins.to(tl.int64), 0)) << shift
    return _from_order_key(prefix)


@_device
def _top_p_min_key(p_row, V, l_max, z, threshold, top_p, BLOCK_V: tl.constexpr, BITS: tl.constexpr):
    """The smallest key (float32 bits) of pi = w / z whose mass strictly above is <= top_p (float64)."""
    BINS: tl.constexpr = 1 << BITS
    bins = tl.arange(0, BINS)
    prefix = tl.full((), 0, tl.int64)
    above = tl.full((), 0, tl.float64)  # mass of keys above the current range
    for level in range(0, 32 // BITS):  # a runtime loop: 8 unrolled copies made the kernel slow to compile
        shift = 32 - BITS * (level + 1)
        count = tl.full((BINS,), 0, tl.int32)
        mass = tl.full((BINS,), 0, tl.float64)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < V
            l = tl.load(p_row + offs, mask=mask, other=float("-inf"))
            kept = mask & (l >= threshold)
            pi = tl.where(kept, _exp(l - l_max), 0.0) / z
            key = pi.to(tl.int32, bitcast=True).to(tl.int64)
            in_range = kept & ((key >> (shift + BITS)) == (prefix >> (shift + BITS)))
            hot = _digit_onehot(key, in_range, shift, BINS)
            count += _sum(hot.to(tl.int32), axis=0)
            mass += _sum(tl.where(hot, pi.to(tl.float64)[:, None], 0.0), axis=0)
        above_bin = above + _mass_above(mass, BINS)
        usable = (count > 0) & (above_bin <= top_p)
        digit = _min(tl.where(usable, bins, BINS))
        above = _sum(tl.where(bins == digit, above_bin, 0.0))
        prefix += digit.to(tl.int64) << shift
    return prefix


@_device
def _enter_node(lc_row, lu_row, p_row, node, V, cfg, temperature, top_k, top_p, greedy,
                HAS_UNCOND: tl.constexpr, BLOCK_V: tl.constexpr, BITS: tl.constexpr):
    """P_node (SPEC §1) into p_row[0:V]; greedy: the unfiltered softmax of the guided logits."""
    lc_node = lc_row + node * V
    lu_node = lu_row + node * V
    divisor = tl.where(greedy, 1.0, temperature)
    run_max = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        l = _guided_tile(lc_node, lu_node, offs, mask, cfg, HAS_UNCOND) / divisor
        tl.store(p_row + offs, l, mask=mask)
        run_max = tl.maximum(run_max, l)
    l_max = _max(run_max)  # the top token survives both filters, so this is the kept set's max
    tl.debug_barrier()

    threshold = tl.full((), float("-inf"), tl.float32)
    if (not greedy) & (top_k > 0) & (top_k < V):
        threshold = _top_k_threshold(p_row, V, top_k, BLOCK_V, BITS)
    z = _kept_sum(p_row, V, l_max, threshold, BLOCK_V)
    min_key = tl.full((), 0, tl.int64)
    if (not greedy) & (top_p < 1.0):
        min_key = _top_p_min_key(p_row, V, l_max, z, threshold, top_p, BLOCK_V, BITS)
        z_top_k = z
        acc = tl.full((BLOCK_V,), 0, tl.float32)
        for start in range(0, V, BLOCK_V):
            acc += _top_p_weight(p_row, start + tl.arange(0, BLOCK_V), V, l_max, threshold, z_top_k, min_key)
        z = _sum(acc)
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            w = _top_p_weight(p_row, offs, V, l_max, threshold, z_top_k, min_key)
            tl.store(p_row + offs, w / z, mask=offs < V)
    else:
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            tl.store(p_row + offs, _kept_weight(p_row, offs, V, l_max, threshold) / z, mask=offs < V)
    tl.debug_barrier()


@_device
def _kept_weight(p_row, offs, V, l_max, threshold):
    """w = exp(l - max) on the top-k set (l >= threshold), 0 elsewhere and outside the row."""
    mask = offs < V
    l = tl.load(p_row + offs, mask=mask, other=float("-inf"))
    return tl.where(mask & (l >= threshold), _exp(l - l_max), 0.0)


@_device
def _top_p_weight(p_row, offs, V, l_max, threshold, z_top_k, min_key):
    """w on the top-p set: the kept weights whose pi = w / z_top_k has a key >= min_key, 0 elsewhere."""
    w = _kept_weight(p_row, offs, V, l_max, threshold)
    pi_key = (w / z_top_k).to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(pi_key >= min_key, w, 0.0)


@_device
def _kept_sum(p_row, V, l_max, threshold, BLOCK_V: tl.constexpr):
    """Z = sum of exp(l - max) over l >= threshold."""
    acc = tl.full((BLOCK_V,), 0, tl.float32)
    for start in range(0, V, BLOCK_V):
        acc += _kept_weight(p_row, start + tl.arange(0, BLOCK_V), V, l_max, threshold)
    return _sum(acc)


# ---- dense row passes ----------------------------------------------------------------------------------

@_device
def _row_sum(row, V, BLOCK_V: tl.constexpr):
    acc = tl.full((BLOCK_V,), 0, tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        acc += tl.load(row + offs, mask=offs < V, other=0.0)
    return _sum(acc)


@_device
def _row_divide(row, V, total, BLOCK_V: tl.constexpr):
    """row = row / max(total, tiny) if total > 0 else 0 (the reference's _normalise)."""
    divisor = tl.maximum(total, 1.1754943508222875e-38)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        w = tl.load(row + offs, mask=mask, other=0.0)
        tl.store(row + offs, tl.where(total > 0, w / divisor, 0.0), mask=mask)
    tl.debug_barrier()


@_device
def _load_draft(draft_node, q_row, V, BLOCK_V: tl.constexpr):
    """q' = the drafter row, normalised."""
    acc = tl.full((BLOCK_V,), 0, tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        q = tl.load(draft_node + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(q_row + offs, q, mask=mask)
        acc += q
    tl.debug_barrier()
    _row_divide(q_row, V, _sum(acc), BLOCK_V)


@_device
def _subtract_clamped(p_row, q_row, V, BLOCK_V: tl.constexpr):
    """p = max(0, p - q); returns its total."""
    acc = tl.full((BLOCK_V,), 0, tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        r = tl.maximum(tl.load(p_row + offs, mask=mask, other=0.0) - tl.load(q_row + offs, mask=mask, other=0.0),
                       0.0)
        tl.store(p_row + offs, r, mask=mask)
        acc += r
    tl.debug_barrier()
    return _sum(acc)


# ---- neighbours (SPEC §3.1) ----------------------------------------------------------------------------

@_device
def _merge(p_row, nbr_row, k, V, budget, BLOCK_K: tl.constexpr):
    """(m*, c_{m*}): c_m = sum_{i<=m} p(n_i), accumulated in float64 and rounded to float32 per m."""
    running = tl.full((), 0, tl.float64)
    merged = tl.full((), 0, tl.int32)
    mass = tl.full((), 0, tl.float32)
    for start in range(0, k, BLOCK_K):
        offs = start + tl.arange(0, BLOCK_K)
        valid = offs < k
        nbr = tl.load(nbr_row + offs, mask=valid, other=0)
        inside = valid & (nbr >= 0) & (nbr < V)
        p_n = tl.load(p_row + nbr, mask=inside, other=0.0).to(tl.float64)
        cum = running + _cumsum(p_n, axis=0)
        c = cum.to(tl.float32)
        ok = valid & (c <= budget)
        merged += _sum(ok.to(tl.int32))
        mass = tl.maximum(mass, _max(tl.where(ok, c, 0.0)))
        running = _max(tl.where(valid, cum, 0.0))
    return merged, mass


@_device
def _zero_merged(p_row, nbr_row, merged, V, BLOCK_K: tl.constexpr):
    """p = 0 on n_1..n_{m*}."""
    for start in range(0, merged, BLOCK_K):
        offs = start + tl.arange(0, BLOCK_K)
        valid = offs < merged
        nbr = tl.load(nbr_row + offs, mask=valid, other=0)
        tl.store(p_row + nbr, tl.full((BLOCK_K,), 0, tl.float32), mask=valid & (nbr >= 0) & (nbr < V))


# ---- the exponential race (SPEC §5) ----------------------------------------------------------------------

@_device
def _race(p_row, V, seed, node, row, offset, BLOCK_V: tl.constexpr):
    """argmin_i E_i / w_i over w_i > 0 (lower index on ties), E keyed by (i, node, row, offset)."""
    best_key = tl.full((), float("inf"), tl.float32)
    best = tl.full((), 0, tl.int64)
    c1 = node.to(tl.uint32)
    c2 = row.to(tl.uint32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        w = tl.load(p_row + offs, mask=mask, other=0.0)
        u = _uniform(seed, offs.to(tl.uint32), c1, c2, offset)
        e = _exponential_key(u)
        key = tl.where(mask & (w > 0), e / w, float("inf"))
        tile_key = _min(key)
        tile_arg = _argmin(key, axis=0).to(tl.int64) + start
        better = tile_key < best_key
        best = tl.where(better, tile_arg, best)
        best_key = tl.where(better, tile_key, best_key)
    return best


# ---- the walks -------------------------------------------------------------------------------------------

@_device
def _sampling_walk(lc_row, lu_row, draft_row, tok_row, par_row, nbrs, p_row, q_row, status_row, path_row,
                   T, V, K, k, delta, lam_m1, cfg, temperature, top_k, top_p, seed, row_key, offset,
                   HAS_UNCOND: tl.constexpr, SAMPLED: tl.constexpr, LAMBDA: tl.constexpr,
                   NODE_BUDGET: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr, BITS: tl.constexpr):
    """SPEC §3; returns (accept_len, next_token)."""
    node = tl.full((), 0, tl.int64)
    need_target = tl.full((), 1, tl.int32)  # P_node must be (re)computed before the next test
    moved = tl.full((), 0, tl.float32)  # M, in P_node's scale
    undecided = tl.full((), 1.0, tl.float32)  # R
    has_mass = tl.full((), 1, tl.int32)
    accepted = tl.full((), 0, tl.int64)
    accept_c0 = tl.full((), -2147483648, tl.int32).to(tl.uint32, bitcast=True)
    # Iteration c tests node c; P_node is entered at the start of the iteration after the root or an
    # accept, and once more at c = T when the residual has no mass: one inlined copy of _enter_node.
    for c_index in range(0, T + 1):
        c = tl.full((), 0, tl.int64) + c_index
        if (need_target != 0) | ((c == T) & (has_mass == 0)):
            _enter_node(lc_row, lu_row, p_row, node, V, cfg, temperature, top_k, top_p, False, HAS_UNCOND,
                        BLOCK_V, BITS)
            if SAMPLED:
                _load_draft(draft_row + node * V, q_row, V, BLOCK_V)
            need_target = tl.full((), 0, tl.int32)
        is_candidate = (c >= 1) & (c < T)
        if is_candidate:
            is_candidate = tl.load(par_row + c) == node
        if is_candidate:
            x = tl.minimum(tl.maximum(tl.load(tok_row + c), 0), V - 1)
            p_x = tl.load(p_row + x)
            if LAMBDA:
                budget = lam_m1 * p_x
            elif NODE_BUDGET:
                share = (delta - moved) / tl.maximum(undecided, 1.1754943508222875e-38)
                budget = tl.maximum(tl.where(undecided > 0, share, 0.0), 0.0)
            else:
                budget = tl.full((), 0, tl.float32) + delta
            nbr_row = nbrs + x * K
            merged = tl.full((), 0, tl.int32)
            mass = tl.full((), 0, tl.float32)
            if k > 0:
                merged, mass = _merge(p_row, nbr_row, k, V, budget, BLOCK_K)
            p_tilde = p_x + mass
            u = _uniform(seed, accept_c0, c.to(tl.uint32), row_key.to(tl.uint32), offset)
            if SAMPLED:
                accept = u * tl.load(q_row + x) < p_tilde
            else:
                accept = u < p_tilde
            tl.store(status_row + c, accept.to(tl.int8))
            if accept:
                tl.store(path_row + accepted, c)
                accepted += 1
                node = c
                need_target = tl.full((), 1, tl.int32)
                moved = tl.full((), 0, tl.float32)
                undecided = tl.full((), 1.0, tl.float32)
                has_mass = tl.full((), 1, tl.int32)
            else:
                _zero_merged(p_row, nbr_row, merged, V, BLOCK_K)
                tl.debug_barrier()
                if SAMPLED:
                    tl.store(p_row + x, p_tilde)  # p~_x: A(x) \ {x} collapsed onto x
                    tl.debug_barrier()
                    total = _subtract_clamped(p_row, q_row, V, BLOCK_V)
                    tl.store(q_row + x, 0.0)  # the next sibling's q' excludes x
                    tl.debug_barrier()
                    _row_divide(q_row, V, _row_sum(q_row, V, BLOCK_V), BLOCK_V)
                else:
                    tl.store(p_row + x, 0.0)  # the residual is P with exactly A(x) removed
                    tl.debug_barrier()
                    total = _row_sum(p_row, V, BLOCK_V)
                _row_divide(p_row, V, total, BLOCK_V)
                moved = moved + undecided * mass
                undecided = undecided * total
                has_mass = (total > 0).to(tl.int32)
    return accepted, _race(p_row, V, seed, node, row_key, offset, BLOCK_V)


@_device
def _better(v, i, w, j):
    """(v, i) ranks above (w, j): larger value, lower index on ties."""
    return (v > w) | ((v == w) & (i < j))


@_device
def _top2(p_row, V, BLOCK_V: tl.constexpr):
    """The two largest entries of p_row with their (lowest) indices; (-1.0, V) stands for none."""
    v1 = tl.full((), -1.0, tl.float32)
    v2 = tl.full((), -1.0, tl.float32)
    i1 = tl.full((), 0, tl.int64) + V
    i2 = tl.full((), 0, tl.int64) + V
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.load(p_row + offs, mask=mask, other=-1.0)
        a1 = _max(p)
        j1 = _argmax(p, axis=0).to(tl.int64) + start
        rest = tl.where(offs == j1, -1.0, p)
        a2 = _max(rest)
        j2 = tl.where(a2 >= 0, _argmax(rest, axis=0).to(tl.int64) + start, V)
        tile_wins = _better(a1, j1, v1, i1)
        n2 = tl.where(tile_wins, tl.where(_better(a2, j2, v1, i1), a2, v1), tl.where(_better(a1, j1, v2, i2), a1, v2))
        m2 = tl.where(tile_wins, tl.where(_better(a2, j2, v1, i1), j2, i1), tl.where(_better(a1, j1, v2, i2), j1, i2))
        v1, i1 = tl.where(tile_wins, a1, v1), tl.where(tile_wins, j1, i1)
        v2, i2 = n2, m2
    return v1, i1, v2, i2


@_device
def _guided_argmax(lc_row, lu_row, node, V, cfg, HAS_UNCOND: tl.constexpr, BLOCK_V: tl.constexpr):
    best_val = tl.full((), float("-inf"), tl.float32)
    best = tl.full((), 0, tl.int64)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        l = _guided_tile(lc_row + node * V, lu_row + node * V, offs, mask, cfg, HAS_UNCOND)
        tile_val = _max(l)
        tile_arg = _argmax(l, axis=0).to(tl.int64) + start
        better = (tile_val > best_val) | ((start == 0) & (tile_val == best_val))
        best = tl.where(better, tile_arg, best)
        best_val = tl.where(better, tile_val, best_val)
    return best


@_device
def _greedy_walk(lc_row, lu_row, tok_row, par_row, nbrs, p_row, depth_row, status_row, path_row,
                 T, V, K, k, delta, lam_m1, cfg,
                 HAS_UNCOND: tl.constexpr, LAMBDA: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_T: tl.constexpr, BITS: tl.constexpr):
    """SPEC §4; returns (accept_len, next_token)."""
    t_offs = tl.arange(0, BLOCK_T)
    all_parents = tl.load(par_row + t_offs, mask=t_offs < T, other=-1)
    for j in range(0, T):
        real = (j == 0) | (tl.load(par_row + j) >= 0)
        has_child = _sum((all_parents == j).to(tl.int32)) > 0
        if real & has_child:
            _enter_node(lc_row, lu_row, p_row, j, V, cfg, 1.0, 0, 1.0, True, HAS_UNCOND, BLOCK_V, BITS)
            v1, i1, v2, i2 = _top2(p_row, V, BLOCK_V)
            for c in range(j + 1, T):
                if tl.load(par_row + c) == j:
                    x = tl.minimum(tl.maximum(tl.load(tok_row + c), 0), V - 1)
                    p_x = tl.load(p_row + x)
                    if LAMBDA:
                        budget = lam_m1 * p_x
                    else:
                        budget = tl.full((), 0, tl.float32) + delta
                    mass = tl.full((), 0, tl.float32)
                    if k > 0:
                        _, mass = _merge(p_row, nbrs + x * K, k, V, budget, BLOCK_K)
                    p_tilde = p_x + mass
                    other = tl.where(i1 == x, v2, v1)
                    other_i = tl.where(i1 == x, i2, i1)
                    passes = (p_tilde > other) | ((p_tilde == other) & (x < other_i))
                    tl.store(status_row + c, passes.to(tl.int8))
            tl.debug_barrier()

    # the deepest node all of whose non-root ancestors pass (lowest index on ties): depth_row holds
    # 2 * depth + ok per node, the root counting as ok
    tl.store(depth_row, 1)
    best = tl.full((), 0, tl.int64)
    best_depth = tl.full((), 0, tl.int64)
    for c in range(1, T):
        tl.debug_barrier()
        par = tl.load(par_row + c)
        if par >= 0:
            parent = tl.load(depth_row + par)
            depth = (parent >> 1) + 1
            ok = (tl.load(status_row + c) == 1) & ((parent & 1) == 1)
            tl.store(depth_row + c, depth * 2 + ok.to(tl.int32))
            deeper = ok & (depth.to(tl.int64) > best_depth)
            best = tl.where(deeper, c, best)
            best_depth = tl.where(deeper, depth.to(tl.int64), best_depth)
    tl.debug_barrier()
    cursor = best
    while cursor > 0:
        depth = (tl.load(depth_row + cursor) >> 1).to(tl.int64)
        tl.store(path_row + depth - 1, cursor)
        cursor = tl.load(par_row + cursor)
    return best_depth, _guided_argmax(lc_row, lu_row, best, V, cfg, HAS_UNCOND, BLOCK_V)


@triton.jit
def _verify_kernel(logits, uncond, draft, tokens, parents, nbrs, cfg_scale, temperature, top_k, top_p, seed_ptr,
                   offset_ptr, row_keys, p_scratch, q_scratch, depth_scratch, accept_len, path, next_token, status,
                   T, V, K, k, delta, lam_m1,
                   HAS_UNCOND: tl.constexpr, SAMPLED: tl.constexpr, LAMBDA: tl.constexpr, HAS_ROWS: tl.constexpr,
                   NODE_BUDGET: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_T: tl.constexpr, BITS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    lc_row = logits + row * T * V
    lu_row = uncond + row * T * V
    draft_row = draft + row * T * V
    tok_row = tokens + row * T
    par_row = parents + row * T
    status_row = status + row * T
    path_row = path + row * (T - 1)
    p_row = p_scratch + row * V
    q_row = q_scratch + row * V
    seed = tl.load(seed_ptr)
    offset = (tl.load(offset_ptr) & 0xFFFFFFFF).to(tl.uint32)
    cfg = tl.load(cfg_scale + row)
    temp = tl.load(temperature + row)
    if HAS_ROWS:  # the counter's row word: the caller's key, or the row index
        row_key = tl.load(row_keys + row) & 0xFFFFFFFF
    else:
        row_key = row

    t_offs = tl.arange(0, BLOCK_T)
    tl.store(status_row + t_offs, tl.full((BLOCK_T,), -1, tl.int8), mask=t_offs < T)
    tl.store(path_row + t_offs, tl.full((BLOCK_T,), -1, tl.int64), mask=t_offs < T - 1)
    tl.debug_barrier()
    if temp == 0:
        n, token = _greedy_walk(lc_row, lu_row, tok_row, par_row, nbrs, p_row, depth_scratch + row * T, status_row,
                                path_row, T, V, K, k, delta, lam_m1, cfg, HAS_UNCOND, LAMBDA, BLOCK_V, BLOCK_K,
                                BLOCK_T, BITS)
    else:
        n, token = _sampling_walk(lc_row, lu_row, draft_row, tok_row, par_row, nbrs, p_row, q_row, status_row,
                                  path_row, T, V, K, k, delta, lam_m1, cfg, temp, tl.load(top_k + row),
                                  tl.load(top_p + row), seed, row_key, offset, HAS_UNCOND, SAMPLED, LAMBDA, NODE_BUDGET,
                                  BLOCK_V, BLOCK_K, BITS)
    tl.store(accept_len + row, n)
    tl.store(next_token + row, token)


# ---- launch ----------------------------------------------------------------------------------------------

GPU_CONFIGS = [triton.Config({"BLOCK_V": bv}, num_warps=w) for bv in (1024, 2048) for w in (4, 8)]
_autotuned = triton.autotune(configs(GPU_CONFIGS, GPU_CONFIGS[0]), key=["V", "HAS_UNCOND", "SAMPLED"])(_verify_kernel)


def run(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p, draft_probs, k,
         delta, lam, node_budget, seed, offset, rows, radix_bits: int):
    """One launch for the batch, with the schema's arguments and the radix digit width (4 or 8; ``launch`` passes
    this device's; the tests also run the other width under the interpreter) (settings [B], seed / offset 0-d
    int64, rows int64 [B] or None)."""
    B, T, V = logits.shape
    dev = logits.device
    logits = logits.contiguous()
    uncond = uncond_logits.contiguous() if uncond_logits is not None else logits
    draft = draft_probs.contiguous() if draft_probs is not None else logits
    k = int(k) if neighbours is not None else 0
    nbrs = neighbours.contiguous() if k > 0 else torch.zeros(1, dtype=torch.int32, device=dev)
    K = nbrs.shape[1] if k > 0 else 0
    accept_len = torch.empty(B, dtype=torch.int64, device=dev)
    path = torch.empty(B, max(T - 1, 0), dtype=torch.int64, device=dev)
    next_token = torch.empty(B, dtype=torch.int64, device=dev)
    status = torch.empty(B, T, dtype=torch.int8, device=dev)
    if B == 0:
        return accept_len, path, next_token, status
    p_scratch = torch.empty(B, V, dtype=torch.float32, device=dev)
    q_scratch = torch.empty(B, V, dtype=torch.float32, device=dev) if draft_probs is not None else p_scratch
    depth_scratch = torch.empty(B, T, dtype=torch.int32, device=dev)
    lam_m1 = float(lam) - 1.0 if lam is not None else 0.0
    args = (logits, uncond, draft, tokens.contiguous(), parents.contiguous(), nbrs, cfg_scale.contiguous(),
            temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), seed, offset,
            rows.contiguous() if rows is not None else accept_len, p_scratch, q_scratch,
            depth_scratch, accept_len, path, next_token, status, T, V, K, k, float(delta), lam_m1)
    flags = dict(HAS_UNCOND=uncond_logits is not None, SAMPLED=draft_probs is not None, LAMBDA=lam is not None,
                 HAS_ROWS=rows is not None, NODE_BUDGET=node_budget and lam is None,
                 BLOCK_K=triton.next_power_of_2(max(1, min(k, MAX_BLOCK_K))), BLOCK_T=triton.next_power_of_2(T),
                 BITS=radix_bits)
    if _interpreting():  # one config: the interpreter runs every program in Python
        with np.errstate(divide="ignore", invalid="ignore"):  # tl.where evaluates both sides (e / 0 masked)
            _verify_kernel[(B,)](*args, **flags, BLOCK_V=min(triton.next_power_of_2(V), 1024))
    else:  # no FMA contraction: guidance and the node budget round as the reference's separate ops
        launcher(_autotuned)[(B,)](*args, **flags, enable_fp_fusion=False)
    return accept_len, path, next_token, status


def launch(logits: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, neighbours: Optional[torch.Tensor],
           uncond_logits: Optional[torch.Tensor], cfg_scale: torch.Tensor, temperature: torch.Tensor,
           top_k: torch.Tensor, top_p: torch.Tensor, draft_probs: Optional[torch.Tensor], k: int, delta: float,
           lam: Optional[float], node_budget: bool, seed: torch.Tensor, offset: torch.Tensor,
           rows: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's kernel: ``run`` with this device's radix digit width. The annotations spell the op's schema
    (``SCHEMA`` of ``lantern.ops.verify_op``): torch versions whose triton_op ignores ``schema=`` infer it from them."""
    return run(logits, tokens, parents, neighbours, uncond_logits, cfg_scale, temperature, top_k, top_p,
               draft_probs, k, delta, lam, node_budget, seed, offset, rows, RADIX_BITS)
