"""philox_uniform (SPEC §5): float32 uniforms in [0, 1) from Philox4x32-10 word 0, the randomness every op
draws from."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _backend
from . import checks as c
from . import library
from .library import IntLike
from .reference.philox import philox_uniform as reference

# float32 uniforms, shape = broadcast of the counters. The seed is a one-element int64 tensor on the counters'
# device holding the 64-bit seed's bits (values >= 2^63 as negative int64): a device tensor, so a captured CUDA
# graph can replay with a new seed. Counters are integer tensors taken modulo 2^32; the offset (c3) may likewise
# be a device tensor.
SCHEMA = "(Tensor seed, Tensor c0, Tensor c1, Tensor c2, Tensor c3) -> Tensor"


def fake(seed, c0, c1, c2, c3):
    shape = torch.broadcast_shapes(c0.shape, c1.shape, c2.shape, c3.shape)
    return c0.new_empty(shape, dtype=torch.float32)


def to_schema(backend: str, seed: IntLike, c0: IntLike, c1: IntLike, c2: IntLike, c3: IntLike) -> tuple:
    """(seed, c0, c1, c2, c3) as tensors on the counters' device (CPU when every counter is an int)."""
    tensors = [x for x in (c0, c1, c2, c3) if isinstance(x, torch.Tensor)]
    device = tensors[0].device if tensors else torch.device("cpu")
    counters = [x if isinstance(x, torch.Tensor) else torch.tensor(int(x), dtype=torch.int64, device=device)
                for x in (c0, c1, c2, c3)]
    return (library.seed_tensor(seed, device), *counters)


def _reference_kernel(seed, c0, c1, c2, c3):
    return reference(library.unsigned(seed), c0, c1, c2, c3)


OP = library.Op("philox_uniform", SCHEMA, fake, to_schema=to_schema, reference_kernel=_reference_kernel, backends={
    "reference": reference,                      # ops/reference/philox.py
    "cpu": library.EXTENSION,                    # csrc/cpu/philox_uniform.cpp
    "cuda": library.EXTENSION,                   # csrc/cuda/philox_uniform.cu
})


def philox_uniform(seed, c0, c1, c2, c3, *, backend: Optional[str] = None) -> torch.Tensor:
    """§5: float32 uniforms in [0, 1) from Philox4x32-10 word 0; counters broadcast. ``backend``: which
    backend runs it (default: the one ``lantern.enable_fused`` / ``lantern.fused`` chose)."""
    seed, c0, c1, c2, c3 = map(c.plain, (seed, c0, c1, c2, c3))
    device = check(seed, c0, c1, c2, c3)
    return _backend.dispatch("philox_uniform", device, backend)(seed, c0, c1, c2, c3)


def check(seed, c0, c1, c2, c3) -> torch.device:
    """Returns the device of the counter tensors (CPU if all counters are ints)."""
    c.check_counter("seed", seed, 64)
    device = None
    for name, v in zip(("c0", "c1", "c2", "c3"), (c0, c1, c2, c3)):
        if isinstance(v, torch.Tensor):
            if v.is_floating_point() or v.dtype == torch.bool:
                raise TypeError(f"{name} must be an integer tensor, got {v.dtype}")
            if device is not None and v.device != device:
                raise ValueError(f"{name} is on {v.device} but another counter is on {device}")
            device = v.device
            c.in_range(name, v, 0, 2**32)
        elif isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**32:
            raise ValueError(f"{name} must be an int in [0, 2^32) or an integer tensor, got {v!r}")
    shapes = [tuple(v.shape) for v in (c0, c1, c2, c3) if isinstance(v, torch.Tensor)]
    if not _broadcastable(shapes):
        raise ValueError(f"c0, c1, c2, c3 must broadcast together, got shapes {shapes}")
    return device or torch.device("cpu")


def _broadcastable(shapes) -> bool:
    """Whether the shapes broadcast together (torch.broadcast_shapes' rule, without its symbolic-shape
    machinery, which costs ~0.1 ms a call: the decoding loop draws several times a step)."""
    for i in range(1, max((len(s) for s in shapes), default=0) + 1):
        if len({s[-i] for s in shapes if len(s) >= i} - {1}) > 1:
            return False
    return True
