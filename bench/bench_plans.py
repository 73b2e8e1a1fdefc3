"""What each draft plan buys on the shipped tiny model: τ, the acceptance per draft level and the speed-up
against AR of every fixed plan tree="auto" chooses from (sampled and top-1 chains, static trees of sampled
drafts, an EAGLE-2 tree), exact (δ = 0) and LANTERN (k = 1000, δ = 0.1), at each batch size. One timed
sample generates at least ``--images`` images (batch 1: one call per image, seeds 0..); AR and the plans
are timed in alternation, medians of ``--repeats``.

    python -m bench.bench_plans [--batches 1 8 40] [--repeats 2] [--images 10] [--clock wall|cpu] [--json PATH]

``--clock cpu`` times with the process's CPU time instead of the wall clock: with one torch thread the two
agree on an idle machine, and on a shared one the CPU time leaves out the time other jobs took the core
(not their effect on caches and memory bandwidth). The acceptance of level d is P(accept d | accepted
d - 1) over the rows whose image had room for level d.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import lantern

from .bench_speedup import setup
from .common import Report

PLANS = {
    "chain1": dict(tree="chain", depth=1, draft="sampled"),
    "chain2": dict(tree="chain", depth=2, draft="sampled"),
    "chain3": dict(tree="chain", depth=3, draft="sampled"),
    "chain4": dict(tree="chain", depth=4, draft="sampled"),
    "top1chain2": dict(tree="chain", depth=2, draft="deterministic"),
    "static2-1-1": dict(tree="static", static_widths=(2, 1, 1)),
    "static2-2-1-1": dict(tree="static", static_widths=(2, 2, 1, 1)),
    "tree8": dict(tree="dynamic", depth=4, top_per_node=3, n_nodes=8),
}
METHODS = {"exact": dict(method="spec"), "lantern": dict(method="lantern", k=1000, delta=0.1)}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def level_acceptance(all_stats, depth: int):
    """P(accept level d | accepted d - 1), d = 1..depth, over the steps' rows (accept_lens)."""
    lens = torch.cat([a for stats in all_stats for a in stats.accept_lens])
    reached = [(lens >= d).sum().item() for d in range(depth + 1)]
    return [reached[d] / reached[d - 1] if reached[d - 1] else None for d in range(1, depth + 1)]


def run(report: Report, batches=(1, 8), repeats: int = 2, images: int = 10, clock: str = "wall") -> dict:
    if not lantern.fused_ops("cpu").get("verify"):
        print("plans: the cpu backend is unavailable; skipped", flush=True)
        return {}
    gpt, drafter, table, sampling = setup()
    tick = CLOCKS[clock]
    summary = {}
    with lantern.fused("cpu"):
        for B in batches:
            calls = -(-images // B)
            labels = [(torch.arange(B) + i * B) % gpt.config.num_classes for i in range(calls)]
            contenders = {"ar": dict(method="ar")}
            for m, mopts in METHODS.items():
                for p, popts in PLANS.items():
                    contenders[f"{m} {p}"] = dict(mopts, **popts, drafter=drafter, neighbours=table)
            times = {name: [] for name in contenders}
            last = {}
            for rep in range(repeats + 1):  # the first round warms up
                for name, options in contenders.items():
                    t0 = tick()
                    stats = [lantern.generate(gpt, chunk, **options, **dict(sampling, seed=sampling["seed"] + i))[1]
                             for i, chunk in enumerate(labels)]
                    if rep > 0:
                        times[name].append(tick() - t0)
                    last[name] = stats
            case = f"B={B} x{calls} ({clock} clock)"
            ar = statistics.median(times["ar"])
            report.add("plans", case, "ar", ar)
            rows = {}
            for name in contenders:
                if name == "ar":
                    continue
                seconds = statistics.median(times[name])
                stats = last[name]
                tau = sum(s.emitted for s in stats) / max(sum(s.row_steps for s in stats), 1)
                plan = PLANS[name.split()[1]]
                depth = max(len(plan.get("static_widths", ())), plan.get("depth", 0))
                levels = level_acceptance(stats, depth)
                report.add("plans", case, name, seconds, tau=tau, level_acceptance=levels)
                rows[name] = dict(speedup=ar / seconds, tau=tau, level_acceptance=levels)
                shown = ", ".join("-" if a is None else f"{a:.2f}" for a in levels)
                print(f"{'plans':>18} {case:<34} {name:<22} {ar / seconds:5.2f}x  tau {tau:.2f}  "
                      f"acceptance per level [{shown}]", flush=True)
            summary[B] = rows
    return summary


def main() -> None:
    batches_main(run, __doc__, images=10, json_path="bench/results/plans.json")


def batches_main(run, doc: str, images: int, json_path: str) -> None:
    """The command line of a bench whose ``run(report, batches, repeats, images, clock)`` times whole runs."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--images", type=int, default=images)
    parser.add_argument("--clock", choices=list(CLOCKS), default="wall")
    parser.add_argument("--json", default=json_path)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    report = Report()
    run(report, batches=tuple(args.batches), repeats=args.repeats, images=args.images, clock=args.clock)
    report.write(args.json)


if __name__ == "__main__":
    main()
