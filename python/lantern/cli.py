"""`lantern` command line.

  lantern generate   sample images with a LlamaGen-architecture model (the shipped tiny default, or
                     official checkpoints), write a PNG grid, print tokens/s (and quality for the tiny model)
  lantern demo       verification statistics on synthetic draft trees (delta = 0 vs delta > 0)
"""
from __future__ import annotations

import argparse
import json
import sys


def _demo(args: argparse.Namespace) -> int:
    from .demo import DemoConfig, run_demo

    cfg = DemoConfig(vocab=args.vocab, rows=args.rows, neighbours=args.k, seed=args.seed)
    if args.fused:
        from . import enable_fused

        enable_fused(args.fused)
    rows = run_demo(cfg, deltas=tuple(args.delta))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
        print(f"wrote {args.json}")
    return 0


def _generate(args: argparse.Namespace) -> int:
    from .generate_cli import run_generate

    return run_generate(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lantern", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    from .generate_cli import add_generate_parser

    add_generate_parser(sub).set_defaults(func=_generate)
    demo = sub.add_parser("demo", help="verify synthetic draft trees at several delta / lambda settings and "
                                       "print acceptance statistics (tau, acceptance rate)")
    demo.add_argument("--vocab", type=int, default=4096, help="vocabulary (codebook) size V (default 4096)")
    demo.add_argument("--rows", type=int, default=256, help="batch rows, each with its own tree (default 256)")
    demo.add_argument("--k", type=int, default=64, help="neighbours merged at most per candidate (default 64)")
    demo.add_argument("--delta", type=float, nargs="+", default=[0.0, 0.05, 0.1, 0.2, 0.3],
                      help="total-variation budgets to compare; 0 = exact speculative sampling")
    demo.add_argument("--seed", type=int, default=0, help="seed of the synthetic data and the verify stream")
    demo.add_argument("--fused", default=None, help="run through a fused backend: cpu | cuda | triton | auto")
    demo.add_argument("--json", default=None, metavar="PATH", help="also write the statistics as JSON")
    demo.set_defaults(func=_demo)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
