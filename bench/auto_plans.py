"""tree="auto" against the fixed plans it chooses from and generate_ar's compiled loop, whole runs of one batch,
in one process: what the planner's choice costs or gains against the best plan it could have held.

    python -m bench.auto_plans [--batch 10] [--plans chain2 chain3] [--rounds 7] [--remeasure]

The shipped tiny model in its default dtype, the cpu kernels, ``compile=True`` (AOT packages, docs/compile.md),
LANTERN at k 1000, δ 0.1 (the demo's settings), one image per row of the batch (labels cycled), the thread
count torch has. Each round runs every contender once, in turn (tree="auto", each fixed plan, compiled AR);
the figures are medians over rounds, in ms per batch, and the ratio to compiled AR. The last line gives
tree="auto"'s plans and its prediction (tokens/s of the plan, the runner-up and AR, whole-run rates at
batch > 1, docs/planner.md); the line before it, each contender's predicted ms per batch from the cost model
the run used (``Planner.run_seconds``; compiled AR: L - 1 steps of the calibration's compiled AR step), beside
the measured median: where the prediction misses, and on which side. ``--remeasure`` calibrates the cost
model anew before the rounds (default: the cached one, as a user's run would).
"""
from __future__ import annotations

import argparse

import torch

import lantern
from lantern.decoding import SpecConfig, generate_ar

from .bench_speedup import setup
from .common import header, interleaved_medians

FIXED = {"chain1": dict(tree="chain", depth=1), "chain2": dict(tree="chain", depth=2),
         "chain3": dict(tree="chain", depth=3), "chain4": dict(tree="chain", depth=4),
         "static2-1-1": dict(tree="static", static_widths=(2, 1, 1))}


CONFIG = SpecConfig(method="lantern", k=1000, delta=0.1, compile=True)  # lantern_run's settings


def run(batch: int = 10, plans=("chain2", "chain3"), rounds: int = 7, remeasure: bool = False) -> dict:
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
        if remeasure:
            lantern_run(tree="chain", depth=1)  # the packages, before the calibration times steps through them
            _cost_model(gpt, drafter, table, labels, sampling, remeasure=True)
        ms = {name: 1e3 * s for name, s in interleaved_medians(contenders, repeats=rounds).items()}
        predicted_ms = _predicted_ms(gpt, drafter, table, labels, plans, sampling)
    ar = ms["compiled AR"]
    print(f"batch {batch}, {torch.get_num_threads()} threads, medians of {rounds} alternated rounds, ms per batch "
          f"(ratio to compiled AR):")
    print("  ".join(f"{name} {v:.0f} ({ar / v:.2f}x)" for name, v in ms.items()))
    stats = last["auto"]
    rates = {name: (round(p["mean_expected_tokens_per_s"]), p["runner_up"],
                    round(p["runner_up_tokens_per_s"] or 0), round(p["ar_expected_tokens_per_s"]))
             for name, p in stats.planner["plans"].items()}
    print("predicted ms (measured/predicted): " + "  ".join(
        f"{name} {v:.0f} ({ms[name] / v:.2f})" for name, v in predicted_ms.items()))
    print(f"auto: plans {stats.plan_counts}; predicted tokens/s (plan, runner-up, its rate, AR) {rates}; "
          f"whole run: {bool(stats.planner.get('whole_run'))}", flush=True)
    return {"ms": ms, "plans": stats.plan_counts, "predicted": rates, "predicted_ms": predicted_ms}


def _cost_model(gpt, drafter, table, labels, sampling, remeasure: bool = False):
    from lantern.decoding import resolve_cost_model

    return resolve_cost_model(gpt, drafter, labels, table, config=CONFIG, remeasure=remeasure, **sampling)


def _predicted_ms(gpt, drafter, table, labels, plans, sampling) -> dict:
    """ms per batch the cost model predicts for each fixed plan and for compiled AR (decoding steps only: no
    prefill)."""
    from lantern.decoding.calibration import COMPILED_AR
    from lantern.decoding.compile_choice import resolve_compile
    from lantern.decoding.config import Sampling
    from lantern.decoding.planner import AcceptanceModel, Planner
    from lantern.decoding.spec import run_compacts

    costs = _cost_model(gpt, drafter, table, labels, sampling)
    candidates = {p.name: p for p in CONFIG.candidates()}
    choice = resolve_compile(CONFIG.compile, gpt.tok_embeddings.weight.device, (gpt, drafter))
    planner = Planner(costs, list(candidates.values()), AcceptanceModel(prior_rates=costs.acceptance),
                      compacts=run_compacts(CONFIG, choice, drafter))
    B, L = labels.shape[0], gpt.config.block_size
    rows = B * Sampling(cfg_scale=sampling["cfg_scale"]).halves
    out = {name: 1e3 * planner.run_seconds(candidates[name], rows, B, L - 1) for name in plans
           if name in candidates}
    if costs.knows(COMPILED_AR):
        out["compiled AR"] = 1e3 * (L - 1) * costs.step_seconds(COMPILED_AR, rows)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=10)
    parser.add_argument("--plans", nargs="+", choices=sorted(FIXED), default=["chain2", "chain3"])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--remeasure", action="store_true", help="calibrate the cost model anew first")
    args = parser.parse_args()
    print(header())
    run(args.batch, args.plans, args.rounds, args.remeasure)


if __name__ == "__main__":
    main()
