"""Device helpers shared by lantern's Triton kernels: Philox4x32-10 (SPEC §5), float32 math that matches
the CPU kernels to an ulp, and reductions.

On a GPU the helpers are @triton.jit functions (inlined into the kernels) or libdevice functions. Under
Triton's interpreter (TRITON_INTERPRET=1) they are plain Python on the interpreter's numpy data: there every
call of a jit function re-patches triton.language (~2 ms a call), and the interpreter has no libdevice.
"""
from __future__ import annotations

import os

import numpy as np
import triton
import triton.language as tl
from triton.language.extra import libdevice

ROUND_A: tl.constexpr = tl.constexpr(0xD2511F53)
ROUND_B: tl.constexpr = tl.constexpr(0xCD9E8D57)
KEY_A: tl.constexpr = tl.constexpr(0x9E3779B9)
KEY_B: tl.constexpr = tl.constexpr(0xBB67AE85)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Device helpers are @triton.jit functions on a GPU (inlined into the kernel). Under the interpreter they are
# plain Python: there every call of a jit function re-patches triton.language (~2 ms a call), which made
# the helpers cost far more than their arithmetic.
_device = (lambda fn: fn) if _interpreting() else triton.jit


# ---- small helpers -------------------------------------------------------------------------------------

@_device
def _uniform(seed, c0, c1, c2, c3):
    """float32 uniform of Philox4x32-10 word 0 for uint32 counters (c0, c1, c2, c3) and the 64-bit seed's
    (low, high) words as key (SPEC §5): the rounds and the float conversion of triton.language.random's
    philox_impl / uint_to_uniform_float, written out so the interpreter runs them without nested jit calls."""
    seed = seed.to(tl.uint64, bitcast=True)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    for _ in tl.static_range(10):
        a0 = c0
        a2 = c2
        c0 = tl.math.umulhi(ROUND_B, a2) ^ c1 ^ k0
        c2 = tl.math.umulhi(ROUND_A, a0) ^ c3 ^ k1
        c1 = tl.mul(ROUND_B, a2, sanitize_overflow=False)
        c3 = tl.mul(ROUND_A, a0, sanitize_overflow=False)
        k0 = tl.add(k0, KEY_A, sanitize_overflow=False)
        k1 = tl.add(k1, KEY_B, sanitize_overflow=False)
    x = c0.to(tl.int32, bitcast=True)
    x = tl.where(x < 0, ~x, x)
    return x * 4.6566127342e-10


if _interpreting():
    from triton.runtime.interpreter import TensorHandle

    def _numpy_float32(fn):
        """A float32 elementwise function for the interpreter (it has no libdevice): numpy's, in float32."""
        def apply(x):
            data = fn(x.handle.data.astype(np.float32))
            return tl.tensor(TensorHandle(data.astype(np.float32), tl.float32), x.type)
        return apply

    _log, _log1p, _expm1, _cos, _sqrt = (_numpy_float32(f) for f in (np.log, np.log1p, np.expm1, np.cos, np.sqrt))

    def _div(a, b):  # IEEE float32 division (numpy's)
        return a / b

    def _exponential_key(u):
        """E = -log1p(-u) in float32 (the interpreter has no libdevice: numpy's float32 log1p)."""
        return -_log1p(-u)
else:
    # libdevice's correctly rounded or 1-ulp functions (tl.log / tl.cos lower to approximate instructions), and
    # IEEE division (Triton's float32 "/" is the approximate div.full)
    _log, _log1p, _expm1, _cos, _sqrt = libdevice.log, libdevice.log1p, libdevice.expm1, libdevice.cos, libdevice.sqrt
    _div = libdevice.div_rn

    @triton.jit
    def _exponential_key(u):
        """E = -log1p(-u) in float32."""
        return -libdevice.log1p(-u)


if _interpreting():
    from triton.runtime.interpreter import ReduceScanOpInterface

    _TO_TENSOR = ReduceScanOpInterface(None, None).to_tensor

    # Reductions straight on the interpreter's numpy data (tl.sum and friends are jit functions: see _device).
    def _sum(x, axis=None):
        return _TO_TENSOR(np.sum(x.handle.data, axis=axis), x.dtype)

    def _max(x, axis=None):
        return _TO_TENSOR(np.max(x.handle.data, axis=axis), x.dtype)

    def _min(x, axis=None):
        return _TO_TENSOR(np.min(x.handle.data, axis=axis), x.dtype)

    def _argmin(x, axis):  # the first index on ties, as tl.argmin's tie_break_left
        return _TO_TENSOR(np.argmin(x.handle.data, axis=axis), tl.int32)

    def _argmax(x, axis):
        return _TO_TENSOR(np.argmax(x.handle.data, axis=axis), tl.int32)

    def _cumsum(x, axis):
        return _TO_TENSOR(np.cumsum(x.handle.data, axis=axis), x.dtype)

    def _exp(x):  # looked up at call time: the interpreter patches tl.exp while a kernel runs
        return tl.exp(x)
else:
    _sum, _max, _min, _argmin, _argmax, _cumsum = tl.sum, tl.max, tl.min, tl.argmin, tl.argmax, tl.cumsum
    _exp = libdevice.exp  # tl.exp lowers to ex2.approx; libdevice's expf is within an ulp of torch's
