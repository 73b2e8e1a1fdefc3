"""SPEC §6 in Triton: attention of B draft trees over their KV caches, one launch per layer.

Flash-attention structure (the Triton fused-attention tutorial's forward): a program owns BLOCK_M query
rows of one (batch row b, kv head) pair and streams that head's keys/values in BLOCK_N tiles with an
online softmax (running max m, normaliser l, accumulator acc, all float32, exp2 with log2(e) folded into
the scale). GQA: the H / Hkv query heads that share a kv head are packed into the rows of one program
(row = g * T + t), so each K/V tile is loaded once for the whole group.

Two loops per program:
- the prefix, positions [0, cache_len[b]): every query attends, only the row's length masks the last tile;
- the tree block, positions cache_len[b] + j for nodes j < T: query t attends to node j iff bit j of
  tree_mask[b, t] (packed int32 words, bit j % 32 of word j // 32) is set. Only here is the mask read.
Positions at or past cache_len[b] + T are never loaded (they may hold anything).

A row whose tiles so far were all masked keeps m = -inf; the update uses 0 in place of -inf so exp2 never
sees -inf - (-inf). Every query attends at least to itself, so l > 0 at the end.

Non-finite inputs are never hidden (as the reference): a query row with a non-finite score (q or a key
holds NaN / inf) or a non-finite value at a position it attends to is written as NaN in full. Non-finite
values are replaced by 0 before the P V product, so that they cannot reach rows that do not attend to them.
float32 (and float64, computed in float32 like the reference) inputs use IEEE float32 dots (no TF32), so
results match the reference to ~1e-6; float16 / bfloat16 inputs use the tensor-core path with P rounded to
the input dtype (as flash attention does).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._common import configs, interpreting, launcher, next_power_of_2

LOG2_E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, BF16_AS_F32: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    if BF16_AS_F32:  # Triton 3.8's interpreter multiplies bfloat16 bit patterns as integers in tl.dot;
        # bf16 x bf16 products are exact in float32, so this is the tensor-core result up to summation order
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _nonfinite(x):
    return (x != x) | (tl.abs(x) == float("inf"))


@triton.jit
def _poison(poisoned, scores, v_tile, attends):
    """poisoned [M] int32 |= a non-finite score or value at an attended position (attends [M, N]); returns
    (poisoned, v_tile with non-finite values replaced by 0)."""
    # tested in float32: Triton's interpreter compares bfloat16 as bit patterns (NaN != NaN would be False)
    bad_elements = _nonfinite(v_tile.to(tl.float32))  # [N, D]
    bad_value = tl.max(bad_elements.to(tl.int32), axis=1)  # [N]
    bad = (_nonfinite(scores) | (bad_value[None, :] != 0)) & attends  # [M, N]
    poisoned = tl.maximum(poisoned, tl.max(bad.to(tl.int32), axis=1))
    return poisoned, tl.where(bad_elements, 0.0, v_tile).to(v_tile.dtype)


@triton.jit
def _online_update(scores, v_tile, m_i, l_i, acc, IEEE: tl.constexpr, BF16_AS_F32: tl.constexpr):
    """One key tile: scores [M, N] (log2 domain, -inf = masked), v_tile [N, D] -> new (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # [M]
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing unmasked yet
    p = tl.math.exp2(scores - m_use[:, None])  # [M, N]
    alpha = tl.math.exp2(m_i - m_use)  # [M]
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _dot(p.to(v_tile.dtype), v_tile, IEEE, BF16_AS_F32)
    return m_new, l_i, acc


def _autotune_configs():
    # small row blocks give more programs when B * Hkv is small (32 at LlamaGen's verification shape)
    gpu = [triton.Config({"BLOCK_M": m, "BLOCK_N": n}, num_warps=4, num_stages=2)
           for m in (16, 32, 64) for n in (64, 128)]
    gpu += [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=3)]
    return configs(gpu, triton.Config({"BLOCK_M": 64, "BLOCK_N": 128}, num_warps=4))


