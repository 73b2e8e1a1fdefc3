"""Image grids for the CLI (Pillow)."""
from __future__ import annotations

import torch
from PIL import Image


def save_grid(images: torch.Tensor, rows: int, path: str, scale: int = 1) -> None:
    """images uint8 [N, H, W, 3] (N = rows * cols, row-major) -> one PNG, upscaled by `scale`."""
    N, H, W, _ = images.shape
    cols = (N + rows - 1) // rows
    grid = torch.zeros(rows * H, cols * W, 3, dtype=torch.uint8)
    for i in range(N):
        r, c = divmod(i, cols)
        grid[r * H : (r + 1) * H, c * W : (c + 1) * W] = images[i]
    picture = Image.fromarray(grid.numpy())
    if scale != 1:
        picture = picture.resize((cols * W * scale, rows * H * scale), Image.NEAREST)
    picture.save(path)
