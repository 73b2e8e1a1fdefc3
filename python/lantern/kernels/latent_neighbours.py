"""SPEC §2 in Triton: the latent neighbour table in one launch, one program per block of BLOCK_R codes.

No V x V matrix and no sort over a row of V distances. A program finds, for each of its rows x, the
exact K-th smallest distance by a radix search over the distance's float32 bits, then collects the K
winners and sorts only those:

1. Radix search (8 passes over the codebook). A squared distance d >= 0 is ranked by its IEEE bits read
   as uint32 (monotone for d >= 0, +inf included). Each pass fixes 4 more bits of D*, the largest value
   with count(bits < D*) < K, by counting the row's codes below 16 candidate thresholds at once.
   Afterwards count(bits < D*) < K <= count(bits <= D*).
2. Selection (1 pass). Every code with bits < D* is a neighbour, plus the first K - count(bits < D*) codes
   with bits == D* in index order (ties go to the lower index, SPEC §2). The K ids are written into the
   row of the output in index order (positions from a running count and a cumsum).
3. Order. The K ids are read back, their int64 keys (dist bits << 32 | id) recomputed bit for bit, and
   each id is stored at its rank among the row's K keys (a K x K count in chunks; keys are unique).

Distances are computed exactly as the reference does (direct differences, ``acc += diff * diff`` over j in
order, float32) and the kernel is compiled with ``enable_fp_fusion=False`` so no FMA changes a rounding:
the table equals the reference's bit for bit. (The ||x||^2 + ||y||^2 - 2 x.y form would put the work on
tensor cores with tl.dot, but it cancels catastrophically for close codes -- exactly the pairs a
neighbour table is about -- and with d = 8 the distances are not the bottleneck anyway.)

Memory: the output (written twice, read once) plus O(BLOCK_R * (BLOCK_C + K)) registers per program.
Float32 conversion and the optional L2 normalisation reuse the reference's helper (an O(V d) torch op).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from lantern.ops.reference.latent_neighbours import codebook_float32

from ._common import configs, interpreting, launcher, next_power_of_2

RADIX_BITS = 4  # bits of D* fixed per pass: 16 thresholds counted at once
N_PASSES = 32 // RADIX_BITS


@triton.jit
def _distance_bits(codes, codes_t, row_ids, row_ok, col_ids, V, D: tl.constexpr):
    """uint32 [R, C]: float32 bits of sum_j (x_j - y_j)^2, j in order, for rows x (ids [R]) and columns y
    (ids [C]); 0xFFFFFFFF (above every threshold, so never counted) where y == x or y >= V."""
    col_ok = col_ids < V
    acc = tl.zeros([row_ids.shape[0], col_ids.shape[0]], dtype=tl.float32)
    for j in tl.static_range(D):
        x_j = tl.load(codes + row_ids * D + j, mask=row_ok, other=0.0)  # [R]
        y_j = tl.load(codes_t + j * V + col_ids, mask=col_ok, other=0.0)  # [C]
        diff = x_j[:, None] - y_j[None, :]
        acc += diff * diff
    bits = acc.to(tl.uint32, bitcast=True)
    excluded = (row_ids[:, None] == col_ids[None, :]) | (col_ids[None, :] >= V)
    return tl.where(excluded, tl.full(bits.shape, 0xFFFFFFFF, tl.uint32), bits)


@triton.jit
def _kth_distance_bits(codes, codes_t, row_ids, row_ok, V, K, D: tl.constexpr, BLOCK_C: tl.constexpr,
                       RADIX: tl.constexpr, PASSES: tl.constexpr):
    """Per row: (D* = the K-th smallest distance bits, count of codes with bits < D*), uint32 / int32 [R]."""
    R: tl.constexpr = row_ids.shape[0]
    digits = tl.arange(0, 1 << RADIX).to(tl.uint32)  # [16] candidate digits
    prefix = tl.zeros([R], dtype=tl.uint32)  # bits of D* fixed so far
    below = tl.zeros([R], dtype=tl.int32)  # count(bits < prefix), always < K
    for p in range(PASSES):  # not unrolled: one copy of the pass keeps compile time down
        shift = 32 - (p + 1) * RADIX
        thresholds = prefix[:, None] + (digits[None, :] << shift)  # [R, 16]; no overflow (see module doc)
        counts = tl.zeros([R, 1 << RADIX], dtype=tl.int32)  # [R, 16] count(bits < threshold)
        for c0 in range(0, V, BLOCK_C):
            col_ids = c0 + tl.arange(0, BLOCK_C)
            bits = _distance_bits(codes, codes_t, row_ids, row_ok, col_ids, V, D)  # [R, C]
            counts += tl.sum((bits[:, :, None] < thresholds[:, None, :]).to(tl.int32), axis=1)
        digit = tl.sum((counts < K).to(tl.int32), axis=1) - 1  # [R]; digit 0 always counts (below < K)
        below = tl.sum(tl.where(digits[None, :] == digit[:, None].to(tl.uint32), counts, 0), axis=1)
        prefix += digit.to(tl.uint32) << shift
    return prefix, below


@triton.jit
def _select(codes, codes_t, out, row_ids, row_ok, kth, below, V, K, D: tl.constexpr, BLOCK_C: tl.constexpr):
    """Write the ids of each row's K neighbours into out[row, :K], in index order."""
    R: tl.constexpr = row_ids.shape[0]
    need = K - below  # [R] ties at D* to take, lowest index first; >= 1
    ties_seen = tl.zeros([R], dtype=tl.int32)
    written = tl.zeros([R], dtype=tl.int32)
    for c0 in range(0, V, BLOCK_C):
        col_ids = c0 + tl.arange(0, BLOCK_C)
        bits = _distance_bits(codes, codes_t, row_ids, row_ok, col_ids, V, D)  # [R, C]
        tie = bits == kth[:, None]
        tie_rank = ties_seen[:, None] + tl.cumsum(tie.to(tl.int32), axis=1)  # [R, C], 1-based
        chosen = (bits < kth[:, None]) | (tie & (tie_rank <= need[:, None]))
        slot = written[:, None] + tl.cumsum(chosen.to(tl.int32), axis=1) - 1  # [R, C]; < K by construction
        tl.store(out + row_ids[:, None].to(tl.int64) * K + slot, col_ids[None, :] + slot * 0,
                 mask=chosen & row_ok[:, None])
        written += tl.sum(chosen.to(tl.int32), axis=1)
        ties_seen += tl.sum(tie.to(tl.int32), axis=1)


