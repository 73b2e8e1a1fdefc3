"""latent_neighbours: the tiled reference (O(V·K) memory) against cdist + topk (a V×V matrix)."""
from __future__ import annotations

import torch

from lantern import ops

from .common import Report, median_seconds


def cdist_topk(codebook: torch.Tensor, K: int) -> torch.Tensor:
    dist = torch.cdist(codebook, codebook).pow(2)
    dist.fill_diagonal_(float("inf"))
    return dist.topk(K, dim=1, largest=False).indices.to(torch.int32)


def run(report: Report, quick: bool = False) -> None:
    V, d, K = (4096, 8, 256) if quick else (16384, 8, 1000)
    codebook = torch.nn.functional.normalize(torch.randn(V, d), dim=-1)
    case = f"V={V} d={d} K={K}"
    report.add("neighbours", case, "cdist+topk", median_seconds(lambda: cdist_topk(codebook, K), repeats=3),
               peak_bytes=V * V * 4)
    report.add("neighbours", case, "reference", median_seconds(
        lambda: ops.latent_neighbours(codebook, K, normalize=True), repeats=3))
    report.ratio("neighbours", case, "cdist+topk", "reference")
