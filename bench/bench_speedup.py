"""lantern's decoding against the fastest AR sampler a user already has, end to end on the shipped tiny model:
the compiled AR reference loop (``bench/reference_ar.py``: gpt-fast's / LlamaGen ``--compile``'s static-cache
decode step under ``torch.compile(fullgraph=True)``) is the anchor; every contender's ratio is to it.

Contenders (``--methods``; eager and compiled under their own names):
  reference      the compiled AR reference loop (one compile per batch size, paid in the warm-up)
  reference-eager  the same loop without torch.compile
  ar, ar+compile   lantern's AR loop, eager and compile=True
  lantern, lantern+compile   LANTERN (k 1000, delta 0.1, tree auto, the shipped EAGLE drafter)
  lantern-chain[+compile]    LANTERN with a fixed chain of 5 drafts (what tree auto picks most at batch 1)
  exact, exact+compile       exact speculative decoding (delta 0, tree auto)
  sjd, sjd+compile           Jacobi self-drafting, exact (no drafter), tree auto
  default        ``lantern.generate(gpt, labels, drafter=..., neighbours=...)`` with nothing else set: what a
                 user gets (method, tree and compile at the library's defaults)

Fused cpu ops, the model's dtype and sampling defaults. One timed sample generates at least ``--images``
images (batch 1: ten calls, one image of each class, seeds 0..9) so that tau's spread between single images
does not decide a ratio; contenders are timed in alternation (medians of ``--repeats``) after one warm-up
round that compiles every graph and resolves every cost model. The warm-up's compile seconds are printed
apart (``compile_s``: the first calls of new graphs; with inductor's on-disk cache warm they are mostly cache
loads).

    python -m bench.bench_speedup [--quick] [--batches 1 8 40] [--threads 1 2] [--repeats 3] [--images 10]
                                  [--methods ...] [--clock wall|cpu] [--json PATH]

Prints per thread count and batch size: median seconds per sample, tokens/s, tau, and the ratio to the
compiled reference (and to lantern's eager AR). ``python -m bench`` includes it (--quick).
"""
from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import lantern
from lantern.decoding import generate_ar

from .common import Report, interleaved_medians
from .reference_ar import ReferenceAR, ReferenceGPT

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
ANCHOR = "reference"
SPECULATIVE = {"lantern": dict(method="lantern", tree="auto", k=1000, delta=0.1),
               "exact": dict(method="spec", tree="auto"),
               "sjd": dict(method="sjd", tree="auto"),
               # a fixed plan: the chain tree="auto" picks most at batch 1; no calibration, few graphs to compile
               "lantern-chain": dict(method="lantern", tree="chain", depth=5, k=1000, delta=0.1)}
METHODS = ("reference", "reference-eager", "ar", "ar+compile", "lantern", "lantern+compile", "lantern-chain",
           "lantern-chain+compile", "exact", "exact+compile", "sjd", "sjd+compile", "default")
QUICK_METHODS = ("reference", "ar", "ar+compile", "lantern", "lantern+compile", "default")


def setup(directory=None):
    """(gpt, drafter, neighbour table [V, 1000], sampling settings) of the shipped tiny model."""
    from lantern.neighbours import neighbour_table
    from lantern.pretrained import TINY_DIR, load_tiny, load_tiny_drafter

    directory = Path(directory) if directory else TINY_DIR
    tiny = load_tiny("cpu", directory=directory)
    drafter = load_tiny_drafter(tiny.gpt, directory=directory)
    table = neighbour_table(tiny.vq.quantize.embedding.weight, 1000, normalize=True)
    defaults = tiny.meta.get("sampling", {})
    sampling = dict(cfg_scale=defaults.get("cfg_scale", 2.0), top_k=defaults.get("top_k", 0),
                    top_p=defaults.get("top_p", 1.0), temperature=defaults.get("temperature", 1.0), seed=0)
    return tiny.gpt, drafter, table, sampling


def tokens_per_row_step(all_stats) -> float:
    """τ over the SpecStats of several generate calls: tokens emitted per row step."""
    return sum(s.emitted for s in all_stats) / max(sum(s.row_steps for s in all_stats), 1)


