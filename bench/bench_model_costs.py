"""Per-forward costs of the tiny model's shape against its EAGLE drafter at batch 1 (two rows: classifier-free
guidance), under the fused cpu backend, timed in alternation in one run. Weights are random: the cost of a
forward does not depend on their values, so the shipped shape and the earlier 4-layer one compare on equal
terms (docs/tiny_model.md).

For each shape (layers x width):
- target: the cached forward over T new tokens (T = 1 is an AR step; T > 1 a draft tree) at a mid-image prefix;
- drafter: one depth of drafting, i.e. ``EagleDrafter.expand`` over a partial tree of T nodes with its logits
  (the loop calls it once per depth);
- ratios drafter(T=1) / target(T=1) and drafter(T=8) / target(T=1): speculation pays only when they are small
  (LlamaGen-XL's 36 layers against EAGLE's one make it a few percent);
- matmul share: the fraction of the target's T = 1 forward spent in matrix products (torch.profiler self CPU
  time of aten::mm / addmm / bmm), i.e. how far the forward is bound by weight reads and arithmetic rather
  than by per-op dispatch.

``run_dtypes``: the same target forward in float32 against bfloat16 at batch 1, 8 and 40 (what
``models.decode_dtype`` chooses between on a CPU).

`python -m bench.bench_model_costs` runs both; `python -m bench` includes them.
"""
from __future__ import annotations

import torch

import lantern

from .common import Report, interleaved_medians

SHAPES = {"GPT-tiny-deep (shipped)": "GPT-tiny-deep", "GPT-tiny (4 layers, before)": "GPT-tiny"}
PREFIX = 33  # cached positions (condition + 32 image tokens)
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")


def _models(name: str):
    from lantern.models import build_gpt
    from lantern.models.drafter import EagleDrafter

    torch.manual_seed(0)
    target = build_gpt(name).eval()
    drafter = EagleDrafter(target.config).bind(target).eval()
    return target, drafter


def _target_step(target, rows: int, T: int):
    target.setup_cache(rows, PREFIX + 64)
    cache_len = torch.full((rows,), PREFIX, dtype=torch.int64)
    tokens = torch.zeros(rows, T, dtype=torch.int64)
    positions = torch.arange(PREFIX, PREFIX + T).expand(rows, T) - target.config.cond_len
    return lambda: target(tokens, cache_len=cache_len, positions=positions)


def _drafter_step(drafter, rows: int, T: int):
    drafter.reset(None, rows, PREFIX + 64)
    drafter.cache_len = torch.full((rows,), PREFIX - 1, dtype=torch.int64)
    tokens = torch.zeros(rows, T, dtype=torch.int64)
    parents = (torch.arange(T) - 1).expand(rows, T)  # a chain hanging off the root
    state = torch.randn(rows, T, drafter.config.dim)
    positions = torch.arange(PREFIX, PREFIX + T).expand(rows, T) - 1
    return lambda: drafter.expand(tokens, parents, state, positions)


def matmul_share(fn, repeats: int = 10) -> float:
    from torch.profiler import profile

    fn()
    with profile() as prof:
        for _ in range(repeats):
            fn()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    mm = sum(e.self_cpu_time_total for e in events if e.key in MATMUL_OPS)
    return mm / total


def run(report: Report, quick: bool = False) -> dict:
    if not lantern.fused_ops("cpu").get("tree_attention"):
        print("model_costs: the cpu backend is unavailable; skipped", flush=True)
        return {}
    rows = 2  # batch 1 with classifier-free guidance
    widths = (1, 8) if quick else (1, 8, 16, 32)
    summary = {}
    with lantern.fused("cpu"), torch.inference_mode():
        for name, config_name in SHAPES.items():
            target, drafter = _models(config_name)
            cfg = target.config
            case = f"{name}: {cfg.n_layer}x{cfg.dim}"
            fns = {f"target T={T}": _target_step(target, rows, T) for T in widths}
            fns.update({f"drafter T={T}": _drafter_step(drafter, rows, T) for T in (1, 8)})
            times = interleaved_medians(fns, repeats=5 if quick else 11)
            for impl, seconds in times.items():
                report.add("model_costs", case, impl, seconds)
            one = report.ratio("model_costs", case, "drafter T=1", "target T=1")
            eight = report.ratio("model_costs", case, "drafter T=8", "target T=1")
            share = matmul_share(fns["target T=1"])
            report.rows.append(dict(bench="model_costs", case=case, matmul_share=share))
            print(f"{'model_costs':>18} {case:<34} matmul share of a T=1 target forward {100 * share:.0f}%", flush=True)
            summary[case] = dict(params_m=sum(p.numel() for p in target.parameters()) / 1e6,
                                 drafter_over_target=one, drafter8_over_target=eight,
                                 matmul_share=share, **{k: v for k, v in times.items()})
            target.free_cache()
            drafter.release()
    return summary


def run_dtypes(report: Report, quick: bool = False) -> dict:
    """The shipped shape's target forward in float32 against bfloat16 (random weights), at 2, 16 and 80 rows
    (batch 1, 8, 40 with guidance) over T = 1, 2, 4 new tokens, timed in alternation: what
    ``models.decode_dtype`` chooses between on a CPU."""
    if not lantern.fused_ops("cpu").get("tree_attention"):
        return {}
    target32, _ = _models("GPT-tiny-deep")
    target16 = _models("GPT-tiny-deep")[0].to(torch.bfloat16)
    summary = {}
    with lantern.fused("cpu"), torch.inference_mode():
        for rows in (2, 16, 80):
            case = f"GPT-tiny-deep rows={rows}"
            fns = {}
            for name, target in (("float32", target32), ("bfloat16", target16)):
                for T in (1, 2, 4):
                    fns[f"{name} T={T}"] = _target_step(target, rows, T)
            times = interleaved_medians(fns, repeats=3 if quick else 7)
            for impl, seconds in times.items():
                report.add("dtype_costs", case, impl, seconds)
            for T in (1, 2, 4):
                report.ratio("dtype_costs", case, f"float32 T={T}", f"bfloat16 T={T}")
            for name in ("float32", "bfloat16"):
                report.ratio("dtype_costs", case, f"{name} T=4", f"{name} T=1")
            summary[rows] = times
    return summary


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default="bench/results/model_costs.json")
    args = parser.parse_args()
    report = Report()
    run(report, quick=args.quick)
    run_dtypes(report, quick=args.quick)
    report.write(args.json)
