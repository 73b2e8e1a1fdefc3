"""Jacobi self-drafting (method "sjd", no drafter) on the shipped tiny model against AR and against
speculative decoding with the trained drafter: τ, the speed-up over AR and the quality (class accuracy and
Fréchet distance of the timed images, ``lantern.tiny.evaluate``) of fixed windows W = 2, 4, 8, 16 (every
step the whole window), exact (δ = 0) and relaxed like LANTERN (k = 1000, δ = 0.1), and coupled draws
(SCD), the planner's choice of window per step (``tree="auto"``, windows up to 16; its one-off
calibration falls in the warm-up call), next to a sampled chain of 3 drafter drafts, exact and LANTERN.
One timed sample generates at least ``--images`` images (batch 1: one call per image, seeds 0..); the
contenders are timed in alternation, medians of ``--repeats``.

    python -m bench.bench_sjd [--batches 1 8] [--repeats 2] [--images 16] [--clock wall|cpu] [--json PATH]

``--clock cpu``: the process's CPU time (see bench_plans). The quality figures come from the last timed
sample's images, so they are as noisy as ``--images`` makes them (the tiny model's AR floor: docs/tiny_model.md).
"""
from __future__ import annotations

import torch

import lantern

from .bench_plans import CLOCKS, batches_main
from .bench_speedup import setup, tokens_per_row_step
from .common import Report, interleaved_medians

SJD = {f"sjd{w}": dict(method="sjd", tree="chain", window=w) for w in (2, 4, 8, 16)}
SJD.update({"sjd8 coupled": dict(method="sjd", tree="chain", window=8, coupling=True),
            "sjd4 lantern": dict(method="sjd", tree="chain", window=4, k=1000, delta=0.1),
            "sjd8 lantern": dict(method="sjd", tree="chain", window=8, k=1000, delta=0.1),
            "sjd16 lantern": dict(method="sjd", tree="chain", window=16, k=1000, delta=0.1),
            "sjd auto": dict(method="sjd", tree="auto", window=16)})
DRAFTER = {"spec chain3": dict(method="spec", tree="chain", depth=3, draft="sampled"),
           "lantern chain3": dict(method="lantern", tree="chain", depth=3, draft="sampled", k=1000, delta=0.1)}


def contenders(drafter, table) -> dict:
    """name -> lantern.generate options (the drafter's and the relaxed ones with their inputs)."""
    out = {"ar": dict(method="ar")}
    for name, options in SJD.items():
        out[name] = dict(options, neighbours=table if "delta" in options else None)
    for name, options in DRAFTER.items():
        out[name] = dict(options, drafter=drafter, neighbours=table if options["method"] == "lantern" else None)
    return out


def quality(vq, tokens: torch.Tensor, labels: torch.Tensor, side: int) -> dict:
    from lantern.tiny.evaluate import evaluate_samples

    with torch.no_grad():
        images = vq.decode_codes(tokens, side, side)
    figures = evaluate_samples(images, labels)
    return dict(class_accuracy=figures["class_accuracy"], fd=figures["fd"])


def run(report: Report, batches=(1, 8), repeats: int = 2, images: int = 16, clock: str = "wall") -> dict:
    from lantern.pretrained import load_tiny

    if not lantern.fused_ops("cpu").get("verify"):
        print("sjd: the cpu backend is unavailable; skipped", flush=True)
        return {}
    gpt, drafter, table, sampling = setup()
    vq = load_tiny("cpu").vq
    side = gpt.config.grid_size
    summary = {}
    with lantern.fused("cpu"):
        for B in batches:
            calls = -(-images // B)
            labels = [(torch.arange(B) + i * B) % gpt.config.num_classes for i in range(calls)]
            last = {}

            def call(name, options):
                def go():
                    outputs = [lantern.generate(gpt, chunk, **options, **dict(sampling, seed=sampling["seed"] + i))
                               for i, chunk in enumerate(labels)]
                    last[name] = outputs
                return go

            medians = interleaved_medians({n: call(n, o) for n, o in contenders(drafter, table).items()},
                                          repeats=repeats, warmup=1, clock=CLOCKS[clock])
            case = f"B={B} x{calls} ({clock} clock)"
            rows = {}
            for name, seconds in medians.items():
                tokens = torch.cat([out[0] for out in last[name]])
                figures = quality(vq, tokens, torch.cat(labels), side)
                if name != "ar":
                    figures.update(tau=tokens_per_row_step([out[1] for out in last[name]]))
                report.add("sjd", case, name, seconds, **figures)
                figures["speedup"] = medians["ar"] / seconds
                rows[name] = figures
                tau = f"tau {figures['tau']:.2f}" if "tau" in figures else "tau 1.00"
                print(f"{'sjd':>6} {case:<24} {name:<16} {figures['speedup']:5.2f}x  {tau}  accuracy "
                      f"{figures['class_accuracy']:.3f}  FD {figures['fd']:.2f}", flush=True)
            summary[B] = rows
    return summary


def main() -> None:
    batches_main(run, __doc__, images=16, json_path="bench/results/sjd.json")


if __name__ == "__main__":
    main()