@triton.jit
def _neighbour_keys(codes, row_ids, row_ok, ids, ok, D: tl.constexpr):
    """int64 [S, N]: (distance bits << 32) | id of code ids[s, n] from row row_ids[s], the distance
    recomputed bit for bit as in _distance_bits; int64 max where not ok."""
    acc = tl.zeros(ids.shape, dtype=tl.float32)
    for j in tl.static_range(D):
        x_j = tl.load(codes + row_ids * D + j, mask=row_ok, other=0.0)  # [S]
        y_j = tl.load(codes + ids * D + j, mask=ok, other=0.0)  # [S, N]
        diff = x_j[:, None] - y_j
        acc += diff * diff
    keys = (acc.to(tl.int32, bitcast=True).to(tl.int64) << 32) | ids.to(tl.int64)
    return tl.where(ok, keys, 0x7FFFFFFFFFFFFFFF)


@triton.jit
def _order_rows(codes, out, row_ids, row_ok, K, D: tl.constexpr, KP: tl.constexpr, CHUNK: tl.constexpr):
    """out[row, :K] (ids in any order) -> sorted by (distance, id). Each id's place is its rank, the number
    of the row's keys below its own (keys are unique), counted CHUNK keys at a time: no sort network."""
    lanes = tl.arange(0, KP)
    ok = row_ok[:, None] & (lanes[None, :] < K)  # [S, KP]
    row_base = out + row_ids[:, None].to(tl.int64) * K  # [S, 1]
    ids = tl.load(row_base + lanes[None, :], mask=ok, other=0)  # [S, KP] int32
    keys = _neighbour_keys(codes, row_ids, row_ok, ids, ok, D)  # [S, KP]
    rank = tl.zeros([row_ids.shape[0], KP], dtype=tl.int32)
    for c0 in range(0, K, CHUNK):
        other = c0 + tl.arange(0, CHUNK)
        other_ok = row_ok[:, None] & (other[None, :] < K)  # [S, CHUNK]
        other_ids = tl.load(row_base + other[None, :], mask=other_ok, other=0)
        other_keys = _neighbour_keys(codes, row_ids, row_ok, other_ids, other_ok, D)  # [S, CHUNK]
        rank += tl.sum((other_keys[:, None, :] < keys[:, :, None]).to(tl.int32), axis=2)
    tl.debug_barrier()  # every id of the row is read before any is moved
    tl.store(row_base + rank, ids, mask=ok)


