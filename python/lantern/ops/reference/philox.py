"""§5: Philox4x32-10 exactly as Triton's ``tl.philox`` / ``tl.rand``, vectorised in int64 tensors.

Every 32-bit word is held in an int64 tensor with values in [0, 2^32); products are split into 16-bit
halves so nothing overflows int64.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

MASK32 = 0xFFFFFFFF
ROUND_A, ROUND_B = 0xD2511F53, 0xCD9E8D57
KEY_A, KEY_B = 0x9E3779B9, 0xBB67AE85
UNIFORM_SCALE = 4.6566127342e-10  # Triton's uint_to_uniform_float constant (float32)
ACCEPT_COUNTER = 0x80000000  # c0 of an acceptance uniform; c0 < V for the exponential race

IntLike = Union[int, torch.Tensor]


def _mul_hi_lo(a: int, b: torch.Tensor):
    """(high, low) 32-bit words of the 64-bit product of the constant ``a`` and words ``b``."""
    a_hi, a_lo = a >> 16, a & 0xFFFF
    x = a_hi * b  # < 2^48
    y = a_lo * b  # < 2^48
    # in place on the new products: the words are large (every draw of a batch), and each new tensor costs
    # more than the arithmetic
    hi = (y >> 16).add_(x).bitwise_right_shift_(16)  # (x + (y >> 16)) >> 16
    lo = x.bitwise_left_shift_(16).add_(y).bitwise_and_(MASK32)  # ((x << 16) + y) & MASK32
    return hi, lo


def philox_word0(seed: IntLike, c0: IntLike, c1: IntLike, c2: IntLike, c3: IntLike) -> torch.Tensor:
    """Word 0 of Philox4x32-10 with key (seed low, seed high), as int64 in [0, 2^32)."""
    device = next((c.device for c in (c0, c1, c2, c3) if isinstance(c, torch.Tensor)), None)
    c0, c1, c2, c3 = (_as_words(c, device) for c in (c0, c1, c2, c3))
    c0, c1, c2, c3 = torch.broadcast_tensors(c0, c1, c2, c3)
    if isinstance(seed, torch.Tensor):
        seed = int(seed.item())
    seed &= (1 << 64) - 1
    k0, k1 = seed & MASK32, seed >> 32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(ROUND_A, c0)
        c0, c1, c2, c3 = hi_b.bitwise_xor_(c1).bitwise_xor_(k0), lo_b, hi_a.bitwise_xor_(c3).bitwise_xor_(k1), lo_a
        k0, k1 = (k0 + KEY_A) & MASK32, (k1 + KEY_B) & MASK32
    return c0


def _as_words(c: IntLike, device: Optional[torch.device]) -> torch.Tensor:
    """A counter as int64 words on ``device`` (the counters' common device: an int becomes a tensor there)."""
    t = c if isinstance(c, torch.Tensor) else torch.tensor(int(c), device=device)
    return t.to(torch.int64) & MASK32


def uint_to_uniform(word: torch.Tensor) -> torch.Tensor:
    """Triton's uint_to_uniform_float: bitcast to int32, x < 0 -> ~x, to float32, times the scale."""
    signed = torch.where(word >= 2**31, word - 2**32, word)
    signed = torch.where(signed < 0, -signed - 1, signed)
    return signed.to(torch.float32) * torch.tensor(UNIFORM_SCALE, dtype=torch.float32)


def exponential_key(u: torch.Tensor) -> torch.Tensor:
    """E = -log1p(-u) in float32: an Exp(1) variate for the exponential race."""
    return -torch.log1p(-u.to(torch.float32))


def philox_uniform(seed: IntLike, c0: IntLike, c1: IntLike, c2: IntLike, c3: IntLike) -> torch.Tensor:
    """float32 uniforms in [0, 1) for counters (c0, c1, c2, c3), broadcast together."""
    return uint_to_uniform(philox_word0(seed, c0, c1, c2, c3))
