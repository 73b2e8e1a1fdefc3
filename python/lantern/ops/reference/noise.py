"""Counter-based Gaussian noise: the Philox key layout shared by MAR's sampler and continuous speculative
decoding (docs/mar.md, docs/cspd.md). Every number is one Philox4x32-10 uniform (SPEC §5) with

    key = seed (64 bits)
    c0  = purpose << 24 | box_muller_half << 23 | channel
    c1  = image id (the image's index in the whole run; continuous_verify: its ``rows`` key)
    c2  = token position (raster index; continuous_verify: its ``positions`` key)
    c3  = respaced diffusion step t (x_T, the order: 0; continuous_verify: offset + try)

and a Gaussian is Box-Muller on the two halves: sqrt(-2 log(1 - u0)) cos(2 pi u1), in float32.
"""
from __future__ import annotations

import math
from typing import Union

import torch

# purposes (c0's top byte)
PURPOSE_ORDER = 1  # the order of an image's positions
PURPOSE_X_T = 2  # the diffusion chain's start
PURPOSE_EPS = 3  # eps_t of respaced steps t = T-1 .. 1
PURPOSE_EPS_0 = 4  # eps_0 (only with last_step_noise: CSpD's exact rule)
PURPOSE_RESIDUAL = 5  # continuous_verify: the residual sampler's proposal, one Gaussian per try
PURPOSE_ACCEPT = 6  # continuous_verify: acceptance uniforms (try 0: the draft's test; try k: proposal k's)
HALF_BIT = 1 << 23
MAX_CHANNELS = 1 << 23
TWO_PI = 2.0 * math.pi

IntOrTensor = Union[int, torch.Tensor]


def noise_counters(purpose: int, half: int, channel: IntOrTensor, image: IntOrTensor, position: IntOrTensor,
                   step: IntOrTensor):
    """The Philox counter (c0, c1, c2, c3) of one uniform: see the module docstring. Broadcasting int64
    tensors (or ints); every field must fit its bits (channel < 2^23, the others < 2^32)."""
    c0 = (purpose << 24) | (half * HALF_BIT) | channel
    return c0, image, position, step


def box_muller(u0: torch.Tensor, u1: torch.Tensor) -> torch.Tensor:
    """A standard normal from two float32 uniforms in [0, 1): sqrt(-2 log1p(-u0)) cos(2 pi u1), in float32."""
    return torch.sqrt(-2.0 * torch.log1p(-u0)) * torch.cos(TWO_PI * u1)
