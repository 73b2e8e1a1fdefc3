"""Where a compiled decoding step's time goes on a CPU: the target's forward, the drafter's forwards, and the
rest (the eager code around them: draft sampling, verify, commit, the step's figures), per case and batch, next
to generate_ar's compiled loop (its forwards and its rest) in the same run.

    python -m bench.step_split [--batches 1 10] [--cases lantern-chain2 lantern-chain4] [--repeats 5]

The shipped tiny model in its default dtype, the cpu kernels, ``compile=True`` (AOT packages, docs/compile.md),
the thread count torch has. Each of a case's runs generates one image per row of the batch with a fixed tree
(``tree="chain"``, so the steps do not depend on timing); runs of the case and of AR alternate, and each
figure is the median over ``--repeats`` runs. Forwards are timed around their package calls (the CPU runs
them synchronously); "rest" is the run's wall time less its forwards.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch

import lantern
from lantern.decoding import aot, generate_ar

from .bench_speedup import setup
from .common import header

CASES = {f"lantern-chain{d}": dict(method="lantern", tree="chain", depth=d, k=1000, delta=0.1) for d in (1, 2, 3, 4, 5)}
CASES["lantern-static2-1-1"] = dict(method="lantern", tree="static", static_widths=(2, 1, 1), k=1000, delta=0.1)
CASES["exact-static2-1-1"] = dict(method="spec", tree="static", static_widths=(2, 1, 1))
CASES["sjd-window4"] = dict(method="sjd", tree="chain", window=4)


class ForwardTimer:
    """Seconds spent in each kind of package call (``AotForward.kind``) while active."""

    def __init__(self):
        self.seconds = collections.Counter()

    def __enter__(self):
        timer, self.call = self, aot.AotForward.__call__
        call = self.call

        def timed(forward, *args):
            t0 = time.perf_counter()
            out = call(forward, *args)
            timer.seconds[forward.kind] += time.perf_counter() - t0
            return out

        aot.AotForward.__call__ = timed
        return self

    def __exit__(self, *exc):
        aot.AotForward.__call__ = self.call


def split(fn) -> dict:
    """One run of fn, timed: {total, target, drafter, rest} seconds."""
    with ForwardTimer() as timer:
        t0 = time.perf_counter()
        fn()
        total = time.perf_counter() - t0
    target, drafter = timer.seconds["target forward"], timer.seconds["drafter forward"]
    return dict(total=total, target=target, drafter=drafter, rest=total - target - drafter)


def run(batches=(1, 10), cases=("lantern-chain2", "lantern-chain4"), repeats: int = 5) -> dict:
    gpt, drafter, table, sampling = setup()
    summary = {}
    with lantern.fused("cpu"):
        for B in batches:
            labels = torch.arange(B) % gpt.config.num_classes
            ar = lambda: generate_ar(gpt, labels, compile=True, **sampling)  # noqa: E731
            for case in cases:
                options = dict(CASES[case], compile=True)
                if options["method"] != "sjd":
                    options.update(drafter=drafter, neighbours=table if options["method"] == "lantern" else None)
                steps = []

                def spec():
                    steps.append(lantern.generate(gpt, labels, **options, **sampling)[1].steps)

                spec(), ar()  # packages loaded (or compiled), caches warm
                runs = {"ar": [], case: []}
                for _ in range(repeats):
                    runs[case].append(split(spec))
                    runs["ar"].append(split(ar))
                rows = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
                rows[case]["steps"], rows["ar"]["steps"] = steps[-1], gpt.config.block_size - 1
                summary[f"B={B} {case}"] = rows
                print_rows(B, case, rows)
    return summary


def print_rows(B: int, case: str, rows: dict) -> None:
    print(f"\nbatch {B}, {torch.get_num_threads()} threads: {case} against generate_ar (compiled), medians, ms")
    print(f"{'contender':<20} {'steps':>5} {'total':>8} {'target':>8} {'drafter':>8} {'rest':>8} {'rest/step':>9} "
          f"{'ms/step':>8}")
    for name, r in rows.items():
        n = max(r["steps"], 1)
        print(f"{name:<20} {r['steps']:5d} {1e3 * r['total']:8.1f} {1e3 * r['target']:8.1f} "
              f"{1e3 * r['drafter']:8.1f} {1e3 * r['rest']:8.1f} {1e3 * r['rest'] / n:9.2f} "
              f"{1e3 * r['total'] / n:8.2f}")
    print(f"{case} / ar: {rows['ar']['total'] / rows[case]['total']:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 10])
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=["lantern-chain2", "lantern-chain4"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(header())
    run(args.batches, args.cases, args.repeats)


if __name__ == "__main__":
    main()
