"""latent_neighbours: the CPU kernel (tiled distances, running per-row top-K, O(V·K) memory) against
cdist + topk (a V×V matrix) and the tiled reference; time, and peak memory measured in subprocesses
(bench/peak_memory.py). cdist+topk and the kernel are timed in alternation."""
from __future__ import annotations

import torch

import lantern
from lantern import ops

from .common import Report, interleaved_medians, median_seconds
from .peak_memory import measure_in_subprocess


def cdist_topk(codebook: torch.Tensor, K: int) -> torch.Tensor:
    dist = torch.cdist(codebook, codebook).pow(2)
    dist.fill_diagonal_(float("inf"))
    return dist.topk(K, dim=1, largest=False).indices.to(torch.int32)


def run(report: Report, quick: bool = False) -> None:
    V, d, K = (4096, 8, 256) if quick else (16384, 8, 1000)
    codebook = torch.nn.functional.normalize(torch.randn(V, d), dim=-1)
    case = f"V={V} d={d} K={K}"
    out_bytes = V * K * 4
    impls = {"cdist+topk": lambda: cdist_topk(codebook, K)}
    if lantern.fused_ops("cpu").get("latent_neighbours"):
        from lantern.ops import fused_cpu

        impls["cpu"] = lambda: fused_cpu.latent_neighbours(codebook, K, False)
    impls["reference"] = lambda: ops.latent_neighbours(codebook, K, normalize=False)
    # cdist+topk and the kernel in alternation (the machine's load changes during a run); the reference once
    times = interleaved_medians({n: f for n, f in impls.items() if n != "reference"}, repeats=3)
    times["reference"] = median_seconds(impls["reference"], repeats=1, warmup=0)
    for name in impls:
        peak = measure_in_subprocess(name, V, d, K)
        report.add("neighbours", case, name, times[name], peak_growth_bytes=peak,
                   peak_growth_minus_output_bytes=peak - out_bytes)
        print(f"{'':>18} {'':<34} {name:<22} peak memory growth {peak / 2**20:8.1f} MiB "
              f"(output {out_bytes / 2**20:.1f} MiB)", flush=True)
    if "cpu" in impls:
        report.ratio("neighbours", case, "cdist+topk", "cpu")
        report.ratio("neighbours", case, "reference", "cpu")
        peaks = {r["impl"]: r["peak_growth_bytes"] for r in report.rows if r.get("case") == case and "impl" in r}
        work = {k: max(v - out_bytes, 1) for k, v in peaks.items()}
        report.rows.append(dict(bench="neighbours", case=case, ratio="peak memory cdist+topk/cpu",
                                value=peaks["cdist+topk"] / max(peaks["cpu"], 1),
                                excluding_output=work["cdist+topk"] / work["cpu"]))
        print(f"{'neighbours':>18} {case:<34} peak memory cdist+topk / cpu = {peaks['cdist+topk'] / max(peaks['cpu'], 1):.1f}x "
              f"({work['cdist+topk'] / work['cpu']:.0f}x excluding the {out_bytes / 2**20:.0f} MiB output)", flush=True)
