"""Procedural class-conditional 32x32 RGB shapes: the tiny default model's training set, made in code.

Ten visually distinct classes (``CLASS_NAMES``), each drawn from a signed-distance field with
anti-aliased edges, with a random bright foreground colour (a jittered palette colour) on a random dark
background, random size / position / thickness / period / phase, and mild Gaussian pixel noise, so that
every class has real variety. Deterministic: the same (n, seed) gives the same images and labels, on any
machine (numpy's PCG64 stream; float32 arithmetic).

Images are float32 [N, 3, 32, 32] in [-1, 1] (the VQ tokenizer's range); labels int64 [N] in 0..9,
balanced (each run of 10 consecutive images, from the start, holds every class once).
"""
from __future__ import annotations

from typing import Tuple

import numpy as np
import torch

CLASS_NAMES = (
    "circle", "square", "triangle", "plus", "ring",
    "horizontal stripes", "vertical stripes", "checkerboard", "x cross", "two dots",
)
NUM_CLASSES = len(CLASS_NAMES)
IMAGE_SIZE = 32
DEFAULT_SEED = 0  # the shipped model's training set

# Bright foreground colours (RGB in [0, 1]); each image jitters one of them.
PALETTE = np.array([
    [0.95, 0.25, 0.20],  # red
    [0.98, 0.60, 0.15],  # orange
    [0.95, 0.90, 0.25],  # yellow
    [0.35, 0.85, 0.30],  # green
    [0.25, 0.85, 0.85],  # cyan
    [0.30, 0.50, 0.98],  # blue
    [0.75, 0.40, 0.95],  # violet
    [0.95, 0.95, 0.95],  # white
], dtype=np.float32)

NOISE_STD = 0.02  # pixel noise, in [0, 1] units


def _grid() -> Tuple[np.ndarray, np.ndarray]:
    """Pixel-centre coordinates in [-1, 1]: u (x, left to right), v (y, top to bottom), each [32, 32]."""
    c = (np.arange(IMAGE_SIZE, dtype=np.float32) + 0.5) / IMAGE_SIZE * 2.0 - 1.0
    v, u = np.meshgrid(c, c, indexing="ij")
    return u, v


_PIXEL = 2.0 / IMAGE_SIZE  # one pixel in normalised units


def _coverage(sdf: np.ndarray) -> np.ndarray:
    """Signed distance (normalised units, < 0 inside) -> anti-aliased coverage in [0, 1]."""
    return np.clip(0.5 - sdf / _PIXEL, 0.0, 1.0)


def _box(du, dv, hu, hv):
    """SDF of an axis-aligned box of half sizes (hu, hv) centred at the origin of (du, dv)."""
    qu, qv = np.abs(du) - hu, np.abs(dv) - hv
    outside = np.sqrt(np.maximum(qu, 0) ** 2 + np.maximum(qv, 0) ** 2)
    return outside + np.minimum(np.maximum(qu, qv), 0)


def _stripes(coord, period, phase):
    """SDF of stripes of half-period width along coord: < 0 on the 'on' half of each period."""
    x = np.mod(coord - phase, period)
    return np.abs(x - period / 2) - period / 4


