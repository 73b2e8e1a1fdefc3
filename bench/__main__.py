"""Run every benchmark: `python -m bench [--quick] [--json PATH]`."""
from __future__ import annotations

import argparse
import os

import torch

from . import (
    bench_checks,
    bench_cspd,
    bench_decode,
    bench_model_costs,
    bench_neighbours,
    bench_speedup,
    bench_tree_attention,
    bench_verify,
)
from .common import Report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller shapes and fewer repeats")
    parser.add_argument("--json", default="bench/results/bench.json", help="where to write the results")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {os.getloadavg()}")
    report = Report()
    bench_verify.run(report, quick=args.quick)
    bench_neighbours.run(report, quick=args.quick)
    bench_tree_attention.run(report, quick=args.quick)
    bench_checks.run(report, quick=args.quick)
    bench_model_costs.run(report, quick=args.quick)
    bench_model_costs.run_dtypes(report, quick=args.quick)
    bench_decode.run(report, quick=args.quick)
    bench_speedup.run(report, batches=(1, 8) if args.quick else (1, 8, 40), repeats=2 if args.quick else 3,
                      methods=bench_speedup.QUICK_METHODS if args.quick else bench_speedup.METHODS)
    if args.quick:  # skipped, with the reason, while the tiny MAR weights are missing
        bench_cspd.run(report, batches=(1, 8), gammas=(8, 32), repeats=1, quality_images=20)
    else:
        bench_cspd.run(report)
    report.write(args.json)


if __name__ == "__main__":
    main()