def _autotune_configs():
    # rows share each column tile's loads; [BLOCK_R, BLOCK_C, 16] counts bound the registers
    gpu = [triton.Config({"BLOCK_R": r, "BLOCK_C": c}, num_warps=w)
           for r, c, w in ((16, 32, 4), (16, 64, 4), (32, 32, 8), (32, 64, 8))]
    return configs(gpu, triton.Config({"BLOCK_R": 64, "BLOCK_C": 256}, num_warps=4))


@triton.autotune(configs=_autotune_configs(), key=["V", "K", "D"])
@triton.jit
def _neighbours_kernel(codes, codes_t, out, V, K, D: tl.constexpr, KP: tl.constexpr, ORDER_ROWS: tl.constexpr,
                       CHUNK: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, RADIX: tl.constexpr,
                       PASSES: tl.constexpr):
    row_ids = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = row_ids < V
    kth, below = _kth_distance_bits(codes, codes_t, row_ids, row_ok, V, K, D, BLOCK_C, RADIX, PASSES)
    _select(codes, codes_t, out, row_ids, row_ok, kth, below, V, K, D, BLOCK_C)
    tl.debug_barrier()  # phase 3 reads what other threads of this program wrote
    for r0 in range(0, BLOCK_R, ORDER_ROWS):  # a loop, not unrolled: BLOCK_R / ORDER_ROWS may be 32
        order_ids = tl.program_id(0) * BLOCK_R + r0 + tl.arange(0, ORDER_ROWS)
        _order_rows(codes, out, order_ids, order_ids < V, K, D, KP, CHUNK)


def launch(codebook: torch.Tensor, K: int, normalize: bool) -> torch.Tensor:
    """codebook [V, d] float -> int32 [V, K], equal to the reference's table (checks already ran)."""
    codes = codebook_float32(codebook, normalize).contiguous()  # [V, d] float32
    codes_t = codes.t().contiguous()  # [d, V]: a column tile's coordinate j is contiguous
    V, d = codes.shape
    out = torch.empty(V, K, dtype=torch.int32, device=codes.device)  # [V, K]
    KP = next_power_of_2(K)
    # the rank count compares [ORDER_ROWS, KP, CHUNK] keys per step: few big steps under the interpreter,
    # 16K (128 per thread) on a GPU
    order_rows, budget = (64, 1 << 18) if interpreting() else (max(1, min(16, 1024 // KP)), 1 << 14)
    chunk = max(1, min(KP, budget // (order_rows * KP)))
    grid = lambda meta: (triton.cdiv(V, meta["BLOCK_R"]),)  # noqa: E731
    launcher(_neighbours_kernel)[grid](codes, codes_t, out, V, K, D=d, KP=KP, ORDER_ROWS=order_rows, CHUNK=chunk,
                                          RADIX=RADIX_BITS, PASSES=N_PASSES, enable_fp_fusion=False)
    return out
