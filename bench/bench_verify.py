"""verify at LlamaGen shapes (V = 16384, T = 59 dynamic tree, k = 1000, δ = 0.1, CFG 3, top-k 2000)
for each backend that implements it, against the reference."""
from __future__ import annotations

import torch

import lantern
from lantern import ops

from .common import Report, median_seconds


def dynamic_tree_parents(T: int) -> torch.Tensor:
    """A fixed EAGLE-2-like shape: depth-first chains under a few root children."""
    parents = [-1]
    for i in range(1, T):
        parents.append(0 if i % 6 == 1 else i - 1)
    return torch.tensor(parents)


def inputs(B: int, T: int = 59, V: int = 16384, K: int = 1000):
    g = torch.Generator().manual_seed(B)
    logits = torch.randn(B, T, V, generator=g) * 2
    uncond = torch.randn(B, T, V, generator=g) * 2
    parents = dynamic_tree_parents(T).expand(B, T).contiguous()
    tokens = torch.randint(V, (B, T), generator=g)
    neighbours = torch.randint(V, (V, K), generator=g, dtype=torch.int64).to(torch.int32)
    return logits, uncond, tokens, parents, neighbours


def run(report: Report, quick: bool = False) -> None:
    for B in ((1,) if quick else (1, 8)):
        logits, uncond, tokens, parents, neighbours = inputs(B)
        case = f"B={B} T=59 V=16384 k=1000"

        def call():
            return ops.verify(logits, tokens, parents, neighbours, uncond_logits=uncond, cfg_scale=3.0,
                              top_k=2000, k=1000, delta=0.1, seed=1)

        with lantern.fused("reference"):
            report.add("verify", case, "reference", median_seconds(call, repeats=3))
        if lantern.fused_ops("cpu").get("verify"):
            with lantern.fused("cpu"):
                report.add("verify", case, "cpu", median_seconds(call))
            report.ratio("verify", case, "reference", "cpu")
