"""An independent, scalar pure-Python Philox4x32-10 (Random123 / Triton ``tl.philox`` convention) and
Triton's ``uint_to_uniform_float``: the test-side definition of SPEC §5, used to check
``lantern.ops.philox_uniform`` and to predict verify's uniforms in pinned cases."""
from __future__ import annotations

import math

import numpy as np

_M32 = 0xFFFFFFFF
_MUL0, _MUL1 = 0xD2511F53, 0xCD9E8D57
_WEYL0, _WEYL1 = 0x9E3779B9, 0xBB67AE85
_SCALE = np.float32(4.6566127342e-10)
ACCEPT_C0 = 0x80000000


def philox4x32_10(seed: int, counter: tuple) -> tuple:
    """All four output words for a 64-bit seed (key = low word, high word) and 4-word counter."""
    key0, key1 = seed & _M32, (seed >> 32) & _M32
    x0, x1, x2, x3 = (int(c) & _M32 for c in counter)
    for round_index in range(10):
        if round_index:
            key0, key1 = (key0 + _WEYL0) & _M32, (key1 + _WEYL1) & _M32
        prod0, prod1 = _MUL0 * x0, _MUL1 * x2
        x0, x1, x2, x3 = ((prod1 >> 32) ^ x1 ^ key0, prod1 & _M32, (prod0 >> 32) ^ x3 ^ key1, prod0 & _M32)
    return x0, x1, x2, x3


def word_to_uniform(word: int) -> np.float32:
    """Bitcast to int32, negative -> ~x, convert to float32, times the float32 constant."""
    signed = word - (1 << 32) if word >= (1 << 31) else word
    if signed < 0:
        signed = ~signed
    return np.float32(signed) * _SCALE


def uniform(seed: int, c0: int, c1: int, c2: int, c3: int) -> np.float32:
    return word_to_uniform(philox4x32_10(seed, (c0, c1, c2, c3))[0])


def exponential(u: np.float32) -> np.float32:
    """E = -log1p(-u) computed in float32."""
    return np.float32(-np.log1p(-np.float32(u), dtype=np.float32))


def gaussian(seed: int, purpose: int, image: int, position: int, step: int, channel: int) -> float:
    """One standard normal of the MAR / CSpD noise stream, written out (docs/mar.md): two uniforms (half 0
    and 1 in bit 23 of c0 = purpose << 24 | channel), Box-Muller in float64."""
    c0 = (purpose << 24) | channel
    u0 = float(uniform(seed, c0, image, position, step))
    u1 = float(uniform(seed, c0 | (1 << 23), image, position, step))
    return math.sqrt(-2.0 * math.log(1.0 - u0)) * math.cos(2.0 * math.pi * u1)


def accept_uniform(seed: int, node: int, row: int, offset: int) -> np.float32:
    return uniform(seed, ACCEPT_C0, node, row, offset)


def race_winner(weights, seed: int, node: int, row: int, offset: int):
    """argmin_i E_i / w_i over w_i > 0, lowest index on ties; also returns the sorted gap between the
    two smallest keys relative to the smallest (to skip near-ties whose order rounding may flip)."""
    keys = []
    for token, w in enumerate(weights):
        e = float(exponential(uniform(seed, token, node, row, offset)))
        keys.append(e / float(w) if w > 0 else np.inf)
    order = sorted(range(len(keys)), key=lambda i: (keys[i], i))
    best, second = keys[order[0]], keys[order[1]] if len(order) > 1 else np.inf
    gap = (second - best) / best if best > 0 else np.inf
    return order[0], gap


from op_cases import PHILOX_KNOWN_ANSWERS as KNOWN_ANSWERS  # noqa: E402,F401  (SPEC §5's table)
