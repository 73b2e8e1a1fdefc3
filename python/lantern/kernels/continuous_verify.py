"""continuous_verify (docs/cspd.md) in Triton: one launch for a block of B x N continuous tokens.

A program owns BLOCK_M tokens as a [BLOCK_M, BLOCK_C] tile (channels along the second axis). It computes every
token's log acceptance ratio, tests the drafts, then runs the residual sampler for the rejected tokens of the
tile together: each round draws one proposal per pending token, and the loop ends when no token of the tile is
pending or after ``max_tries`` rounds (the tokens still pending keep their last proposal and report
max_tries + 1). The definition, and the Philox counters (c0 = purpose << 24 | half << 23 | channel, c1 = row
key, c2 = position key, c3 = offset + try), are python/lantern/ops/reference/continuous_verify.py; float32,
with libdevice's log / log1p / expm1 / cos / sqrt and IEEE division, so that the result equals the CPU
kernel's up to the rounding of those functions and of the channel sum's order.
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch
import triton
import triton.language as tl

from lantern.ops.reference.noise import HALF_BIT, PURPOSE_ACCEPT, PURPOSE_RESIDUAL

from ._common import interpreting, launcher, next_power_of_2
from ._jit import _cos, _device, _div, _expm1, _log, _log1p, _max, _sqrt, _sum, _uniform

ACCEPT_C0: tl.constexpr = tl.constexpr(PURPOSE_ACCEPT << 24)
RESIDUAL_C0: tl.constexpr = tl.constexpr(PURPOSE_RESIDUAL << 24)
RESIDUAL_HALF1_C0: tl.constexpr = tl.constexpr((PURPOSE_RESIDUAL << 24) | HALF_BIT)
TWO_PI: tl.constexpr = tl.constexpr(6.283185307179586)
TILE_ELEMENTS = 1024  # BLOCK_M * BLOCK_C on a GPU: small tiles spread a block over SMs, and a tile's residual
# rounds last as long as its slowest token


@_device
def _log_gaussian(x, mu, sigma, bw, channel_ok):
    """[M, C] tiles -> [M]: -sum_c (log sigma + 1/2 ((x - mu) / (bw sigma))^2) over the real channels."""
    z = _div(x - mu, bw * sigma)
    term = tl.where(channel_ok, _log(sigma) + 0.5 * z * z, 0.0)
    return -_sum(term, axis=1)


@triton.jit
def _continuous_verify_kernel(draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions, seed_ptr,
                              offset_ptr, tokens, accepted, tries, M, N, C, bandwidth, max_tries,
                              PAPER: tl.constexpr, CODE_RATIO: tl.constexpr, BLOCK_M: tl.constexpr,
                              BLOCK_C: tl.constexpr):
    m = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] token indices b * N + n
    ch = tl.arange(0, BLOCK_C)  # [BC]
    m_ok = m < M
    channel_ok = (ch < C)[None, :]
    ok = m_ok[:, None] & channel_ok  # [BM, BC]
    e = m[:, None] * C + ch[None, :]
    x = tl.load(draft + e, mask=ok, other=0.0)
    mp = tl.load(mu_p + e, mask=ok, other=0.0)
    sp = tl.load(sigma_p + e, mask=ok, other=1.0)
    mq = tl.load(mu_q + e, mask=ok, other=0.0)
    sq = tl.load(sigma_q + e, mask=ok, other=1.0)
    row_key = tl.load(rows + m // N, mask=m_ok, other=0).to(tl.uint32)  # [BM]
    pos_key = tl.load(positions + m, mask=m_ok, other=0).to(tl.uint32)
    seed = tl.load(seed_ptr)
    offset = (tl.load(offset_ptr) & 0xFFFFFFFF).to(tl.uint32)
    zero_key = tl.zeros([BLOCK_M], tl.uint32)
    offset_key = zero_key + offset

    if PAPER:
        log_r = _log_gaussian(x, mp, sp, bandwidth, channel_ok) - _log_gaussian(x, mq, sq, bandwidth, channel_ok)
        lp = tl.load(logsig_p + m, mask=m_ok, other=0.0)
        lq = tl.load(logsig_q + m, mask=m_ok, other=0.0)
        if CODE_RATIO:
            log_r = (lp - lq) + log_r
        else:
            log_r = (lq - lp) + log_r
    else:
        log_r = _log_gaussian(x, mp, sp, 1.0, channel_ok) - _log_gaussian(x, mq, sq, 1.0, channel_ok)
    u = _uniform(seed, zero_key + ACCEPT_C0, row_key, pos_key, offset_key)
    took = _log(u) < log_r  # [BM]; NaN (q(x) = p(x) = 0) rejects
    out = x
    n_tries = tl.zeros([BLOCK_M], tl.int32)
    pending = m_ok & ~took

    tile_zero = tl.zeros([BLOCK_M, BLOCK_C], tl.uint32)
    channel_key = ch.to(tl.uint32)[None, :]  # [1, BC]; channel < 2^23 never reaches the purpose / half bits
    c0_half0 = tile_zero + channel_key + RESIDUAL_C0
    c0_half1 = tile_zero + channel_key + RESIDUAL_HALF1_C0
    row_tile = tile_zero + row_key[:, None]
    pos_tile = tile_zero + pos_key[:, None]
    k = tl.program_id(0) * 0  # a scalar int32 tensor (the interpreter has no 0-d tl.full)
    active = _max(pending.to(tl.int32), axis=0)
    while active > 0:
        k = k + 1
        step = offset + k.to(tl.uint32)  # mod 2^32
        u0 = _uniform(seed, c0_half0, row_tile, pos_tile, tile_zero + step)
        u1 = _uniform(seed, c0_half1, row_tile, pos_tile, tile_zero + step)
        y = mp + sp * (_sqrt(-2.0 * _log1p(-u0)) * _cos(u1 * TWO_PI))  # [BM, BC] proposals
        d = _log_gaussian(y, mq, sq, 1.0, channel_ok) - _log_gaussian(y, mp, sp, 1.0, channel_ok)  # log q/p
        u_k = _uniform(seed, zero_key + ACCEPT_C0, row_key, pos_key, zero_key + step)
        keep = (d < 0) & (u_k < -_expm1(tl.minimum(d, 0.0)))
        out = tl.where(pending[:, None], y, out)
        n_tries = tl.where(pending, k, n_tries)
        pending = pending & ~keep
        active = _max(pending.to(tl.int32), axis=0) * (k < max_tries).to(tl.int32)
    n_tries = tl.where(pending, max_tries + 1, n_tries)
    tl.store(tokens + e, out, mask=ok)
    tl.store(accepted + m, took.to(tl.int8), mask=m_ok)
    tl.store(tries + m, n_tries, mask=m_ok)


def launch(draft: torch.Tensor, mu_p: torch.Tensor, sigma_p: torch.Tensor, mu_q: torch.Tensor,
           sigma_q: torch.Tensor, logsig_p: torch.Tensor, logsig_q: torch.Tensor, rows: torch.Tensor,
           positions: torch.Tensor, rule: str, bandwidth: float, sigma_ratio: str, max_tries: int,
           seed: torch.Tensor, offset: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The op's kernel, with the schema's arguments (checks already ran). The annotations spell the op's
    schema (``SCHEMA`` of ``lantern.ops.continuous_verify_op``): torch versions whose triton_op ignores
    ``schema=`` infer it from them."""
    B, N, C = draft.shape
    dev = draft.device
    tokens = torch.empty(B, N, C, dtype=torch.float32, device=dev)
    accepted = torch.empty(B, N, dtype=torch.bool, device=dev)
    tries = torch.empty(B, N, dtype=torch.int32, device=dev)
    M = B * N
    if M == 0:
        return tokens, accepted, tries
    block_c = next_power_of_2(C)
    # the interpreter runs each program in Python, so few large programs; a GPU wants many small ones
    block_m = next_power_of_2(M) if interpreting() else max(1, min(64, TILE_ELEMENTS // block_c))
    args = [t.contiguous() for t in (draft, mu_p, sigma_p, mu_q, sigma_q, logsig_p, logsig_q, rows, positions)]
    grid = (triton.cdiv(M, block_m),)
    kernel = launcher(_continuous_verify_kernel)[grid]
    flags = dict(PAPER=rule == "paper", CODE_RATIO=sigma_ratio == "code", BLOCK_M=block_m, BLOCK_C=block_c)
    call = (*args, seed, offset, tokens, accepted.view(torch.int8), tries, M, N, C,
            float(bandwidth) if rule == "paper" else 1.0, int(max_tries))
    if interpreting():
        with np.errstate(over="ignore", invalid="ignore"):  # uint32 counters wrap; masked lanes
            kernel(*call, **flags)
    else:  # no FMA contraction: the densities round as the CPU kernel's separate operations
        kernel(*call, **flags, enable_fp_fusion=False)
    return tokens, accepted, tries