@triton.autotune(configs=_autotune_configs(), key=["T", "GROUP", "Dh", "Hkv"])
@triton.jit
def _tree_attention_kernel(q, k, v, o, cache_len, tree_mask,
                           sq_b, sq_h, sq_t, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, sm_b, sm_t,
                           Hkv, T, GROUP, Dh, qk_scale,
                           BLOCK_D: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
                           BF16_AS_F32: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    b = tl.program_id(1) // Hkv
    kv_head = tl.program_id(1) % Hkv
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [M] packed (group member, node)
    row_ok = rows < GROUP * T
    t = rows % T  # query node
    head = kv_head * GROUP + rows // T  # query head
    d = tl.arange(0, BLOCK_D)
    d_ok = d < Dh

    q_ptrs = q + b.to(tl.int64) * sq_b + head[:, None].to(tl.int64) * sq_h + t[:, None] * sq_t + d[None, :]
    q_tile = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]
    if UPCAST:  # float64 inputs: float32 math, like the reference
        q_tile = q_tile.to(tl.float32)
    k_base = k + b.to(tl.int64) * sk_b + kv_head.to(tl.int64) * sk_h
    v_base = v + b.to(tl.int64) * sv_b + kv_head.to(tl.int64) * sv_h
    prefix = tl.load(cache_len + b).to(tl.int32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    poisoned = tl.zeros([BLOCK_M], dtype=tl.int32)
    n = tl.arange(0, BLOCK_N)

    for start in range(0, prefix, BLOCK_N):  # the committed prefix: no tree mask
        pos = start + n
        pos_ok = pos < prefix
        k_tile = tl.load(k_base + pos[None, :].to(tl.int64) * sk_l + d[:, None],
                         mask=pos_ok[None, :] & d_ok[:, None], other=0.0)  # [D, N]
        v_tile = tl.load(v_base + pos[:, None].to(tl.int64) * sv_l + d[None, :],
                         mask=pos_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        if UPCAST:
            k_tile, v_tile = k_tile.to(tl.float32), v_tile.to(tl.float32)
        scores = _dot(q_tile, k_tile, IEEE, BF16_AS_F32) * qk_scale
        poisoned, v_tile = _poison(poisoned, scores, v_tile, row_ok[:, None] & pos_ok[None, :])
        scores = tl.where(pos_ok[None, :], scores, float("-inf"))
        m_i, l_i, acc = _online_update(scores, v_tile, m_i, l_i, acc, IEEE, BF16_AS_F32)

    for start in range(0, T, BLOCK_N):  # the tree block: node j at position prefix + j
        node = start + n
        node_ok = node < T
        pos = prefix + node
        k_tile = tl.load(k_base + pos[None, :].to(tl.int64) * sk_l + d[:, None],
                         mask=node_ok[None, :] & d_ok[:, None], other=0.0)  # [D, N]
        v_tile = tl.load(v_base + pos[:, None].to(tl.int64) * sv_l + d[None, :],
                         mask=node_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        if UPCAST:
            k_tile, v_tile = k_tile.to(tl.float32), v_tile.to(tl.float32)
        words = tl.load(tree_mask + b.to(tl.int64) * sm_b + t[:, None] * sm_t + (node[None, :] >> 5),
                        mask=row_ok[:, None] & node_ok[None, :], other=0)  # [M, N] int32
        attends = ((words >> (node[None, :] & 31)) & 1) != 0  # arithmetic shift: bit 31 still reads right
        scores = _dot(q_tile, k_tile, IEEE, BF16_AS_F32) * qk_scale
        poisoned, v_tile = _poison(poisoned, scores, v_tile, attends)
        scores = tl.where(attends, scores, float("-inf"))
        m_i, l_i, acc = _online_update(scores, v_tile, m_i, l_i, acc, IEEE, BF16_AS_F32)

    l_i = tl.where(l_i == 0.0, 1.0, l_i)  # only rows past the group (never stored)
    out = tl.where(poisoned[:, None] != 0, float("nan"), acc / l_i[:, None])
    o_ptrs = o + ((b * Hkv * GROUP + head[:, None]).to(tl.int64) * T + t[:, None]) * Dh + d[None, :]
    tl.store(o_ptrs, out.to(o.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cache_len: torch.Tensor,
           tree_mask: torch.Tensor) -> torch.Tensor:
    """q [B, H, T, Dh], k_cache/v_cache [B, Hkv, Lmax, Dh] (any strides, last one 1), cache_len [B] int64,
    tree_mask [B, T, ceil(T/32)] int32 -> o [B, H, T, Dh] contiguous, q's dtype (checks already ran)."""
    B, H, T, Dh = q.shape
    Hkv = k_cache.shape[1]
    group = H // Hkv
    mask = tree_mask.contiguous()  # [B, T, W]
    o = torch.empty(B, H, T, Dh, dtype=q.dtype, device=q.device)
    qk_scale = LOG2_E / math.sqrt(Dh)
    grid = lambda meta: (triton.cdiv(group * T, meta["BLOCK_M"]), B * Hkv)  # noqa: E731
    launcher(_tree_attention_kernel)[grid](
        q, k_cache, v_cache, o, cache_len, mask,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), mask.stride(0), mask.stride(1),
        Hkv, T, group, Dh, qk_scale,
        BLOCK_D=max(16, next_power_of_2(Dh)), IEEE=q.dtype in (torch.float32, torch.float64),
        UPCAST=q.dtype == torch.float64, BF16_AS_F32=interpreting() and q.dtype == torch.bfloat16,
    )
    return o
