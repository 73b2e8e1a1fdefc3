"""tree="auto" against the fixed plans it chooses from and generate_ar's compiled loop, whole runs of one batch,
in one process: what the planner's choice costs or gains against the best plan it could have held.

    python -m bench.auto_plans [--batch 10] [--plans chain2 chain3] [--rounds 7]

The shipped tiny model in its default dtype, the cpu kernels, ``compile=True`` (AOT packages, docs/compile.md),
LANTERN at k 1000, δ 0.1 (the demo's settings), one image per row of the batch (labels cycled), the thread
count torch has. Each round runs every contender once, in turn (tree="auto", each fixed plan, compiled AR);
the figures are medians over rounds, in ms per batch, and the ratio to compiled AR. The last line gives
tree="auto"'s plans and its prediction (tokens/s of the plan, the runner-up and AR, whole-run rates at
batch > 1, docs/planner.md).
"""
from __future__ import annotations

import argparse

import torch

import lantern
from lantern.decoding import generate_ar

from .bench_speedup import setup
from .common import header, interleaved_medians

FIXED = {"chain1": dict(tree="chain", depth=1), "chain2": dict(tree="chain", depth=2),
         "chain3": dict(tree="chain", depth=3), "chain4": dict(tree="chain", depth=4),
         "static2-1-1": dict(tree="static", static_widths=(2, 1, 1))}


def run(batch: int = 10, plans=("chain2", "chain3"), rounds: int = 7) -> dict:
    gpt, drafter, table, sampling = setup()
    labels = torch.arange(batch) % gpt.config.num_classes
    last = {}

    def lantern_run(**tree):
        _, stats = lantern.generate(gpt, labels, method="lantern", k=1000, delta=0.1, drafter=drafter,
                                    neighbours=table, compile=True, **tree, **sampling)
        return stats

    contenders = {"auto": lambda: last.__setitem__("auto", lantern_run())}
    contenders.update({name: (lambda name=name: lantern_run(**FIXED[name])) for name in plans})
    contenders["compiled AR"] = lambda: generate_ar(gpt, labels, compile=True, **sampling)
    with lantern.fused("cpu"):  # the warm-up loads (or compiles) the packages and calibrates the cost model
        ms = {name: 1e3 * s for name, s in interleaved_medians(contenders, repeats=rounds).items()}
    ar = ms["compiled AR"]
    print(f"batch {batch}, {torch.get_num_threads()} threads, medians of {rounds} alternated rounds, ms per batch "
          f"(ratio to compiled AR):")
    print("  ".join(f"{name} {v:.0f} ({ar / v:.2f}x)" for name, v in ms.items()))
    stats = last["auto"]
    predicted = {name: (round(p["mean_expected_tokens_per_s"]), p["runner_up"],
                        round(p["runner_up_tokens_per_s"] or 0), round(p["ar_expected_tokens_per_s"]))
                 for name, p in stats.planner["plans"].items()}
    print(f"auto: plans {stats.plan_counts}; predicted tokens/s (plan, runner-up, its rate, AR) {predicted}; "
          f"whole run: {bool(stats.planner.get('whole_run'))}", flush=True)
    return {"ms": ms, "plans": stats.plan_counts, "predicted": predicted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--plans", nargs="+", choices=sorted(FIXED), default=["chain2", "chain3"])
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(header())
    run(args.batch, args.plans, args.rounds)


if __name__ == "__main__":
    main()
