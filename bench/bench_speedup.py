"""The default settings against AR on the default model, end to end: ``lantern.generate`` with method
"lantern" (the CLI's defaults: tree="auto", k = 1000, δ = 0.1) and method "spec" (exact, δ = 0, tree="auto")
against method "ar", fused cpu backend, at batch 1, 8 and 40 (images per call; classes cycled), with the
shipped EAGLE drafter and the model's sampling defaults. One timed sample generates at least ``--images``
images (10: at batch 1, ten calls, one image of each class, seeds 0..9), so that τ's spread between single
images does not decide a ratio. Each batch size times the three methods in
alternation (medians of ``--repeats``), so the ratios come from one run under one load. The cost model of
``tree="auto"`` is resolved (cached or calibrated) before the timed calls, as the CLI does.

    python -m bench.bench_speedup [--quick] [--batches 1 8 40] [--repeats 3] [--images 10] [--clock wall|cpu]
                                  [--tiny-dir DIR] [--json PATH]

Prints per batch size: median seconds per call, the speed-ups, τ, and the plans the planner chose.
``python -m bench`` includes it (batches 1 and 8 with --quick).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import lantern

from .common import Report, interleaved_medians

LANTERN = dict(method="lantern", tree="auto", k=1000, delta=0.1)
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
EXACT = dict(method="spec", tree="auto")


def setup(directory=None):
    """(gpt, drafter, neighbour table [V, 1000], sampling settings) of the shipped tiny model."""
    from lantern.neighbours import neighbour_table
    from lantern.pretrained import TINY_DIR, load_tiny, load_tiny_drafter

    directory = Path(directory) if directory else TINY_DIR
    tiny = load_tiny("cpu", directory=directory)
    drafter = load_tiny_drafter(tiny.gpt, directory=directory)
    table = neighbour_table(tiny.vq.quantize.embedding.weight, LANTERN["k"], normalize=True)
    defaults = tiny.meta.get("sampling", {})
    sampling = dict(cfg_scale=defaults.get("cfg_scale", 2.0), top_k=defaults.get("top_k", 0),
                    top_p=defaults.get("top_p", 1.0), temperature=defaults.get("temperature", 1.0), seed=0)
    return tiny.gpt, drafter, table, sampling


def run(report: Report, batches=(1, 8, 40), repeats: int = 3, directory=None, images: int = 10,
        clock: str = "wall") -> dict:
    from lantern.decoding import SpecConfig, resolve_cost_model

    if not lantern.fused_ops("cpu").get("verify"):
        print("speedup: the cpu backend is unavailable; skipped", flush=True)
        return {}
    gpt, drafter, table, sampling = setup(directory)
    L = gpt.config.block_size
    summary = {}
    with lantern.fused("cpu"):
        for B in batches:
            calls = -(-images // B)  # one timed sample: `calls` generate calls of B images (every class at B = 1)
            labels = [(torch.arange(B) + i * B) % gpt.config.num_classes for i in range(calls)]
            methods = {"ar": {}, "lantern": LANTERN, "exact": EXACT}
            for name in ("lantern", "exact"):
                opts = methods[name]
                config = SpecConfig(method=opts["method"], k=opts.get("k", 1000), delta=opts.get("delta", 0.1))
                cost_model = resolve_cost_model(gpt, drafter, labels[0], table, config=config, **sampling)
                methods[name] = dict(opts, drafter=drafter, neighbours=table, cost_model=cost_model)
            last = {}

            def call(name, options):
                def go():
                    stats = []
                    for i, chunk in enumerate(labels):
                        settings = dict(sampling, seed=sampling["seed"] + i)
                        stats.append(lantern.generate(gpt, chunk, **(options or {"method": "ar"}), **settings)[1])
                    last[name] = stats
                return go

            medians = interleaved_medians({n: call(n, o) for n, o in methods.items()}, repeats=repeats, warmup=1,
                                          clock=CLOCKS[clock])
            case = f"B={B} L={L} x{calls}" + (" (cpu clock)" if clock == "cpu" else "")
            for name, seconds in medians.items():
                extra = {} if name == "ar" else _figures(last[name])
                report.add("speedup", case, name, seconds, **extra)
            row = {}
            for name in ("lantern", "exact"):
                row[name] = report.ratio("speedup", case, "ar", name)
                figures = _figures(last[name])
                plans = ", ".join(f"{p} {n}" for p, n in sorted(figures["plans"].items(), key=lambda kv: -kv[1]))
                print(f"{'speedup':>18} {case:<34} {name}: tau {figures['tau']:.2f}, steps: {plans}", flush=True)
                row[name + "_tau"] = figures["tau"]
                row[name + "_plans"] = figures["plans"]
            summary[B] = row
    return summary


def _figures(all_stats) -> dict:
    """τ and steps per plan over the calls of one timed sample."""
    plans = {}
    for stats in all_stats:
        for plan, n in stats.plan_counts.items():
            plans[plan] = plans.get(plan, 0) + n
    tau = sum(s.emitted for s in all_stats) / max(sum(s.row_steps for s in all_stats), 1)
    return dict(tau=tau, plans=plans)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, 2 repeats")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 40])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=10, help="images per timed sample (batch 1: one call each)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time (one thread: an idle machine's wall time; see bench_plans)")
    parser.add_argument("--tiny-dir", default=None, help="the tiny model's folder (default: the shipped weights)")
    parser.add_argument("--json", default="bench/results/speedup.json")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    report = Report()
    batches, repeats = ((1, 8), 2) if args.quick else (tuple(args.batches), args.repeats)
    run(report, batches=batches, repeats=repeats, directory=args.tiny_dir, images=args.images, clock=args.clock)
    report.write(args.json)


if __name__ == "__main__":
    main()