def _shape_alpha(label: int, rng: np.random.Generator, u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Foreground coverage [32, 32] of one image of class ``label`` (consumes rng draws)."""
    cu, cv = rng.uniform(-0.15, 0.15, size=2).astype(np.float32)  # centre jitter (+-2.4 px)
    du, dv = u - cu, v - cv
    if label == 0:  # circle (filled disk)
        r = rng.uniform(0.35, 0.6)
        sdf = np.sqrt(du ** 2 + dv ** 2) - r
    elif label == 1:  # square (filled, axis-aligned)
        h = rng.uniform(0.3, 0.52)
        sdf = _box(du, dv, h, h)
    elif label == 2:  # triangle (filled, pointing up)
        s = rng.uniform(0.45, 0.7)  # circumradius-ish
        # three half-planes of an equilateral triangle with apex up (v grows downwards)
        normals = np.array([[0.0, 1.0], [np.sqrt(3) / 2, -0.5], [-np.sqrt(3) / 2, -0.5]], dtype=np.float32)
        dists = [nu * du + nv * dv - s / 2 for nu, nv in normals]
        sdf = np.maximum(np.maximum(dists[0], dists[1]), dists[2])
    elif label == 3:  # plus
        arm = rng.uniform(0.45, 0.7)
        t = rng.uniform(0.1, 0.17)
        sdf = np.minimum(_box(du, dv, arm, t), _box(du, dv, t, arm))
    elif label == 4:  # ring
        r = rng.uniform(0.38, 0.58)
        t = rng.uniform(0.07, 0.12)
        sdf = np.abs(np.sqrt(du ** 2 + dv ** 2) - r) - t
    elif label in (5, 6):  # horizontal / vertical stripes over the whole image
        period = rng.uniform(0.4, 0.65)
        phase = rng.uniform(0, period)
        sdf = _stripes(v if label == 5 else u, period, phase)
    elif label == 7:  # checkerboard over the whole image
        period = rng.uniform(0.5, 0.8)
        pu, pv = rng.uniform(0, period, size=2)
        a, b = _stripes(u, period, pu), _stripes(v, period, pv)
        # inside iff exactly one of the two stripe sets is 'on': sdf = a*b sign, magnitude min(|a|,|b|)
        sdf = np.where((a < 0) ^ (b < 0), -1.0, 1.0) * np.minimum(np.abs(a), np.abs(b))
    elif label == 8:  # x cross: two diagonal bars inside a box
        arm = rng.uniform(0.4, 0.6)
        t = rng.uniform(0.08, 0.13)
        d1 = np.abs(du - dv) / np.sqrt(2) - t
        d2 = np.abs(du + dv) / np.sqrt(2) - t
        sdf = np.maximum(np.minimum(d1, d2), np.maximum(np.abs(du), np.abs(dv)) - arm)
    elif label == 9:  # two dots
        r = rng.uniform(0.17, 0.25)
        angle = rng.uniform(-0.5, 0.5)  # side by side, tilted up to ~30 degrees
        sep = rng.uniform(0.32, 0.45)
        ou, ov = sep * np.cos(angle), sep * np.sin(angle)
        sdf = np.minimum(np.sqrt((du - ou) ** 2 + (dv - ov) ** 2), np.sqrt((du + ou) ** 2 + (dv + ov) ** 2)) - r
    else:
        raise ValueError(f"label must be in 0..{NUM_CLASSES - 1}, got {label}")
    return _coverage(sdf.astype(np.float32))


def render(label: int, rng: np.random.Generator) -> np.ndarray:
    """One image of class ``label`` -> float32 [3, 32, 32] in [0, 1] (consumes rng draws)."""
    u, v = _grid()
    fg = np.clip(PALETTE[rng.integers(len(PALETTE))] + rng.uniform(-0.06, 0.06, size=3), 0, 1).astype(np.float32)
    bg = rng.uniform(0.0, 0.18, size=3).astype(np.float32)
    alpha = _shape_alpha(label, rng, u, v)[None]  # [1, 32, 32]
    img = alpha * fg[:, None, None] + (1 - alpha) * bg[:, None, None]
    img = img + rng.normal(0.0, NOISE_STD, size=img.shape).astype(np.float32)
    return np.clip(img, 0.0, 1.0).astype(np.float32)


def make_dataset(n: int, seed: int = DEFAULT_SEED) -> Tuple[torch.Tensor, torch.Tensor]:
    """n images -> (images float32 [n, 3, 32, 32] in [-1, 1], labels int64 [n]). Balanced (counts differ by
    at most one) and deterministic in (n, seed); image i depends only on (seed, i), so a longer set extends
    a shorter one with the same seed."""
    blocks = -(-n // NUM_CLASSES)  # every block of 10 consecutive images holds each class once
    labels = np.concatenate([np.random.default_rng([seed, 1, b]).permutation(NUM_CLASSES) for b in range(blocks)])[:n]
    out = np.empty((n, 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    for i in range(n):
        out[i] = render(int(labels[i]), np.random.default_rng([seed, 2, i]))
    return torch.from_numpy(out * 2.0 - 1.0), torch.from_numpy(labels.astype(np.int64))


def make_class_batch(per_class: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """per_class images of every class (class-major order) -> (images [10 * per_class, 3, 32, 32] in [-1, 1],
    labels). Deterministic in (per_class, seed); independent of ``make_dataset``'s stream."""
    labels = np.repeat(np.arange(NUM_CLASSES), per_class)
    out = np.empty((len(labels), 3, IMAGE_SIZE, IMAGE_SIZE), dtype=np.float32)
    for i, c in enumerate(labels):
        out[i] = render(int(c), np.random.default_rng([seed, 3, i]))
    return torch.from_numpy(out * 2.0 - 1.0), torch.from_numpy(labels.astype(np.int64))