class Contenders:
    """The timed samples: ``run(name)`` makes ``len(labels)`` generate calls with one contender; it keeps
    the last sample's stats and the compile seconds of the contender's first sample (the warm-up)."""

    def __init__(self, gpt, drafter, table, sampling, labels):
        self.gpt, self.drafter, self.table, self.sampling, self.labels = gpt, drafter, table, sampling, labels
        self.reference = {}  # name -> its ReferenceAR, made on first use (a copy of the weights each)
        self.stats = {}
        self.compile_s = {}
        self.cost_models = {}

    def run(self, name: str) -> None:
        stats, compile_s = [], 0.0
        for i, chunk in enumerate(self.labels):
            settings = dict(self.sampling, seed=self.sampling["seed"] + i)
            if name.startswith("reference"):
                if name not in self.reference:
                    self.reference[name] = ReferenceAR(ReferenceGPT.from_lantern(self.gpt), compile=name == ANCHOR)
                ar = self.reference[name]
                ar.generate(chunk, cfg_scale=settings["cfg_scale"], temperature=settings["temperature"],
                            top_k=settings["top_k"], seed=settings["seed"])
                compile_s = ar.compile_s
            elif name.startswith("ar"):
                ar_stats = {}
                generate_ar(self.gpt, chunk, compile=name.endswith("+compile"), stats=ar_stats, **settings)
                compile_s += ar_stats.get("compile_s", 0.0)
            else:
                out = lantern.generate(self.gpt, chunk, **self.options(name, chunk), **settings)[1]
                stats.append(out)
                compile_s += out.compile_s
        self.stats[name] = stats
        self.compile_s.setdefault(name, compile_s)

    def options(self, name: str, chunk) -> dict:
        if name == "default":
            return dict(drafter=self.drafter, neighbours=self.table)
        method, _, compiled = name.partition("+")
        options = dict(SPECULATIVE[method], compile=bool(compiled))
        if method != "sjd":
            options.update(drafter=self.drafter, neighbours=self.table if options["method"] == "lantern" else None)
        if options["tree"] != "auto":
            return options
        if name not in self.cost_models:  # resolved before timing, as the CLI does (in the warm-up)
            from lantern.decoding import SpecConfig, resolve_cost_model

            config = SpecConfig(method=options["method"], compile=options["compile"],
                                **{key: options[key] for key in ("k", "delta") if key in options})
            self.cost_models[name] = resolve_cost_model(self.gpt, options.get("drafter"), chunk,
                                                        options.get("neighbours"), config=config, **self.sampling)
        return dict(options, cost_model=self.cost_models[name])

    def tau(self, name: str) -> float:
        """Tokens per row step over the last sample (1 for the AR loops)."""
        stats = self.stats.get(name) or []
        return tokens_per_row_step(stats) if stats else 1.0

    def plans(self, name: str) -> str:
        counts = {}
        for s in self.stats.get(name) or []:
            for plan, n in s.plan_counts.items():
                counts[plan] = counts.get(plan, 0) + n
        return ", ".join(f"{plan} {n}" for plan, n in sorted(counts.items(), key=lambda kv: -kv[1]))


def run(report: Report, batches=(1, 8, 40), threads=(1,), repeats: int = 3, methods=METHODS, directory=None,
        images: int = 10, clock: str = "wall") -> dict:
    if not lantern.fused_ops("cpu").get("verify"):
        print("speedup: the cpu backend is unavailable; skipped", flush=True)
        return {}
    gpt, drafter, table, sampling = setup(directory)
    L = gpt.config.block_size
    methods = [ANCHOR] + [m for m in methods if m != ANCHOR]
    summary = {}
    with lantern.fused("cpu"):
        for n_threads in threads:
            torch.set_num_threads(n_threads)
            for B in batches:
                calls = -(-images // B)  # one timed sample: `calls` calls of B images (every class at B = 1)
                labels = [(torch.arange(B) + i * B) % gpt.config.num_classes for i in range(calls)]
                contenders = Contenders(gpt, drafter, table, sampling, labels)
                medians = interleaved_medians({m: (lambda m=m: contenders.run(m)) for m in methods},
                                              repeats=repeats, warmup=1, clock=CLOCKS[clock])
                case = f"{n_threads}t B={B} L={L} x{calls}" + (" (cpu clock)" if clock == "cpu" else "")
                rows = {}
                for name, seconds in medians.items():
                    row = dict(seconds=seconds, images=calls * B, tokens_per_s=calls * B * L / seconds,
                               tau=contenders.tau(name),
                               vs_reference=medians[ANCHOR] / seconds, compile_s=contenders.compile_s[name],
                               plans=contenders.plans(name))
                    if "ar" in medians:
                        row["vs_ar_eager"] = medians["ar"] / seconds
                    report.add("speedup", case, name, seconds, **row)
                    rows[name] = row
                print_table(case, rows)
                summary[f"{n_threads}t B={B}"] = rows
    return summary


def print_table(case: str, rows: dict) -> None:
    print(f"\n{case}: ratios to the compiled AR reference loop (and to lantern's eager AR)")
    print(f"{'contender':<17} {'ms/image':>9} {'tokens/s':>9} {'tau':>5} {'vs reference':>13} {'vs ar eager':>12} "
          f"{'compile s':>10}  plans")
    for name, row in rows.items():
        per_image = 1e3 * row["seconds"] / row["images"]
        print(f"{name:<17} {per_image:9.1f} {row['tokens_per_s']:9.0f} {row['tau']:5.2f} "
              f"{row['vs_reference']:12.2f}x {row.get('vs_ar_eager', float('nan')):11.2f}x "
              f"{row['compile_s']:10.1f}  {row['plans']}", flush=True)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="batches 1 and 8, one thread, 2 repeats, "
                                                             f"contenders {' '.join(QUICK_METHODS)}")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 40])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--images", type=int, default=10, help="images per timed sample (batch 1: one call each)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: the process's CPU time (one thread: an idle machine's wall time)")
    parser.add_argument("--tiny-dir", default=None, help="the tiny model's folder (default: the shipped weights)")
    parser.add_argument("--json", default="bench/results/speedup.json")
    args = parser.parse_args()
    print(f"torch {torch.__version__}, load average {os.getloadavg()}, {time.strftime('%Y-%m-%d %H:%M')}")
    report = Report()
    if args.quick:
        args.batches, args.threads, args.repeats, args.methods = [1, 8], [1], 2, list(QUICK_METHODS)
    run(report, batches=args.batches, threads=args.threads, repeats=args.repeats, methods=args.methods,
        directory=args.tiny_dir, images=args.images, clock=args.clock)
    report.write(args.json)


if __name__ == "__main__":
    main()
